"""The columnar ledger agrees with a plain per-request model on every batch: the same
rows accepted and refused, the same tokens held, the same ends, the same counts; across region
moves, compactions, slot reuse and requests named twice in one batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rlharvest.common import delta_batch
from rlharvest.common.pb import common_pb2
from rlharvest.services.rollout_manager import token_ledger
from rlharvest.services.rollout_manager.token_ledger import MASK, TokenLedger

VOCAB = 50
STOP = 7


@dataclass
class Model:
    """One request as the per-delta tracker kept it."""

    cap: int
    version: int
    owner: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    high: int = 0
    tag: int = 0  # its ``label``: a step key and its index in that step
    index: int = 0


def model_apply(models: dict[int, Model], worker: int, rows: list[tuple], version: int):
    accepted, dropped, ended, generated, regenerated = [], [], [], 0, 0
    for i, (handle, position, tokens, end) in enumerate(rows):
        m = models.get(handle)
        ok = m is not None and m.owner == worker and m.version == version and \
            position == len(m.tokens) and len(m.tokens) + len(tokens) <= m.cap and \
            all(0 <= t < VOCAB for t in tokens)
        if not ok:
            dropped.append(i)
            continue
        start = len(m.tokens)
        m.tokens += tokens
        m.logprobs += [t / 10 for t in tokens]
        regenerated += max(min(m.high, len(m.tokens)) - start, 0)
        generated += len(tokens)
        accepted.append(i)
        why = "stop" if m.tokens and tokens and m.tokens[-1] == STOP else \
            "length" if len(m.tokens) >= m.cap else ""
        if end == "abort" or (end and not why):
            why = end
        if why:
            ended.append((i, why))
            m.owner = -1  # done or released: on no worker
    return accepted, dropped, ended, generated, regenerated


ops = st.lists(st.tuples(st.sampled_from(["add", "batch", "batch", "batch", "truncate", "remove",
                                          "move"]),
                         st.integers(0, 10**6)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_the_ledger_agrees_with_the_per_request_model(script):
    token_ledger._FIRST_ROOM, saved = 4, token_ledger._FIRST_ROOM  # regions move often
    try:
        run_script(script)
    finally:
        token_ledger._FIRST_ROOM = saved


def run_script(script) -> None:
    ledger = TokenLedger(slots=2)
    ledger._tokens = np.zeros(16, np.int32)  # a tiny arena: grows and compacts
    ledger._logprobs = np.zeros(16, np.float32)
    models: dict[int, Model] = {}
    removed: list[int] = []
    for op, seed in script:
        rng = np.random.default_rng(seed)
        handles = sorted(models)
        if op == "add" or not handles:
            cap = int(rng.integers(1, 30))
            resume = [int(t) for t in rng.integers(8, VOCAB, int(rng.integers(0, cap)))]
            added = ledger.add(cap, 0, [STOP], resume, [t / 10 for t in resume])
            handle = ledger.assign(added & MASK, 0)
            removed.append(added)  # a row under the name it had before its dispatch misses
            models[handle] = Model(cap, 0, tokens=list(resume),
                                   logprobs=[t / 10 for t in resume], high=len(resume))
            models[handle].owner = 0
            # Every request labelled again as one step: tags and indices must follow each row.
            ordered = sorted(models)
            ledger.label([h & MASK for h in ordered], len(ordered))
            for i, h in enumerate(ordered):
                models[h].tag, models[h].index = len(ordered), i
        elif op == "truncate":
            handle = handles[int(rng.integers(len(handles)))]
            ledger.truncate(handle & MASK)
            m = models[handle]
            m.high = max(m.high, len(m.tokens))
            m.tokens, m.logprobs = [], []
        elif op == "remove":
            handle = handles[int(rng.integers(len(handles)))]
            ledger.remove(handle)
            del models[handle]
            removed.append(handle)
        elif op == "move":
            handle = handles[int(rng.integers(len(handles)))]
            worker = int(rng.integers(-1, 2))
            models[handle].owner = worker
            if worker < 0:
                ledger.unassign(handle & MASK)
            else:  # a new dispatch, a new name: the old one's rows miss from here on
                models[ledger.assign(handle & MASK, worker)] = models.pop(handle)
                removed.append(handle)
        else:
            pool = handles + removed[-2:] + [MASK, 7 << 20]  # and handles past the table
            rows = []
            for _ in range(int(rng.integers(1, 6))):
                handle = pool[int(rng.integers(len(pool)))]
                m = models.get(handle)
                have = len(m.tokens) if m else 0
                position = have if rng.random() < 0.85 else have + int(rng.integers(-1, 2))
                n = int(rng.integers(0, 4)) if rng.random() < 0.3 else 1
                tokens = [int(t) for t in rng.integers(0, VOCAB, n)]
                if rng.random() < 0.05:
                    tokens = [-3] + tokens
                end = str(rng.choice(["", "", "", "", "stop", "abort"]))
                rows.append((handle, position, tokens, end))
            worker = int(rng.integers(0, 2))
            batch = delta_batch.build([(h, p, t, [x / 10 for x in t], e) for h, p, t, e in rows], 0)
            # Through the wire, as a worker sends it.
            batch = delta_batch.decode(common_pb2.DeltaBatch.FromString(
                delta_batch.encode(batch).SerializeToString()))
            got = ledger.apply(worker, batch, VOCAB)
            want = model_apply(models, worker, rows, 0)
            assert (got.accepted.tolist(), got.dropped.tolist(), got.ended, got.generated,
                    got.regenerated) == want
            named = [models[rows[r][0]] for r in want[0]]
            assert got.tags.tolist() == [m.tag for m in named]
            assert got.indices.tolist() == [m.index for m in named]
        for handle, m in models.items():
            assert ledger.tokens(handle & MASK) == m.tokens
            assert ledger.logprobs(handle & MASK) == pytest.approx(m.logprobs)


def test_a_late_row_for_a_removed_request_misses_the_request_that_reuses_its_slot():
    ledger = TokenLedger()
    old = ledger.add(10, 0, [])
    ledger.remove(old)
    new = ledger.add(10, 0, [])
    assert new & MASK == old & MASK and new != old
    new = ledger.assign(new & MASK, 0)
    got = ledger.apply(0, delta_batch.build([(old, 0, [5], [0.0], "")], 0), VOCAB)
    assert got.dropped.tolist() == [0] and ledger.tokens(new & MASK) == []


def test_a_request_named_twice_in_a_batch_takes_its_rows_in_order():
    ledger = TokenLedger()
    a, b = ledger.add(10, 0, []), ledger.add(10, 0, [])
    a = ledger.assign(a & MASK, 0)
    b = ledger.assign(b & MASK, 0)
    rows = delta_batch.build([(a, 0, [1], [0.0], ""), (b, 0, [2], [0.0], ""),
                              (a, 1, [3], [0.0], ""), (a, 1, [4], [0.0], "")], 0)
    got = ledger.apply(0, rows, VOCAB)
    assert got.accepted.tolist() == [0, 1, 2] and got.dropped.tolist() == [3]
    assert ledger.tokens(a & MASK) == [1, 3] and ledger.tokens(b & MASK) == [2]


def test_rows_naming_no_request_past_the_table_are_refused_however_many():
    ledger = TokenLedger(slots=2)
    a, b = ledger.add(10, 0, []), ledger.add(10, 0, [])
    a = ledger.assign(a & MASK, 0)
    b = ledger.assign(b & MASK, 0)
    # Two slots past the table and the table's last slot all map onto one mark.
    rows = delta_batch.build([(MASK, 0, [1], [0.0], ""), (5000, 0, [1], [0.0], ""),
                              (b, 0, [2], [0.0], ""), (MASK, 0, [1], [0.0], ""),
                              (a, 0, [3], [0.0], "")], 0)
    got = ledger.apply(0, rows, VOCAB)
    assert got.accepted.tolist() == [2, 4] and got.dropped.tolist() == [0, 1, 3]
    assert ledger.tokens(a & MASK) == [3] and ledger.tokens(b & MASK) == [2]


def test_a_row_after_its_requests_end_in_the_same_batch_is_refused():
    ledger = TokenLedger()
    a, b = ledger.add(10, 0, [STOP]), ledger.add(10, 0, [])
    a = ledger.assign(a & MASK, 0)
    b = ledger.assign(b & MASK, 0)
    rows = delta_batch.build([(a, 0, [STOP], [0.0], ""), (b, 0, [], [], "abort"),
                              (a, 1, [5], [0.0], ""), (b, 0, [4], [0.0], "")], 0)
    got = ledger.apply(0, rows, VOCAB)
    assert got.accepted.tolist() == [0, 1] and got.dropped.tolist() == [2, 3]
    assert got.ended == [(0, "stop"), (1, "abort")]
    assert ledger.tokens(a & MASK) == [STOP] and ledger.tokens(b & MASK) == []


def test_negative_ids_are_refused_before_the_vocabulary_is_known():
    ledger = TokenLedger()
    a = ledger.add(10, 0, [])
    a = ledger.assign(a & MASK, 0)
    got = ledger.apply(0, delta_batch.build([(a, 0, [-1], [0.0], "")], 0), 2**63)
    assert got.dropped.tolist() == [0] and not got.ended and ledger.tokens(a & MASK) == []


def test_rows_split_by_step_keep_their_tokens_ends_and_step_indices():
    rows = delta_batch.build([(10, 0, [1], [0.1], ""), (11, 3, [2, 3], [0.2, 0.3], "stop"),
                              (12, 5, [4], [0.4], "")], 0)
    parts = delta_batch.by_key(rows, np.array([7, 9, 7]), np.array([0, 4, 1]))
    assert [(key, [tuple(r) for r in part.iter()]) for key, part in parts] == [
        (7, [(0, 0, [1], pytest.approx([0.1]), ""), (1, 5, [4], pytest.approx([0.4]), "")]),
        (9, [(4, 3, [2, 3], pytest.approx([0.2, 0.3]), "stop")])]
    [(key, whole)] = delta_batch.by_key(rows, np.array([7, 7, 7]), np.array([2, 0, 1]))
    assert key == 7 and whole.requests.tolist() == [2, 0, 1]


def test_a_batch_whose_columns_disagree_is_refused_whole():
    msg = delta_batch.encode(delta_batch.build([(1, 0, [1, 2], [0.0, 0.0], "")], 0))
    msg.logprobs = msg.logprobs[:4]
    with pytest.raises(delta_batch.MalformedBatch, match="1 rows"):
        delta_batch.decode(msg)
    msg = delta_batch.encode(delta_batch.build([(1, 0, [1], [0.0], "")], 0))
    msg.positions = msg.positions[:3]
    with pytest.raises(delta_batch.MalformedBatch, match="cut short"):
        delta_batch.decode(msg)


def test_rows_taken_and_joined_keep_their_tokens_and_ends():
    rows = delta_batch.build([(1, 0, [1, 2], [0.1, 0.2], ""), (2, 5, [], [], "abort"),
                              (3, 1, [3], [0.3], "stop")], 4)
    part = rows.take(np.array([0, 2]))
    assert [tuple(r) for r in part.iter()] == [(1, 0, [1, 2], pytest.approx([0.1, 0.2]), ""),
                                               (3, 1, [3], pytest.approx([0.3]), "stop")]
    joined = delta_batch.concat([part, rows.take(np.array([1]))])
    assert [r.request for r in joined.iter()] == [1, 3, 2]
    assert joined.ends == {1: "stop", 2: "abort"} and joined.weight_version == 4
