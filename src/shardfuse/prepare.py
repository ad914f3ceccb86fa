"""Prepare one dataset: a seeded train/validation/test split written as Parquet, for any of three tasks.

Run by hand:

    python -m shardfuse.prepare --name digits \
        --spec-json '{"source": "digits", "test_fraction": 0.2, "seed": 0}' --out-dir results/datasets/digits

Writes OUT_DIR/train.parquet, OUT_DIR/val.parquet, OUT_DIR/test.parquet and OUT_DIR/dataset.json (each
atomically; dataset.json last, so its presence means the split is complete). The same spec gives
byte-identical files. The inputs take one of three layouts, which dataset.json's ``input`` records
(kind, shape, dtype):

  numeric  x0..x{F-1} (float32); shape [F]
  tensor   one column ``x`` of fixed_size_list<float32>[prod(shape)], its field's metadata
           {"shardfuse.shape": "[C, H, W]"} (any shape); digits_images, image_folder, npz, and a
           Parquet list column
  tokens   one column ``tokens`` of fixed_size_list<uint16>[block_size + 1] (int32 when vocab_size >
           65535): block_size inputs and, shifted by one, block_size next-token targets; text

and the targets follow by ``task``: classification ``label`` (int64 in [0, C)); regression y0..y{K-1}
(float32; dataset.json adds ``target_names``); causal_lm none (dataset.json adds ``vocab_size``,
``block_size``, ``num_tokens`` and ``tokenizer``). num_features is prod(shape); feature_names is []
for a tensor; the tasks other than classification have num_classes 0 and label_names [].

The test split (``test_fraction`` of the rows, default 0.2) is drawn first and does not depend on
``val_fraction``; the validation split (``val_fraction`` of all rows, default 0.1, drawn the same way)
is carved from the remaining rows, and train.parquet holds the rest. Classification splits are
stratified by class; regression rows and text blocks are split at random (seeded). Choices such as
greedy soup's are made on val.parquet, never on the test split. val_fraction 0 writes an empty
val.parquet with the same schema. Rows are written in a seeded random order (user files are often sorted
by label; the synthetic generator draws rows at random already), since partition keeps the input's
order within a shard and the shard reader's first epoch follows the file row group by row group.

Sources (config/README.md's dataset-keys table has every key): digits, digits_images (the same rows and
split as 1x8x8 images) and image_folder (path/<class>/*.png|*.jpg|*.jpeg) give classification;
diabetes regression; synthetic (streamed chunk by chunk), parquet, csv and npz either (classification
unless ``task`` says); text (the files' bytes or a user tokenizer's ids; ``{stdlib}`` in paths is the
Python standard library) causal_lm.
A csv or parquet file's ``categorical_columns`` are one-hot encoded (``column=category`` features) with
the train split's categories; dataset.json adds ``categories`` and ``unseen_categories``.
Any classification source also takes ``classes``: keep only the rows whose label is one of these (e.g.
[0, 1, 2] for digits). The label space stays the whole data's: num_classes, label_names and the label
codes are unchanged, so a model trained on a subset has the full output layer.

Each source is a record (:mod:`shardfuse.data.sources.registry`) naming its class in a source module,
which checks its own keys and gives the rows; the task's layout of targets (:mod:`shardfuse.data.labels`)
says how they are split and stored. The library (:mod:`shardfuse.data.sources.dataset`) validates the
spec, asks the source and writes the files; this stage is its command line.
"""

from __future__ import annotations

from shardfuse.console.errors import run_cli
from shardfuse.data.sources.dataset import describe, prepare
from shardfuse.io import StageParser, parse_json_arg


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="dataset name, recorded in dataset.json")
    parser.add_argument("--spec-json", required=True, help="the dataset spec as a JSON object")
    parser.add_argument(
        "--out-dir", required=True, help="directory for train/val/test.parquet and dataset.json"
    )
    args = parser.parse_args(argv)
    info = prepare(args.name, parse_json_arg(args.spec_json, "--spec-json"), args.out_dir)
    print(
        f"{info['name']} ({info['task']}): {info['rows']['train']} train / {info['rows']['val']} val / "
        f"{info['rows']['test']} test rows, {describe(info)} -> {args.out_dir}"
    )


if __name__ == "__main__":
    run_cli(main)
