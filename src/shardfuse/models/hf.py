"""The built-in ``hf``: a Hugging Face ``transformers`` model from a local ``save_pretrained`` folder
(``model_args: {pretrained: DIR}``) or from a config (``{config: {model_type: gpt2, ...}}``, randomly
initialised from the run's seed). Never the hub: folders are read with ``local_files_only``.

The auto class follows the task and the input: causal_lm → ``AutoModelForCausalLM``; classification of
token blocks → ``AutoModelForSequenceClassification``; of images → ``AutoModelForImageClassification``.
The model returns a ``ModelOutput``; the adapter (:mod:`shardfuse.models.adapter`) hands on its
``logits``. Its tied embeddings (GPT-2's default) are stored once. ``trust_remote_code`` stays off
unless model_args says so. transformers is the optional extra ``shardfuse[hf]``; the pretrained
folder's files are hashed into the training's name like user code
(:func:`shardfuse.models.usercode.code_fingerprint`), so replacing its weights re-trains. By hand::

    python -c "import json, shardfuse.models.registry as m, shardfuse.models.spec as s
    info = json.load(open('results/datasets/stdlib/dataset.json'))
    print(m.build_model(s.model_spec('hf', {'pretrained': 'pretrained/gpt2-tiny'}, [], info)))"
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardfuse.io import UserError
from shardfuse.models.spec import DataDescription
from shardfuse.models.tasks import task_for

if TYPE_CHECKING:  # torch only where a model is built: the config check imports this module
    import torch
    from torch import nn

INSTALL_HF = "install the extra: pip install 'shardfuse[hf]' (transformers, tokenizers)"


def transformers_module():
    """transformers, quietened (its warnings about unused weights would bury the training log)."""
    try:
        import transformers
    except ImportError:
        raise UserError(f"model hf needs the transformers package; {INSTALL_HF}") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def auto_class_name(description: DataDescription) -> str:
    """The transformers Auto class of the task's head for these inputs (each task lists its own)."""
    name = task_for(description.task).hf_auto_classes.get(description.input_kind)
    if name is None:
        raise UserError(
            f"model hf builds causal LMs on tokens and classifiers on tokens or images, not "
            f"{description.task} on {description.input_kind} inputs; use mlp or a model factory"
        )
    return name


def pretrained_dir(pretrained: Any) -> Path:
    path = Path(str(pretrained))
    if not (path / "config.json").is_file():
        raise UserError(
            f"model_args.pretrained {pretrained!r} is not a save_pretrained folder (no config.json); "
            "give a local folder written by save_pretrained (no hub names: nothing is downloaded)"
        )
    return path


def check_hf_args(model_args: dict[str, Any]) -> None:
    """What can be checked before any job, without importing torch or transformers: the extra is
    installed, exactly one of pretrained and config, a pretrained folder is one."""
    if importlib.util.find_spec("transformers") is None:
        raise UserError(f"model hf needs the transformers package; {INSTALL_HF}")
    pretrained, config = model_args.get("pretrained"), model_args.get("config")
    if (pretrained is None) == (config is None):
        raise UserError(
            "model hf needs exactly one of model_args.pretrained (a save_pretrained folder) and "
            "model_args.config (a transformers config as a mapping with model_type)"
        )
    if pretrained is not None:
        pretrained_dir(pretrained)
    elif not isinstance(config, dict) or "model_type" not in config:
        raise UserError(
            "model_args.config must be a mapping with model_type (e.g. {model_type: gpt2, n_layer: 2}); "
            "see the transformers config class of that model for its keys"
        )


