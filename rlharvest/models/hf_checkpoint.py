"""Build a real Hugging Face checkpoint directory locally: config, safetensors weights, a trained
byte-level BPE tokenizer with its chat template, and ``generation_config.json``.

Tests and demos of the real-model path need a checkpoint that is *exactly* the kind of directory a
user brings (Qwen3-0.6B, Qwen2.5-1.5B-Instruct, Llama-3.2-1B) without downloading one: the same
files, the same loaders (``AutoTokenizer``, ``AutoModelForCausalLM``), the same special tokens and
template conventions. Only the size differs: the shapes are the built-in presets', the weights a
seeded random init, the vocabulary a few hundred BPE merges trained on a built-in corpus.

    rlharvest build-checkpoint --out ./tiny-qwen3 --family qwen3

The checkpoint is built in a hidden directory inside ``--out`` and moved in only once complete,
so a build that fails leaves ``--out`` as it was (absent, if it was). ``--force`` replaces the checkpoint in a
non-empty ``--out``: every file there that belongs to a Hugging Face checkpoint (weights in any
format, shards and their index, config, generation config, tokenizer and chat-template files:
``CHECKPOINT_FILES``) and that the new build does not write is removed, so no shard, index or
tokenizer file of the old checkpoint is loaded with the new one; anything else (a README, notes,
subdirectories) is left alone.
"""

from __future__ import annotations

import fnmatch
import os
import random
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from rlharvest.models.model_presets import PRESETS

FAMILIES = ("qwen3", "qwen2", "llama")
SIZES: dict[str, dict] = PRESETS  # the same shapes as the built-in presets
# The files of a Hugging Face checkpoint directory, by name: what ``--force`` may remove from
# ``--out`` (those the new build does not write); a file matching none of them is kept.
CHECKPOINT_FILES = (
    "config.json", "generation_config.json",
    "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json",
    "tf_model*.h5", "flax_model*.msgpack",
    "tokenizer*", "vocab.json", "vocab.txt", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "spiece.model", "sentencepiece*.model", "chat_template.jinja",
    "chat_template.json",
)
_BUILDING = ".building-"  # a build in progress inside --out (tempfile adds a random suffix)


@dataclass(frozen=True)
class _Specials:
    """A family's special tokens, as its real tokenizer names them."""

    tokens: tuple[str, ...]
    eos: str  # the tokenizer's eos_token
    stops: tuple[str, ...]  # generation_config.json eos_token_id: every id that ends a reply
    pad: str | None
    bos: str | None
    template: str


# ChatML, as Qwen2/Qwen3 instruct models use it (Qwen3's thinking switches left out: a tiny model
# has nothing to think with). eos is <|im_end|>, the end of an assistant turn, as in the
# instruct checkpoints RL starts from; <|endoftext|> also stops (generation_config) and pads.
_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content']"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_QWEN = _Specials(tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), eos="<|im_end|>",
                  stops=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>", bos=None,
                  template=_CHATML)
# Llama 3: BOS on every encode, no pad token (users pad with an eos), <|eot_id|> ends a turn.
_LLAMA = _Specials(tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                           "<|end_header_id|>", "<|eot_id|>"), eos="<|eot_id|>",
                   stops=("<|end_of_text|>", "<|eot_id|>"), pad=None, bos="<|begin_of_text|>",
                   template=_LLAMA3)
_SPECIALS = {"qwen3": _QWEN, "qwen2": _QWEN, "llama": _LLAMA}
_BYTES = 256  # the byte-level alphabet every BPE vocabulary starts from


def _check_family(family: str) -> _Specials:
    if family not in _SPECIALS:
        raise ValueError(f"unknown model family {family!r}; choose one of {list(FAMILIES)}")
    return _SPECIALS[family]


# ---- the built-in corpus ------------------------------------------------------------------------

