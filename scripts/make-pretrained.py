#!/usr/bin/env python3
"""Make a small "pretrained" GPT-2 folder locally, as `save_pretrained` writes one: no download.

A byte-level BPE tokenizer is trained with `tokenizers` on Python standard library sources, and a GPT-2
with the library's defaults (tied input and output embeddings) is randomly initialised from a seed,
optionally pre-trained for a few steps on the same corpus, and saved with its tokenizer::

    python scripts/make-pretrained.py pretrained/gpt2-stdlib --steps 40

With `--from DIR` it fine-tunes instead: the folder DIR (model and tokenizer) trained `--steps` more on
`--corpus`, e.g. one standard-library package, and saved the same way (the "fine-tunes you already have"
of the mergekit example, config/examples/mergekit.yaml)::

    python scripts/make-pretrained.py pretrained/ft-json --from pretrained/gpt2-stdlib \
        --corpus '{stdlib}/json/*.py' --steps 30

The folder is what `model: hf` with `model_args: {pretrained: DIR}` and a text dataset's
`tokenizer: hf:DIR` read (config/examples/hf_finetune.yaml). The tokenizer carries a chat template
(Zephyr-style: `<|user|>`, `<|assistant|>` headers, each turn ended by the end-of-text token; or the Jinja
file of `--chat-template`), so `messages_field` records can use the folder. Needs
`pip install 'shardfuse[hf]'`.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

# Each turn: a role header, the content, and the end-of-text token (one token, the model learns to stop).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def corpus_files(patterns: list[str]) -> list[str]:
    stdlib = glob.escape(sysconfig.get_paths()["stdlib"])
    files = sorted(
        {p for pattern in patterns for p in glob.glob(pattern.replace("{stdlib}", stdlib), recursive=True)}
    )
    if not files:
        sys.exit(f"make-pretrained: error: no file matches {patterns}; fix --corpus")
    return files


def train_tokenizer(files: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    return tokenizer


def pretrain(
    model, tokenizer, files: list[str], steps: int, block_size: int, seed: int, lr: float = 3e-3
) -> float | None:
    """A few AdamW steps of next-token prediction on blocks of the corpus; the last loss."""
    import torch

    if steps == 0:
        return None
    text = "\n".join(Path(f).read_text(errors="replace") for f in files[:50])
    ids = torch.tensor(tokenizer.encode(text).ids)
    blocks = ids[: len(ids) // (block_size + 1) * (block_size + 1)].view(-1, block_size + 1)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = None
    for _ in range(steps):
        batch = blocks[torch.randint(len(blocks), (16,), generator=generator)]
        out = model(batch[:, :-1], labels=batch[:, :-1].clone())
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        loss = float(out.loss.detach())
    model.eval()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write (replaced atomically)")
    parser.add_argument(
        "--corpus", nargs="+", default=["{stdlib}/json/*.py", "{stdlib}/csv.py", "{stdlib}/textwrap.py"]
    )
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--steps", type=int, default=0, help="pre-training steps (0: random init)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        help="fine-tune this folder (its model and tokenizer) on --corpus instead of making a new one",
    )
    parser.add_argument(
        "--chat-template", type=Path, help="a Jinja chat template file (default: a Zephyr-style one)"
    )
    args = parser.parse_args()
    try:
        chat_template = args.chat_template.read_text() if args.chat_template else CHAT_TEMPLATE
    except OSError as exc:
        sys.exit(f"make-pretrained: error: cannot read --chat-template {args.chat_template} ({exc})")
    try:
        import torch
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    except ImportError:
        sys.exit("make-pretrained: error: needs transformers and tokenizers; pip install 'shardfuse[hf]'")

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    files = corpus_files(args.corpus)
    if args.source is not None:
        fine_tune(args, files)
        return
    tokenizer = train_tokenizer(files, args.vocab_size)
    end = tokenizer.token_to_id("<|endoftext|>")
    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=tokenizer.get_vocab_size(),
        n_positions=args.positions,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.heads,
        bos_token_id=end,
        eos_token_id=end,
    )
    model = GPT2LMHeadModel(config)  # tie_word_embeddings: GPT-2's default
    loss = pretrain(model, tokenizer, files, args.steps, min(64, args.positions - 1), args.seed, args.lr)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    fast.chat_template = chat_template  # saved as chat_template.jinja (or tokenizer_config.json's key)
    save(model, fast, args.out)
    tied = model.lm_head.weight is model.transformer.wte.weight
    trained = f", pre-trained {args.steps} steps (loss {loss:.3f})" if loss is not None else ""
    print(
        f"wrote {args.out}: GPT-2 {args.layers}x{args.width}, vocabulary {config.vocab_size} "
        f"(byte-level BPE on {len(files)} files), tied embeddings {tied}{trained}"
    )


def save(model, tokenizer, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as work:
        staged = Path(work) / "model"
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)


def fine_tune(args, files: list[str]) -> None:
    """--from: the folder's model trained --steps more on the corpus with its own tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if not (args.source / "config.json").is_file():
        sys.exit(f"make-pretrained: error: --from {args.source} is not a save_pretrained folder")
    if args.steps < 1:
        sys.exit("make-pretrained: error: --from needs --steps >= 1 (the fine-tuning steps)")
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.source)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.source)
    block_size = min(64, model.config.n_positions - 1)
    loss = pretrain(model, tokenizer.backend_tokenizer, files, args.steps, block_size, args.seed, args.lr)
    save(model, tokenizer, args.out)
    print(
        f"wrote {args.out}: {args.source} fine-tuned {args.steps} steps on {len(files)} files "
        f"(loss {loss:.3f})"
    )


if __name__ == "__main__":
    main()