def hf(
    description: DataDescription,
    pretrained: str | None = None,
    config: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    dtype: str | None = None,
) -> nn.Module:
    import torch

    check_hf_args({"pretrained": pretrained, "config": config})
    transformers = transformers_module()
    auto = getattr(transformers, auto_class_name(description))
    task = task_for(description.task)
    labels = task.hf_labels(description)
    torch_dtype = _dtype(dtype)
    if pretrained is not None:
        folder = pretrained_dir(pretrained)
        if torch.get_default_device().type == "meta":  # a shape check: the config's model, no weights read
            hf_config = transformers.AutoConfig.from_pretrained(
                folder, local_files_only=True, trust_remote_code=trust_remote_code, **labels
            )
            model = auto.from_config(hf_config, trust_remote_code=trust_remote_code)
        else:
            model = auto.from_pretrained(
                folder,
                local_files_only=True,
                trust_remote_code=trust_remote_code,
                ignore_mismatched_sizes=bool(labels),  # a new classification head for this dataset's labels
                **labels,
            )
    else:
        settings = {key: value for key, value in config.items() if key != "model_type"}
        if task.next_token:  # the dataset's vocabulary unless the config says
            settings.setdefault("vocab_size", description.num_outputs)
        try:
            hf_config = transformers.AutoConfig.for_model(config["model_type"], **settings, **labels)
        except (ValueError, KeyError) as exc:
            raise UserError(f"model_args.config: {exc}; fix the config") from None
        model = auto.from_config(hf_config, trust_remote_code=trust_remote_code)
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    vocab = getattr(model.config, "vocab_size", None)
    if task.next_token and vocab != description.num_outputs:
        raise UserError(
            f"the hf model's vocabulary has {vocab} tokens but the dataset's has "
            f"{description.num_outputs}; tokenize the dataset with the model's tokenizer (tokenizer: "
            "hf:DIR) or set vocab_size in the config"
        )
    return model


def _dtype(name: str | None) -> torch.dtype | None:
    import torch

    if name is None:
        return None
    allowed = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in allowed:
        raise UserError(f"model_args.dtype {name!r} is not one of {', '.join(allowed)}; fix model_args")
    return allowed[name]


# Files of a pretrained folder that the exported model writes itself; everything else (tokenizer files,
# generation config, chat templates) is copied beside it.
WRITTEN_BY_SAVE = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def export_pretrained(
    model: nn.Module, spec: dict[str, Any], out_dir: Path, max_shard_size: str = "2GB"
) -> list[str]:
    """``model`` (an ``hf`` model with the merged weights loaded) as a ``save_pretrained`` folder in
    ``out_dir`` (which must be fresh: the caller renames it into place), with the pretrained folder's
    other files (tokenizer, generation config) copied beside it; the files written, sorted."""
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    pretrained = spec.get("args", {}).get("pretrained")
    if pretrained is not None:
        for path in files_to_copy(pretrained_dir(pretrained)):
            if not (out_dir / path.name).exists():
                shutil.copy2(path, out_dir / path.name)
    return sorted(p.name for p in out_dir.iterdir())


def files_to_copy(folder: Path) -> list[Path]:
    """The pretrained folder's files an export copies beside the weights (tokenizer, generation config):
    regular files save_pretrained does not write, not hidden, and not a link out of the folder (a link to
    /etc/passwd would be published with the model); a Hugging Face cache snapshot's links into its own
    blobs/ are the files themselves and are followed. A link left out is said on stderr."""
    kept = []
    for path in sorted(folder.iterdir()):
        written = path.name in WRITTEN_BY_SAVE or path.name.startswith("model-")
        if written or path.name.startswith(".") or not path.is_file():
            continue
        if path.is_symlink() and not _inside(path.resolve(), folder):
            print(f"export: not copied: {path} links outside the pretrained folder", file=sys.stderr)
            continue
        kept.append(path)
    return kept


def _inside(target: Path, folder: Path) -> bool:
    """Whether ``target`` lies in ``folder``, or is a blob of the Hugging Face cache whose snapshot
    ``folder`` is (models--org--name/snapshots/<revision>/ links into models--org--name/blobs/)."""
    folder = folder.resolve()
    if target.is_relative_to(folder):
        return True
    cache = folder.parent.parent
    return folder.parent.name == "snapshots" and target.parent == cache / "blobs"