_NAMES = ("Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "June")
_ITEMS = ("apples", "books", "pencils", "cookies", "marbles", "stickers", "tickets", "shells")
_CHAT = ("Hello! How can I help you today?", "Let's think step by step.",
         "Sure, here is the answer.", "The final answer is", "Please solve the problem below.",
         "You are a helpful assistant.", "Output the final answer after \"####\".")


def default_corpus(documents: int = 600, seed: int = 0) -> list[str]:
    """Word problems with worked steps and ``#### n`` answers, boxed answers, signed, decimal and
    comma-grouped numbers, and chat phrases: what the tests and the demo feed a tokenizer."""
    rng = random.Random(seed)
    docs = list(_CHAT)
    for _ in range(documents):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b, price = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
        total = (a + b) * price
        docs.append(f"{name} has {a} {item} and buys {b} more. Each costs ${price}. "
                    f"How much did all the {item} cost?\n{a} + {b} = {a + b}\n"
                    f"{a + b} * {price} = {total}\n#### {total:,}")
        docs.append(f"The answer is \\boxed{{{rng.randint(-50, 50)}}} or "
                    f"\\boxed{{\\frac{{{rng.randint(1, 9)}}}{{{rng.randint(2, 9)}}}}}; "
                    f"{rng.uniform(-100, 100):.2f} and {rng.randint(1000, 999999):,}.")
    return docs


# ---- tokenizer ----------------------------------------------------------------------------------

def train_tokenizer(corpus: Iterable[str], *, family: str, vocab_size: int):
    """A byte-level BPE tokenizer of ``family``'s conventions, trained on ``corpus``; returns a
    ``PreTrainedTokenizerFast`` ready for ``save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = _check_family(family)
    smallest = _BYTES + len(specials.tokens) + 1
    if vocab_size < smallest:
        raise ValueError(f"vocab_size {vocab_size} is too small: the byte alphabet and "
                         f"{len(specials.tokens)} special tokens need at least {smallest}")
    tok = Tokenizer(models.BPE())
    # Digits one by one, as Qwen and Llama 3 split them: numbers then tokenize the same wherever
    # they appear, which is what arithmetic rewards and answer extraction lean on.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials.tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    if specials.bos is not None:  # Llama 3 prepends BOS to every encode
        tok.post_processor = processors.TemplateProcessing(
            single=f"{specials.bos} $A", pair=f"{specials.bos} $A {specials.bos} $B",
            special_tokens=[(specials.bos, tok.token_to_id(specials.bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials.eos,
                                   pad_token=specials.pad, bos_token=specials.bos,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = specials.template
    return fast


# ---- model --------------------------------------------------------------------------------------

def _model_config(family: str, size: str, vocab_size: int, ids: dict[str, int | None],
                  max_position_embeddings: int) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    shape: dict[str, Any] = dict(SIZES[size])
    common: dict[str, Any] = dict(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, attn_implementation="sdpa", **ids)
    if family == "qwen3":
        return Qwen3Config(**common, **shape)
    if family == "qwen2":  # head_dim is derived (hidden / heads); the presets keep it so
        shape.pop("head_dim")
        return Qwen2Config(**common, **shape)
    return LlamaConfig(**common, **shape)


def _rounded_up(count: int, multiple: int = 64) -> int:
    # Real checkpoints pad the embedding rows beyond the tokenizer (Qwen: 151 936 rows for
    # 151 665 tokens); so does this one, and the padded ids are ones no tokenizer produces.
    return -(-count // multiple) * multiple


def build_checkpoint(out_dir: str | Path, *, family: str = "qwen3", size: str = "tiny",
                     vocab_size: int = 512, corpus: Iterable[str] | None = None, seed: int = 0,
                     max_position_embeddings: int = 1024, overwrite: bool = False) -> Path:
    """Write a loadable HF checkpoint of ``family`` and ``size`` into ``out_dir``; returns it."""
    import torch  # here: `rlharvest --help` and every other command start without it
    from transformers import AutoModelForCausalLM, GenerationConfig

    specials = _check_family(family)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; choose another --out or pass --force")
    tokenizer = train_tokenizer(corpus if corpus is not None else default_corpus(),
                                family=family, vocab_size=vocab_size)
    token_id = tokenizer.convert_tokens_to_ids
    stops = [token_id(t) for t in specials.stops]
    pad = token_id(specials.pad) if specials.pad else None
    ids = dict(bos_token_id=token_id(specials.bos) if specials.bos else None,
               eos_token_id=token_id(specials.eos), pad_token_id=pad)
    config = _model_config(family, size, _rounded_up(len(tokenizer)), ids,
                           max_position_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=pad,
                                               bos_token_id=ids["bos_token_id"])
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    # Built in a hidden directory inside --out (the same filesystem even where --out is a mount
    # point, so moving a file in is a rename) and moved in only once complete: a failed build
    # leaves --out as it was.
    building = Path(tempfile.mkdtemp(prefix=_BUILDING, dir=out))
    try:
        model.save_pretrained(building, safe_serialization=True)
        tokenizer.save_pretrained(building)
        _move_in(building, out)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)  # only ever held the failed build
        raise
    building.rmdir()  # emptied by the move
    return out


def is_checkpoint_file(name: str) -> bool:
    """Whether a file named ``name`` is part of a Hugging Face checkpoint (``CHECKPOINT_FILES``)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in CHECKPOINT_FILES)


