"""RollPacker's parallelism planner (§4.2, "Adaptive TP Selection"): the TP size of each round.

The rule is the paper's. The planner starts from the TP size the offline profile says is best
(``best_tp``) and keeps one state per round kind (tail batching's "short" and "long" rounds have
different memory pressure, §4.2, Fig. 7). After each step of a kind it is told that step's KV
preemption count:

- a rise above ``rise`` (1.05) times the previous step *of the same kind* doubles TP;
- ``calm_steps`` (4) consecutive steps of that kind without preemptions halve it;
- TP stays a power of two in [1, gpus_per_node]: a TP group never spans nodes.

What the paper leaves open, and what we decided:

- "Combining historical job loads with profiled performance data" (§4.1 ②) is not spelled out.
  Here the heuristic decides *when* to move and a cost model (``CostModel``), fed the last round's
  response-length histogram of that kind, may *veto* the move when it predicts the new TP to be
  slower (a doubling only when clearly slower: ``_veto`` says why). Without a profile or a
  histogram the heuristic alone decides, as in the paper.
- The first step of a kind has no previous count, so it only sets the baseline. A previous count
  of 0 makes any preemption a rise (0 x 1.05 = 0).
- After a halving (or a vetoed or blocked one) the calm count restarts: another ``calm_steps``
  steps without preemptions before the next halving is considered.
- One TP size per round kind for all of the job's rollout GPUs (instances of ``tp`` GPUs each).

Pure and synchronous: counts in, TP sizes out; nothing here reads a clock or does I/O. The
manager publishes ``published()`` per job (etcd) and checkpoints ``state_dict()``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

ROUND_KINDS = ("short", "long")
STATE_VERSION = 1


def _check_kind(kind: str) -> None:
    if kind not in ROUND_KINDS:
        raise ValueError(f"unknown round kind {kind!r}; choose one of {ROUND_KINDS}")


def is_power_of_two(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def tp_sizes(max_tp: int) -> list[int]:
    """The TP sizes a planner may choose: powers of two from 1 to ``max_tp``."""
    return [1 << i for i in range(max_tp.bit_length()) if 1 << i <= max_tp]


def _check_histogram(histogram: Mapping[int, float]) -> None:
    for length, count in histogram.items():
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"histogram key {length!r} must be a response length in tokens "
                             "(an int >= 1)")
        if not isinstance(count, (int, float)) or isinstance(count, bool) or not count >= 0 \
                or math.isinf(count):
            raise ValueError(f"histogram count {count!r} for length {length} must be a finite "
                             "number >= 0")


def length_histogram(lengths: Iterable[int], bucket_tokens: int) -> dict[int, int]:
    """Response lengths bucketed by ``bucket_tokens``, keyed by each bucket's upper edge (so the
    cost model, which reads a bucket as its upper edge, errs towards longer responses)."""
    if bucket_tokens < 1:
        raise ValueError(f"bucket_tokens must be >= 1, got {bucket_tokens}")
    out: dict[int, int] = {}
    for n in lengths:
        if n < 0:
            raise ValueError(f"a response length cannot be negative, got {n}")
        edge = max(1, math.ceil(n / bucket_tokens)) * bucket_tokens
        out[edge] = out.get(edge, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------
# The offline profile and the cost model


@dataclass(frozen=True)
class TpProfile:
    """The offline profile (§4.1 "Offline Profiling"), per TP size.

    ``decode_s[tp][b]``: seconds of one decode step of one TP group running ``b`` sequences
    (every sequence gains one token). The paper profiles over sequence length too; we keep the
    curve one-dimensional (the decode step is dominated by reading the weights, §4.1).
    ``kv_tokens[tp]``: KV cache room of one TP group, in tokens (bigger TP: weights split over
    more GPUs, more room). ``prefill_s_per_token[tp]``: cost of recomputing one context token of
    a preempted request when it is readmitted (vLLM's recompute preemption).
    """

    decode_s: Mapping[int, Mapping[int, float]]
    kv_tokens: Mapping[int, int]
    prefill_s_per_token: Mapping[int, float]

    def __post_init__(self) -> None:
        sizes = set(self.decode_s)
        if not sizes or sizes != set(self.kv_tokens) or sizes != set(self.prefill_s_per_token):
            raise ValueError("decode_s, kv_tokens and prefill_s_per_token must profile the same, "
                             f"non-empty TP sizes; got {sorted(self.decode_s)}, "
                             f"{sorted(self.kv_tokens)}, {sorted(self.prefill_s_per_token)}")
        for tp in sizes:
            if not is_power_of_two(tp):
                raise ValueError(f"profiled TP size {tp} is not a power of two")
            curve = self.decode_s[tp]
            if not curve or any(b < 1 or not s > 0 for b, s in curve.items()):
                raise ValueError(f"decode_s[{tp}] must map batch sizes >= 1 to seconds > 0, "
                                 f"got {dict(curve)}")
            if self.kv_tokens[tp] < 1 or self.prefill_s_per_token[tp] < 0:
                raise ValueError(f"TP {tp}: kv_tokens must be >= 1 and prefill_s_per_token "
                                 f">= 0, got {self.kv_tokens[tp]}, {self.prefill_s_per_token[tp]}")

    @property
    def sizes(self) -> list[int]:
        return sorted(self.decode_s)

    def step_s(self, tp: int, batch: float) -> float:
        """One decode step at ``batch`` sequences, interpolated linearly between profiled batch
        sizes. Below the smallest: its time (a step never gets cheaper than with the fewest
        sequences profiled). Above the largest: the last segment's slope, since a bigger batch
        reads more KV per step and clamping would flatter big batches."""
        points = sorted(self.decode_s[tp].items())
        batches = [b for b, _ in points]
        if batch <= batches[0] or len(points) == 1:
            return points[0][1]
        i = min(bisect.bisect_left(batches, batch), len(points) - 1)
        (b0, s0), (b1, s1) = points[i - 1], points[i]
        return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)


@dataclass(frozen=True)
class Prediction:
    makespan_s: float  # rollout time of the step (its slowest TP group)
    preemptions: float  # expected preemptions over all TP groups


@dataclass(frozen=True)
class CostModel:
    """Rollout makespan at a TP size, from the profile and a response-length histogram.

    The job's ``gpus`` form ``gpus // tp`` TP groups and the requests are spread evenly over
    them; every request starts at once with ``prompt_tokens`` of context. With the lengths
    sorted, phase i runs from length l_{i-1} to l_i with ``alive`` requests per group, each
    holding up to ``prompt + l_i`` KV tokens (the phase's end, the conservative side):

    - **decode**: a phase costs ``(l_i - l_{i-1}) * step_s(tp, alive)``. Late phases of a long
      tail run at small batches, where a bigger TP's communication per token shows (§4.2: it
      "dominates in long rounds where rollout is bound by long-tail responses");
    - **memory**: when the phase's demand ``alive * (prompt + l_i)`` exceeds the group's room C,
      only ``fit = C / (prompt + l_i)`` requests run and the phase takes ``alive / fit`` times as
      many steps at that batch (decode is memory-bandwidth bound, §4.1: a smaller batch is
      barely faster per step, so squeezing stretches the phase). The most requests that did not
      fit in any phase are the predicted preemptions, and the largest overflow in tokens is
      recomputed once on readmission (``prefill_s_per_token``). The paper gives no model; this
      one is fluid (an evicted request resumes as soon as room frees), so it underestimates the
      cost of heavy preemption: the planner leans towards more room (``TpPlanner._veto``).

    More room never predicts more preemptions nor, for a profile whose per-sequence step cost
    ``step_s(b) / b`` falls with ``b``, a longer makespan. A request that cannot fit a group
    even alone makes the TP size infeasible (makespan inf).
    """

    profile: TpProfile
    gpus: int
    prompt_tokens: int

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.prompt_tokens < 0:
            raise ValueError(f"need gpus >= 1 and prompt_tokens >= 0, got {self.gpus} and "
                             f"{self.prompt_tokens}")

    def predict(self, tp: int, histogram: Mapping[int, float]) -> Prediction:
        if tp not in self.profile.kv_tokens or self.gpus % tp:
            raise ValueError(f"TP {tp} is not usable: profiled sizes {self.profile.sizes}, and "
                             f"it must divide the job's {self.gpus} GPUs")
        _check_histogram(histogram)
        groups = self.gpus // tp
        room = self.profile.kv_tokens[tp]
        time, done, evicted, excess = 0.0, 0, 0.0, 0.0
        for length, alive in _phases(histogram, groups):
            context = self.prompt_tokens + length
            fit = room / context
            if fit < 1:
                return Prediction(math.inf, math.inf)
            batch = min(alive, fit)
            time += (length - done) * self.profile.step_s(tp, batch) * (alive / batch)
            evicted = max(evicted, alive - batch)
            excess = max(excess, (alive - batch) * context)
            done = length
        # The worst overflow, in tokens, is evicted once and recomputed once (per group).
        recompute = excess * self.profile.prefill_s_per_token[tp]
        return Prediction(time + recompute, evicted * groups)

    def best_tp(self, histogram: Mapping[int, float], max_tp: int) -> int:
        """The usable TP size up to ``max_tp`` with the shortest predicted makespan; ties go to
        the smaller size (less communication, more groups)."""
        usable = [tp for tp in self.profile.sizes if tp <= max_tp and self.gpus % tp == 0]
        if not usable:
            raise ValueError(f"no profiled TP size in {self.profile.sizes} is <= {max_tp} and "
                             f"divides {self.gpus} GPUs")
        return min(usable, key=lambda tp: (self.predict(tp, histogram).makespan_s, tp))


def best_tp(profile: TpProfile, histogram: Mapping[int, float], *, gpus: int,
            prompt_tokens: int, max_tp: int) -> int:
    """The TP size the profile predicts fastest for ``histogram`` (the planner's starting point:
    the paper profiles it without tail batching)."""
    return CostModel(profile, gpus, prompt_tokens).best_tp(histogram, max_tp)


@dataclass(frozen=True)
class ProfiledStart:
    """An offline profile as the manager reads it (``--tp-profile``): the cost model, and the
    length histogram of the workload it was profiled on, whose best TP size is where the planner
    starts (§4.1: the profile picks the initial TP without tail batching)."""

    model: CostModel
    lengths: Mapping[int, float] | None

    def initial_tp(self, max_tp: int) -> int | None:
        return None if self.lengths is None else self.model.best_tp(self.lengths, max_tp)

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ProfiledStart:
        """The profile file's JSON: ``gpus``, ``prompt_tokens``, per TP size (keys are strings
        in JSON) ``decode_s`` {batch: seconds}, ``kv_tokens`` and ``prefill_s_per_token``, and
        optionally ``lengths`` {response length: count}. ValueError says what is wrong."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a TP profile is a JSON object, got {type(data).__name__}")
        known = {"gpus", "prompt_tokens", "decode_s", "kv_tokens", "prefill_s_per_token",
                 "lengths"}
        if unknown := set(data) - known:
            raise ValueError(f"unknown TP profile keys {sorted(unknown)}; expected {sorted(known)}")
        try:
            profile = TpProfile(
                decode_s={int(tp): {int(b): float(sec) for b, sec in curve.items()}
                          for tp, curve in _mapping(data, "decode_s").items()},
                kv_tokens={int(tp): int(n) for tp, n in _mapping(data, "kv_tokens").items()},
                prefill_s_per_token={int(tp): float(sec) for tp, sec
                                     in _mapping(data, "prefill_s_per_token").items()})
            model = CostModel(profile, int(data["gpus"]),  # type: ignore[call-overload]
                              int(data.get("prompt_tokens", 0)))  # type: ignore[call-overload]
            lengths = None if data.get("lengths") is None else {
                int(n): float(c) for n, c in _mapping(data, "lengths").items()}
        except KeyError as exc:
            raise ValueError(f"the TP profile lacks {exc}") from None
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"the TP profile is malformed: {exc}") from None
        if lengths is not None:
            _check_histogram(lengths)
        return cls(model, lengths)


