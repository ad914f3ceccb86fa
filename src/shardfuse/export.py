"""Export a run's merged ``hf`` model as a Hugging Face ``save_pretrained`` folder.

By hand::

    python -m shardfuse.export --weights results/runs/<run>/merged.safetensors --out results/runs/<run>/hf

The folder holds config.json and model.safetensors (or shards and model.safetensors.index.json past
``--max-shard-size``), the generation config, and the pretrained folder's tokenizer files, so
``AutoModelForCausalLM.from_pretrained(folder)`` (or the auto class of the run's task) loads the fused
model with the logits evaluate scored. Tied embeddings come back tied (transformers re-ties them from
``tie_word_embeddings``). The folder is written beside its target and renamed into place.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardfuse.console.errors import run_cli
from shardfuse.io import OutputFolder, StageParser, UserError, atomic_dir

# A transformers folder has no record of shardfuse's own: export marks the folders it writes.
SHARD_SIZE = re.compile(r"^\d+([KMG]i?B)$", re.IGNORECASE)  # what save_pretrained's max_shard_size reads
OUTPUT = OutputFolder("export", "--out", ".shardfuse-export.json", "written_by", "export", mark=True)


def export(weights: Path, out: Path, max_shard_size: str = "2GB") -> list[str]:
    from shardfuse.models.adapter import file_ties, load_state
    from shardfuse.models.catalog import exports_hf, hf_export_names
    from shardfuse.models.hf import export_pretrained
    from shardfuse.models.lora import load_model_weights  # deferred: torch
    from shardfuse.models.registry import build_model
    from shardfuse.models.spec import normalized_spec
    from shardfuse.models.usercode import check_code_unchanged

    tensors, metadata = load_model_weights(weights)
    spec = normalized_spec(metadata.get("model"))
    if not exports_hf(spec["model"]):
        raise UserError(
            f"{weights} holds model {spec['model']!r}; only model {' or '.join(hf_export_names())} exports "
            "to a transformers folder"
        )
    check_code_unchanged(spec["model"], spec.get("code"), "export")
    model = build_model(spec)
    load_state(model, tensors, str(weights), file_ties(metadata))
    with atomic_dir(out, OUTPUT) as tmp:
        return export_pretrained(model, spec, tmp, max_shard_size)


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.export", description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=Path, required=True, help="merged.safetensors of an hf run")
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the folder to write (replaced only if empty or written by export)",
    )
    parser.add_argument("--max-shard-size", default="2GB", help="save_pretrained's shard size (e.g. 500MB)")
    args = parser.parse_args(argv)
    if not SHARD_SIZE.match(args.max_shard_size):
        raise UserError(
            f"--max-shard-size {args.max_shard_size!r} is not a size; give a whole number with KB, MB or GB "
            "(or KiB, MiB, GiB), e.g. 500MB"
        )
    OUTPUT.check(args.out)  # before the model is built
    files = export(args.weights, args.out, args.max_shard_size)
    print(f"exported {args.weights} -> {args.out}: {', '.join(files)}")


if __name__ == "__main__":
    run_cli(main)
