"""Datasets from files (veRL layout, JSONL and Parquet) as a resumable trainer task, and the local
GSM8K-style generator."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rlharvest.services.trainer import gsm8k
from rlharvest.services.trainer.datasets import (
    DatasetError,
    FieldMap,
    FileTask,
    load_rows,
    parse_row,
)
from rlharvest.services.trainer.rewards.verifier import extract_answer
from rlharvest.services.trainer.tasks import TaskDataset


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("plain", [False, True])
def test_generated_rows_load_back_from_jsonl_and_parquet(tmp_path, suffix, plain):
    made = gsm8k.generate(20, seed=3, plain=plain)
    rows = load_rows(gsm8k.write(tmp_path / f"d{suffix}", made))
    assert [r.ground_truth for r in rows] == [m["reward_model"]["ground_truth"] for m in made]
    assert {r.data_source for r in rows} == {"gsm8k"}
    first = rows[0].prompt
    if plain:
        assert isinstance(first, str) and first == made[0]["prompt"]
    else:
        assert first == ({"role": "user", "content": made[0]["prompt"][0]["content"]},)


def test_another_layout_maps_its_fields_and_numbers_become_text(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "2+2?", "meta": {"answer": 4}}])
    rows = load_rows(path, FieldMap.parse("prompt=question, ground_truth=meta.answer"))
    assert (rows[0].prompt, rows[0].ground_truth, rows[0].data_source) == ("2+2?", "4", "")
    with pytest.raises(DatasetError, match="NAME=PATH"):
        FieldMap.parse("answer=meta.answer")


GOOD = {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "1"}}


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    ({"reward_model": {"ground_truth": "1"}}, "line 2: field 'prompt' is missing"),
    ({"prompt": "q"}, "line 2: field 'reward_model.ground_truth' is missing"),
    ({**GOOD, "reward_model": {"ground_truth": ["1"]}}, "must be a string or a number, got list"),
    ({**GOOD, "prompt": [{"content": "q"}]}, "message 0 needs string 'role' and 'content'"),
    ({**GOOD, "prompt": 7}, "field 'prompt' must be a string or a non-empty list"),
    ({**GOOD, "prompt": ""}, "empty prompt"),
    ({**GOOD, "data_source": 3}, "'data_source' must be a string"),
    ([1, 2], "a row must be a JSON object"),
])
def test_a_malformed_row_is_refused_naming_file_line_and_field(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, line])
    with pytest.raises(DatasetError, match=re.escape(message)) as err:
        load_rows(path)
    assert str(path) in str(err.value)


def test_a_malformed_parquet_row_names_its_row_index(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"},
                                         {"prompt": "", "answer": "2"}]), path)
    with pytest.raises(DatasetError, match="bad.parquet line 1: field 'prompt' is an empty"):
        load_rows(path, FieldMap(ground_truth="answer"))


def test_empty_missing_and_unsupported_files_are_refused(tmp_path):
    with pytest.raises(DatasetError, match="no rows"):
        load_rows(write_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(DatasetError, match="no such dataset file"):
        load_rows(tmp_path / "absent.jsonl")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        load_rows(tmp_path / "data.csv")


def task(rows: int = 10, seed: int = 0) -> FileTask:
    made = [{"prompt": f"q{i}", "reward_model": {"ground_truth": str(i)}} for i in range(rows)]
    return FileTask(_rows(made), seed=seed, source="mem")


def _rows(made: list[dict]):
    return [parse_row(Path("mem"), i + 1, r) for i, r in enumerate(made)]


def test_every_row_once_per_epoch_epochs_differ_and_a_seed_fixes_the_order():
    t = task(10)
    epochs = [[t.item(e * 10 + i).answer for i in range(10)] for e in range(3)]
    assert all(sorted(e, key=int) == [str(i) for i in range(10)] for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    assert [task(10).item(i).answer for i in range(30)] == [a for e in epochs for a in e]
    assert [task(10, seed=1).item(i).answer for i in range(10)] != epochs[0]


def test_a_resumed_dataset_continues_exactly_across_an_epoch_boundary():
    def factory(seed: int) -> FileTask:
        return task(7, seed)

    straight = TaskDataset(seed=4, task_factory=factory)
    expected = [it.answer for _ in range(5) for it in straight.next_batch(3)]
    first = TaskDataset(seed=4, task_factory=factory)
    got = [it.answer for _ in range(2) for it in first.next_batch(3)]
    saved = first.state()
    resumed = TaskDataset.from_state(saved, factory)
    resumed.task.restore_state(first.task.checkpoint_state())
    got += [it.answer for _ in range(3) for it in resumed.next_batch(3)]
    assert got == expected and saved.position == 6


def test_resuming_on_another_dataset_is_refused():
    with pytest.raises(DatasetError, match="another dataset"):
        task(10).restore_state(task(11).checkpoint_state())


def test_a_prompt_longer_than_the_limit_is_refused_with_its_length_and_the_limit():
    t = task(12)
    t.check_prompt_lengths(lambda row: len(row.prompt), limit=3)
    with pytest.raises(DatasetError, match="line 11: the prompt is 3 tokens, above the limit of 2"):
        t.check_prompt_lengths(lambda row: len(row.prompt), limit=2)


def test_chat_items_keep_their_messages_and_give_rewards_the_text():
    made = [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
             "reward_model": {"ground_truth": "1"}, "data_source": "gsm8k"}]
    item = FileTask(_rows(made), seed=0).item(0)
    assert item.messages[1]["content"] == "u" and item.prompt == "s\nu"
    assert item.data_source == "gsm8k"


def test_generated_problems_are_deterministic_and_their_solutions_compute_the_answer():
    rows = gsm8k.generate(200, seed=9)
    assert rows == gsm8k.generate(200, seed=9) and rows != gsm8k.generate(200, seed=10)
    for row in rows:
        solution = row["extra_info"]["answer"]
        for left, right in re.findall(r"([\d +*/-]+) = (\d+)", solution):
            assert eval(left) == int(right), solution  # noqa: S307 - our own generated text
        truth = row["reward_model"]["ground_truth"]
        assert extract_answer(solution).replace(",", "") == truth
        assert row["prompt"][0]["content"].isascii()
    assert any(int(r["reward_model"]["ground_truth"]) > 999 for r in rows), "no comma case"


def test_make_dataset_writes_the_file_it_names(tmp_path):
    out = tmp_path / "g.parquet"
    result = CliRunner().invoke(gsm8k.app, ["--out", str(out), "--rows", "30", "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert len(load_rows(out)) == 30
    bad = CliRunner().invoke(gsm8k.app, ["--out", str(tmp_path / "g.csv")])
    assert bad.exit_code == 2 and ".jsonl or .parquet" in bad.output