def _mapping(data: Mapping[str, object], key: str) -> Mapping:
    value = data[key]
    if not isinstance(value, Mapping):
        raise TypeError(f"{key} must be an object, got {type(value).__name__}")
    return value


def _phases(histogram: Mapping[int, float], groups: int) -> list[tuple[int, float]]:
    """(length, requests still running per group) for each distinct length, ascending. The
    slowest group holds at least one of the requests still running."""
    lengths = sorted(n for n, c in histogram.items() if c > 0)
    if not lengths:
        raise ValueError("the response-length histogram is empty: nothing to predict from")
    remaining = sum(histogram[n] for n in lengths)
    out = []
    for n in lengths:
        out.append((n, max(1.0, remaining / groups)))
        remaining -= histogram[n]
    return out


# ---------------------------------------------------------------------------------------------
# The planner


@dataclass(frozen=True)
class TpPlan:
    """What a manager publishes for its job: the TP size of the next step of each round kind,
    and why the last change was made."""

    short_tp: int
    long_tp: int
    reason: str

    def tp(self, kind: str) -> int:
        _check_kind(kind)
        return self.short_tp if kind == "short" else self.long_tp

    def to_json(self) -> dict[str, object]:
        return {"short_tp": self.short_tp, "long_tp": self.long_tp, "reason": self.reason}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> TpPlan:
        short, long_, reason = data.get("short_tp"), data.get("long_tp"), data.get("reason")
        if not (is_power_of_two(short) and is_power_of_two(long_) and isinstance(reason, str)):
            raise ValueError(f"not a TP plan: {dict(data)!r}; expected short_tp and long_tp "
                             "(powers of two) and reason (a string)")
        assert isinstance(short, int) and isinstance(long_, int)
        return cls(short, long_, reason)