def _move_in(built: Path, out: Path) -> None:
    """Put the complete checkpoint in ``built`` into ``out``: each new file replaces its old
    namesake at once, then the old checkpoint's files that the new one lacks are removed
    (shards of a larger model, its index, another tokenizer's files), and the build directories
    of builds killed before they finished. Other files stay."""
    new = {p.name for p in built.iterdir()}
    for name in sorted(new):
        os.replace(built / name, out / name)
    for stale in out.iterdir():
        if stale == built:
            continue
        if stale.name.startswith(_BUILDING) and stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        elif stale.name not in new and is_checkpoint_file(stale.name) and \
                (stale.is_file() or stale.is_symlink()):
            stale.unlink()


# ---- CLI ----------------------------------------------------------------------------------------

app = typer.Typer(add_completion=False, help=__doc__)


@app.command("build-checkpoint")
def build_checkpoint_command(
        out: Path = typer.Option(..., help="directory to write (empty or absent, or any with "
                                           "--force)"),
        family: str = typer.Option("qwen3", help=f"one of {', '.join(FAMILIES)}"),
        size: str = typer.Option("tiny", help=f"one of {', '.join(sorted(SIZES))}"),
        vocab_size: int = typer.Option(512, help="BPE vocabulary size (tokens, specials included)"),
        corpus: Path | None = typer.Option(None, help="UTF-8 text, one document per line "
                                                      "(default: the built-in corpus)"),
        seed: int = typer.Option(0, help="seed of the weight init"),
        max_position_embeddings: int = typer.Option(1024, help="the model's context"),
        force: bool = typer.Option(False, help="replace the checkpoint in a non-empty --out: "
                                   "its checkpoint files (weights, shards, index, config, "
                                   "tokenizer) go; other files stay")) -> None:
    """Build a local HF-format checkpoint: config, safetensors, tokenizer, chat template."""
    try:
        docs = None
        if corpus is not None:
            docs = [line for line in corpus.read_text(encoding="utf-8").splitlines() if line]
            if not docs:
                raise ValueError(f"corpus {corpus} has no text")
        path = build_checkpoint(out, family=family, size=size, vocab_size=vocab_size, corpus=docs,
                                seed=seed, max_position_embeddings=max_position_embeddings,
                                overwrite=force)
    except (ValueError, OSError) as exc:
        typer.echo(f"cannot build the checkpoint: {exc}", err=True)
        raise typer.Exit(2) from None
    files = ", ".join(sorted(p.name for p in path.iterdir()))
    typer.echo(f"wrote a {size} {family} checkpoint to {path}: {files}")
