"""Datasets from files: JSONL and Parquet rows in the veRL/OpenRLHF layout, as a trainer ``Task``.

A row's prompt is a chat message list (``[{"role": "user", "content": ...}]``) or a string; its
reference is ``reward_model.ground_truth``; ``data_source`` picks its reward. Other layouts map
their fields with ``FieldMap.parse("prompt=question,ground_truth=answer")``.

Item ``i`` of a ``FileTask`` is a pure function of (seed, i): epoch ``i // rows``, and within an
epoch a permutation seeded by (seed, epoch), so every row is seen once per epoch, epochs differ,
and the data position saved in a checkpoint is one integer (``tasks.TaskDataset``) from which a
resumed run sees exactly the items an uninterrupted one would. The file's fingerprint travels
with it, so resuming on another file is refused instead of silently mixing two datasets.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rlharvest.services.trainer.tasks import Message, TaskItem

SUFFIXES = (".jsonl", ".json", ".parquet")


class DatasetError(ValueError):
    """A dataset that cannot be used; names the file, the line (or row) and the field."""


@dataclass(frozen=True)
class FieldMap:
    """Dotted paths into a row for each field the trainer reads."""

    prompt: str = "prompt"
    ground_truth: str = "reward_model.ground_truth"
    data_source: str = "data_source"  # optional in rows: "" when absent

    @classmethod
    def parse(cls, spec: str) -> FieldMap:
        known = [f.name for f in fields(cls)]
        mapping: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, eq, path = part.partition("=")
            if not eq or not path.strip() or key.strip() not in known:
                raise DatasetError(f"field mapping {part!r} must be NAME=PATH with NAME one of "
                                   f"{known}, e.g. 'prompt=question,ground_truth=answer'")
            mapping[key.strip()] = path.strip()
        return cls(**mapping)


@dataclass(frozen=True)
class Row:
    line: int  # JSONL: 1-based line number; Parquet: 0-based row index
    prompt: str | tuple[dict[str, str], ...]
    ground_truth: str
    data_source: str


def load_rows(path: str | Path, fields: FieldMap = FieldMap()) -> list[Row]:
    """Every row of a JSONL or Parquet file, checked; DatasetError at the first bad one."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use one of "
                           f"{list(SUFFIXES)} (JSON lines or Parquet)")
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    raw = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    rows = [parse_row(path, line, record, fields) for line, record in raw]
    if not rows:
        raise DatasetError(f"{path}: the dataset has no rows")
    return rows


def _jsonl_rows(path: Path) -> list[tuple[int, Any]]:
    rows = []
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                rows.append((number, json.loads(text)))
            except ValueError as exc:
                raise DatasetError(f"{path} line {number}: not valid JSON ({exc})") from None
    return rows


def _parquet_rows(path: Path) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DatasetError(f"{path}: not a readable Parquet file ({exc})") from None
    return list(enumerate(table.to_pylist()))


def _lookup(record: Any, dotted: str) -> Any:
    value = record
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise KeyError(dotted)
        value = value[key]
    return value


def parse_row(path: Path, line: int, record: Any, fields: FieldMap = FieldMap()) -> Row:
    """One decoded record as a checked ``Row``; DatasetError names ``path``, ``line``, field."""
    where = f"{path} line {line}"
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(record).__name__}")
    try:
        prompt = _lookup(record, fields.prompt)
        truth = _lookup(record, fields.ground_truth)
    except KeyError as missing:
        raise DatasetError(f"{where}: field {missing.args[0]!r} is missing (map another "
                           "layout with --data-fields)") from None
    try:
        source = _lookup(record, fields.data_source)
    except KeyError:
        source = ""
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise DatasetError(f"{where}: field {fields.ground_truth!r} must be a string or a "
                           f"number, got {type(truth).__name__}")
    if not isinstance(source, str):
        raise DatasetError(f"{where}: field {fields.data_source!r} must be a string")
    return Row(line, _prompt(where, fields.prompt, prompt), str(truth), source)


def _prompt(where: str, name: str, prompt: Any) -> str | tuple[dict[str, str], ...]:
    if isinstance(prompt, str):
        if not prompt:
            raise DatasetError(f"{where}: field {name!r} is an empty prompt")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise DatasetError(f"{where}: field {name!r} must be a string or a non-empty list of "
                           f"chat messages, got {type(prompt).__name__}")
    messages = []
    for index, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise DatasetError(f"{where}: field {name!r} message {index} needs string 'role' "
                               f"and 'content', got {message!r}"[:300])
        messages.append({"role": message["role"], "content": message["content"]})
    return tuple(messages)


def fingerprint(rows: Sequence[Row]) -> str:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([row.prompt, row.ground_truth, row.data_source]).encode())
    return digest.hexdigest()[:16]


Scorer = Callable[[str, str, str], Any]


class FileTask:
    """A dataset as a ``tasks.Task``. ``scorer`` is its reward when the trainer routes none
    (the trainer normally picks one per row by ``data_source``: ``task_setup.py``)."""

    name = "file"

    def __init__(self, rows: Sequence[Row], *, seed: int, source: str = "",
                 scorer: Scorer | None = None) -> None:
        if not rows:
            raise DatasetError(f"{source or 'the dataset'}: no rows")
        self._rows = list(rows)
        self._seed = seed
        self._source = source
        self._scorer = scorer
        self._fingerprint = fingerprint(self._rows)
        self._order: tuple[int, list[int]] = (-1, [])  # the current epoch's permutation

    def __len__(self) -> int:
        return len(self._rows)

    def epoch(self, index: int) -> int:
        return index // len(self._rows)

    def _permutation(self, epoch: int) -> list[int]:
        if self._order[0] != epoch:
            order = list(range(len(self._rows)))
            random.Random(f"{self._seed}/{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def item(self, index: int) -> TaskItem:
        if index < 0:
            raise ValueError(f"item index must be >= 0, got {index}")
        row = self._rows[self._permutation(self.epoch(index))[index % len(self._rows)]]
        messages: tuple[Message, ...] = () if isinstance(row.prompt, str) else row.prompt
        text = row.prompt if isinstance(row.prompt, str) else \
            "\n".join(m["content"] for m in row.prompt)
        return TaskItem(index=index, prompt=text, answer=row.ground_truth, messages=messages,
                        data_source=row.data_source)

    async def score(self, prompt: str, completion: str, answer: str) -> float:
        if self._scorer is None:
            raise DatasetError("this dataset has no reward of its own: choose one with --reward "
                               "or by each row's data_source")
        result = self._scorer(prompt, completion, answer)
        return float(await result if hasattr(result, "__await__") else result)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"fingerprint": self._fingerprint, "rows": len(self._rows), "source": self._source}

    def restore_state(self, state: dict[str, Any]) -> None:
        saved = state.get("fingerprint")
        if saved is not None and saved != self._fingerprint:
            raise DatasetError(
                f"the checkpoint's data position is for another dataset ({state.get('source')!r}, "
                f"{state.get('rows')} rows) than {self._source!r} ({len(self._rows)} rows): "
                "resume with the same --data, or start from an empty --checkpoint-dir")

    def check_prompt_lengths(self, count_tokens: Callable[[Row], int], limit: int) -> None:
        """Refuses the first prompt longer than ``limit`` tokens, with its length and the limit."""
        for row in self._rows:
            length = count_tokens(row)
            if length > limit:
                raise DatasetError(
                    f"{self._source or 'dataset'} line {row.line}: the prompt is {length} tokens, "
                    f"above the limit of {limit} (the model's context minus max_new_tokens); "
                    "drop or shorten it, or raise --max-prompt-tokens")