@dataclass(frozen=True)
class TpDecision:
    """What one observation did to its kind's TP size."""

    kind: str
    tp_before: int
    tp_after: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.tp_before != self.tp_after


@dataclass
class _KindState:
    tp: int
    last_preemptions: int | None = None  # the previous step of this kind; None before one
    calm: int = 0  # consecutive steps of this kind without preemptions, since the last halving
    lengths: dict[int, float] | None = field(default=None)  # the last round's histogram


class TpPlanner:
    """Per-job TP sizes for short and long rounds (see the module docstring for the rule)."""

    def __init__(self, gpus_per_node: int, initial_tp: int = 1, *,
                 model: CostModel | None = None, rise: float = 1.05,
                 calm_steps: int = 4, veto_margin: float = 0.1) -> None:
        """``veto_margin``: a doubling is vetoed only when the model predicts it more than this
        share slower; a halving whenever it predicts it slower at all (see ``_veto``)."""
        if not is_power_of_two(gpus_per_node):
            raise ValueError(f"gpus_per_node must be a power of two (TP groups tile a node), "
                             f"got {gpus_per_node}")
        self._check_tp(initial_tp, gpus_per_node)
        if not rise >= 1.0 or math.isinf(rise):
            raise ValueError(f"rise must be a finite factor >= 1 (the paper's 1.05), got {rise}")
        if not 0.0 <= veto_margin < math.inf:
            raise ValueError(f"veto_margin must be a finite share >= 0, got {veto_margin}")
        if calm_steps < 1:
            raise ValueError(f"calm_steps must be >= 1 (the paper's 4), got {calm_steps}")
        if model is not None:
            missing = [tp for tp in tp_sizes(gpus_per_node)
                       if tp not in model.profile.kv_tokens or model.gpus % tp]
            if missing:
                raise ValueError(f"the cost model cannot judge TP sizes {missing}: profile them "
                                 f"and give the job a multiple of {gpus_per_node} GPUs, or lower "
                                 "gpus_per_node")
        self.gpus_per_node = gpus_per_node
        self._rise = Fraction(repr(float(rise)))  # exact: 1.05 x 20 is 21, never 21.0000001
        self._calm_steps = calm_steps
        self._model = model
        self._veto_margin = veto_margin
        self._kinds = {kind: _KindState(initial_tp) for kind in ROUND_KINDS}
        self._reason = f"initial TP {initial_tp} (profiled best)"

    @staticmethod
    def _check_tp(tp: object, gpus_per_node: int) -> None:
        if not is_power_of_two(tp) or not isinstance(tp, int) or tp > gpus_per_node:
            raise ValueError(f"TP {tp!r} must be a power of two in [1, {gpus_per_node}] "
                             "(gpus_per_node): a TP group stays within one node")

    def plan(self, kind: str) -> int:
        """The TP size for the next step of ``kind``."""
        _check_kind(kind)
        return self._kinds[kind].tp

    def published(self) -> TpPlan:
        return TpPlan(self._kinds["short"].tp, self._kinds["long"].tp, self._reason)

    def observe(self, kind: str, preemptions: int,
                lengths: Mapping[int, float] | None = None) -> TpDecision:
        """A finished step of ``kind``: its preemption count and, optionally, its
        response-length histogram (length in tokens -> count). Returns what changed."""
        _check_kind(kind)
        if not isinstance(preemptions, int) or isinstance(preemptions, bool) or preemptions < 0:
            raise ValueError(f"preemptions must be an int >= 0, got {preemptions!r}")
        if lengths is not None:
            _check_histogram(lengths)
        state = self._kinds[kind]
        if lengths and any(c > 0 for c in lengths.values()):
            state.lengths = dict(lengths)  # an empty round says nothing about lengths
        previous, state.last_preemptions = state.last_preemptions, preemptions
        state.calm = state.calm + 1 if preemptions == 0 else 0
        if previous is not None and preemptions > self._rise * previous:
            return self._move(kind, state.tp * 2, f"preemptions rose from {previous} to "
                              f"{preemptions} (> {float(self._rise)}x)")
        if state.calm >= self._calm_steps:
            state.calm = 0
            return self._move(kind, state.tp // 2,
                              f"{self._calm_steps} steps without preemptions")
        return TpDecision(kind, state.tp, state.tp, "no trigger")

    def _move(self, kind: str, target: int, why: str) -> TpDecision:
        state = self._kinds[kind]
        before = state.tp
        if not 1 <= target <= self.gpus_per_node:
            return TpDecision(kind, before, before, f"{why}; TP {before} is already at its bound")
        veto = self._veto(state, target)
        if veto:
            return TpDecision(kind, before, before, f"{why}; {veto}")
        state.tp = target
        self._reason = f"{kind}: {why}: TP {before} -> {target}"
        return TpDecision(kind, before, target, self._reason)

    def _veto(self, state: _KindState, target: int) -> str | None:
        """Why the cost model rejects ``target``, or None. The model only vetoes: without it (or
        without a histogram of this kind) the paper's heuristic decides alone.

        Asymmetric on purpose: the model is fluid (evicted requests resume at once) and so
        underestimates what preemptions cost (rlharvest/sim/tp_planning.py measures up to ~30% at high
        pressure). A doubling, backed by observed preemptions, passes unless predicted clearly
        slower; a halving, backed only by their absence, must not be predicted slower at all."""
        if self._model is None or state.lengths is None:
            return None
        now = self._model.predict(state.tp, state.lengths).makespan_s
        then = self._model.predict(target, state.lengths).makespan_s
        slack = 1.0 + self._veto_margin if target > state.tp else 1.0
        if then > now * slack:
            return (f"vetoed: the cost model predicts TP {target} slower ({then:.3g} s) than TP "
                    f"{state.tp} ({now:.3g} s)")
        return None

    def state_dict(self) -> dict[str, object]:
        """JSON-able state (histograms as [length, count] pairs: JSON keys are strings)."""
        kinds = {kind: {"tp": s.tp, "last_preemptions": s.last_preemptions, "calm": s.calm,
                        "lengths": None if s.lengths is None else sorted(
                            [n, c] for n, c in s.lengths.items())}
                 for kind, s in self._kinds.items()}
        return {"version": STATE_VERSION, "gpus_per_node": self.gpus_per_node,
                "reason": self._reason, "kinds": kinds}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore ``state_dict()``; refuses state that does not fit this planner."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"TP planner state version {state.get('version')!r} is not "
                             f"{STATE_VERSION}")
        kinds, reason = state.get("kinds"), state.get("reason")
        if not isinstance(kinds, Mapping) or set(kinds) != set(ROUND_KINDS) or \
                not isinstance(reason, str):
            raise ValueError(f"TP planner state needs 'kinds' for {ROUND_KINDS} and a 'reason'; "
                             f"got {state!r}")
        restored = {kind: self._restore_kind(kind, kinds[kind]) for kind in ROUND_KINDS}
        self._kinds, self._reason = restored, reason

    def _restore_kind(self, kind: str, raw: object) -> _KindState:
        if not isinstance(raw, Mapping):
            raise ValueError(f"TP planner state for {kind!r} is not a mapping: {raw!r}")
        tp, last, calm, pairs = (raw.get("tp"), raw.get("last_preemptions"), raw.get("calm"),
                                 raw.get("lengths"))
        self._check_tp(tp, self.gpus_per_node)
        assert isinstance(tp, int)
        if last is not None and (not isinstance(last, int) or last < 0):
            raise ValueError(f"{kind}: last_preemptions must be null or an int >= 0, got {last!r}")
        if not isinstance(calm, int) or not 0 <= calm < self._calm_steps:
            raise ValueError(f"{kind}: calm must be an int in [0, {self._calm_steps}), got "
                             f"{calm!r}")
        lengths = None
        if pairs is not None:
            if not isinstance(pairs, list) or not all(
                    isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
                raise ValueError(f"{kind}: lengths must be null or [length, count] pairs, got "
                                 f"{pairs!r}")
            lengths = {n: c for n, c in pairs}
            _check_histogram(lengths)
        return _KindState(tp, last, calm, lengths)
