"""One tokenizer interface for the built-in character model and a checkpoint's own tokenizer.

Only the trainer and tools turn text into ids and back; workers and the manager see ids. What they
need of a tokenizer is small — encode a prompt (a string, or chat messages through the model's
chat template), decode a completion, and the ids that stop (EOS) and pad — so that is the whole
interface. For a checkpoint directory everything comes from its own files (``AutoTokenizer``,
``config.json``, ``generation_config.json``), local files only: a Qwen3 run stops on
``<|im_end|>`` and ``<|endoftext|>`` because its generation config says so, not because we do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, Union

from rlharvest.models.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, CharTokenizer

Message = Mapping[str, str]
Prompt = Union[str, Sequence[Message]]


class TokenizerError(ValueError):
    """The model's tokenizer cannot be loaded or cannot encode this prompt; says why."""


class ModelTokenizer(Protocol):
    @property
    def vocab_size(self) -> int:
        """The model's embedding rows (config.json): every id it can emit is below this; it may
        exceed the tokenizer's own length (real checkpoints pad it)."""

    @property
    def pad_id(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a completion (EOS ids of generation_config.json, then the tokenizer's)."""

    def encode(self, text: str) -> list[int]:
        """A plain-text prompt, with the special tokens the tokenizer adds by default."""

    def encode_plain(self, text: str) -> list[int]:
        """Text that continues a sequence (an environment's observation): no special tokens."""

    def decode(self, ids: Sequence[int]) -> str:
        """A completion's text, special tokens left out."""

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A string as ``encode``; chat messages through the chat template, ready for the
        assistant's reply (``add_generation_prompt``)."""


def check_messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    """The messages as plain dicts, or TokenizerError naming the first malformed one."""
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(f"chat message {index} is {type(message).__name__}, not a "
                                 "{'role': ..., 'content': ...} mapping")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise TokenizerError(f"chat message {index} has no string {key!r} "
                                     f"(got {message.get(key)!r})")
        checked.append({"role": message["role"], "content": message["content"]})
    if not checked:
        raise TokenizerError("a chat prompt needs at least one message")
    return checked


class BuiltinTokenizer:
    """The character tokenizer of the presets. It has no chat template, so chat messages are
    rendered as their contents, one per line: the built-in tasks' prompts are single user turns,
    and a role marker would only spend a tiny model's capacity on characters it never varies."""

    vocab_size = VOCAB_SIZE
    pad_id = PAD_ID
    stop_ids = (EOS_ID,)

    def __init__(self) -> None:
        self._chars = CharTokenizer()

    def encode(self, text: str) -> list[int]:
        try:
            return self._chars.encode(text)
        except ValueError as exc:
            raise TokenizerError(str(exc)) from None

    def encode_plain(self, text: str) -> list[int]:
        try:
            return self._chars.encode(text, add_bos=False)
        except ValueError as exc:
            raise TokenizerError(str(exc)) from None

    def decode(self, ids: Sequence[int]) -> str:
        return self._chars.decode(ids)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        return self.encode("\n".join(m["content"] for m in check_messages(prompt)))


class CheckpointTokenizer:
    """A checkpoint directory's own tokenizer (``AutoTokenizer``, local files only)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            raise TokenizerError(f"{path} has no usable tokenizer files (tokenizer.json / "
                                 f"tokenizer_config.json): {exc}") from exc
        config = _read_json(path / "config.json", required=True)
        generation = _read_json(path / "generation_config.json", required=False)
        self.vocab_size = int(config.get("vocab_size") or len(self._tok))
        self.stop_ids = _stop_ids(generation, config, self._tok.eos_token_id)
        if not self.stop_ids:
            raise TokenizerError(f"{path}: no EOS id in generation_config.json, config.json or "
                                 "the tokenizer; completions could never stop")
        # Llama ships without a pad token; padding with a stop id is what its users do, and is
        # safe here because the trainer masks by length, never by comparing ids with pad.
        pad = self._tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.stop_ids[0]
        self._path = path

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def encode_plain(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        messages = check_messages(prompt)
        if not self._tok.chat_template:
            raise TokenizerError(f"{self._path} has no chat template, so chat-format prompts "
                                 "cannot be rendered; use string prompts or add a template")
        rendered: Any = self._tok.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=True)
        if hasattr(rendered, "keys"):  # a BatchEncoding in transformers 5, a list before
            rendered = rendered["input_ids"]
        return [int(i) for i in rendered]


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise TokenizerError(f"{path} is missing: a checkpoint directory has a config.json")
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc


def _stop_ids(generation: dict[str, Any], config: dict[str, Any],
              tokenizer_eos: int | None) -> tuple[int, ...]:
    found: list[int] = []
    for value in (generation.get("eos_token_id"), config.get("eos_token_id"), tokenizer_eos):
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in found:
                found.append(token)
    return tuple(found)


def load_tokenizer(model: str) -> ModelTokenizer:
    """The tokenizer of ``model``: a preset name, or a local checkpoint directory."""
    from rlharvest.models.tiny_model import PRESETS

    if model in PRESETS:
        return BuiltinTokenizer()
    path = Path(model)
    if not path.is_dir():
        raise TokenizerError(f"model {model!r} is neither a preset ({sorted(PRESETS)}) nor a "
                             "local checkpoint directory; rlharvest never downloads one")
    return CheckpointTokenizer(path)
