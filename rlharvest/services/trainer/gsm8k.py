"""A local, seeded generator of GSM8K-style word problems in the veRL layout.

Each problem is two to four arithmetic steps in a story (shopping, ages, rates, sharing); the
worked solution spells every step and ends with ``#### <answer>``, as GSM8K does; the answer is an
integer, large ones written with thousands separators in the solution ("#### 1,250") so the
verifier's comma handling is exercised. Text is printable ASCII, so the built-in character model
can read the ``--plain`` variant too.

    rlharvest make-dataset --out gsm8k.jsonl --rows 2000        # or .parquet
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import typer
from rich.progress import track

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
_NAMES = ("Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "June", "Kai", "Lea")
_ITEMS = ("apples", "books", "pencils", "cookies", "marbles", "stickers", "tickets", "shells")

Problem = tuple[str, list[str], int]  # question, solution steps, answer


def _shopping(rng: random.Random) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    boxes, per_box, price = rng.randint(2, 30), rng.randint(3, 40), rng.randint(2, 25)
    spent = boxes * per_box * price
    question = (f"{name} buys {boxes} boxes of {item}. Each box holds {per_box} {item}, and each "
                f"of the {item} costs ${price}. How many dollars does {name} spend?")
    steps = [f"{name} buys {boxes} * {per_box} = {boxes * per_box} {item}.",
             f"They cost {boxes * per_box} * {price} = {spent} dollars."]
    return question, steps, spent


def _ages(rng: random.Random) -> Problem:
    a, b = rng.sample(_NAMES, 2)
    age, gap, years = rng.randint(5, 40), rng.randint(2, 30), rng.randint(2, 20)
    total = age + (age + gap) + 2 * years
    question = (f"{a} is {age} years old. {b} is {gap} years older than {a}. What will the sum "
                f"of their ages be in {years} years?")
    steps = [f"{b} is {age} + {gap} = {age + gap} years old.",
             f"Now their ages sum to {age} + {age + gap} = {2 * age + gap}.",
             f"In {years} years both are {years} older: {2 * age + gap} + 2 * {years} = {total}."]
    return question, steps, total


def _rates(rng: random.Random) -> Problem:
    name = rng.choice(_NAMES)
    speed, hours, rest, extra = rng.randint(3, 90), rng.randint(2, 12), rng.randint(1, 5), \
        rng.randint(1, 60)
    first = speed * hours
    total = first + extra * rest
    question = (f"{name} drives at {speed} miles per hour for {hours} hours, then walks {extra} "
                f"miles a day for {rest} days. How many miles does {name} cover in all?")
    steps = [f"Driving: {speed} * {hours} = {first} miles.",
             f"Walking: {extra} * {rest} = {extra * rest} miles.",
             f"In all: {first} + {extra * rest} = {total} miles."]
    return question, steps, total


def _sharing(rng: random.Random) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    friends, each, kept, lost = rng.randint(2, 12), rng.randint(2, 30), rng.randint(1, 50), \
        rng.randint(0, 9)
    start = friends * each + kept
    total = kept - lost if kept > lost else kept
    lose = lost if kept > lost else 0
    question = (f"{name} has {start} {item} and gives {each} to each of {friends} friends, then "
                f"loses {lose}. How many {item} does {name} have left?")
    steps = [f"{name} gives away {friends} * {each} = {friends * each} {item}.",
             f"That leaves {start} - {friends * each} = {kept}.",
             f"After losing {lose}: {kept} - {lose} = {total}."]
    return question, steps, total


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (_shopping, _ages, _rates, _sharing)


def generate(count: int, seed: int = 0, plain: bool = False) -> list[dict]:
    """``count`` rows; ``plain`` gives string prompts instead of a chat message list."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        question, steps, answer = rng.choice(TEMPLATES)(rng)
        content = f"{question} {INSTRUCTION}"
        rows.append({
            "data_source": "gsm8k",
            "prompt": content if plain else [{"role": "user", "content": content}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"index": index, "answer": "\n".join(steps) + f"\n#### {answer:,}"},
        })
    return rows


def write(path: str | Path, rows: list[dict]) -> Path:
    """JSON lines for .jsonl/.json, Parquet for .parquet."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix in (".jsonl", ".json"):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        raise ValueError(f"{path}: write .jsonl or .parquet")
    return path


app = typer.Typer(add_completion=False, help=__doc__)


@app.command("make-dataset")
def make_dataset(out: Path = typer.Option(..., help="a .jsonl or .parquet file to write"),
                 rows: int = typer.Option(1000, min=1, help="problems to generate"),
                 seed: int = typer.Option(0, help="same seed, same problems"),
                 plain: bool = typer.Option(False, help="string prompts instead of chat messages "
                                                        "(for the built-in character model)")
                 ) -> None:
    """Write a GSM8K-style dataset (veRL layout) generated locally."""
    if out.suffix not in (".jsonl", ".json", ".parquet"):
        typer.echo(f"cannot write {out}: use a .jsonl or .parquet file", err=True)
        raise typer.Exit(2)
    made = [row for chunk in track(range(0, rows, 1000), description="generating",
                                   disable=rows < 5000)
            for row in generate(min(1000, rows - chunk), seed=seed * 1_000_003 + chunk,
                                plain=plain)]
    for index, row in enumerate(made):
        row["extra_info"]["index"] = index
    write(out, made)
    typer.echo(f"wrote {len(made)} GSM8K-style problems to {out}")
