"""A short round end to end through the pure parts (RollPacker §3): the manager's acceptance
rule decides, the trainer's group assembler trains exactly P0 groups x their first R0 finishes,
never a token of a deferred prompt, and streaming the accepted groups gives the monolithic
update; with eta = 1 the round is the plain step — same requests, seeds and update."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.models.tokenizer import PAD_ID
from rlharvest.services.rollout_manager.tail_batching import TailBatchingStep
from rlharvest.services.trainer.backend import OptimConfig, make_backend
from rlharvest.services.trainer.grpo import LossConfig
from rlharvest.services.trainer.step_plan import (
    Acceptance,
    GroupAssembler,
    ReadyGroup,
    RolloutFailed,
    StepSpec,
    StreamIncomplete,
    submit_request,
)
from rlharvest.services.trainer.stream_trainer import Completion, RewardedGroup, StreamingStep
from tests.builders import PolicyProgress, step_spec
from tests.unit.test_trainer_stream import assert_same_parameters, fresh_model

VERSION = 3


def request(spec: StepSpec) -> mpb.SubmitStepRequest:
    return submit_request(spec, max_new_tokens=8, temperature=1.0, top_p=1.0, stop_token_ids=[2],
                          data_seed=7, no_worker_deadline_s=0)


def finished(rid: str, tokens: list[int]) -> mpb.Completion:
    return mpb.Completion(request_id=rid, token_ids=tokens, logprobs=[-0.5] * len(tokens),
                          weight_version=VERSION, finish_reason="stop")


def cancelled(rid: str) -> mpb.Completion:
    return mpb.Completion(request_id=rid, failed=True, cancelled=True, finish_reason="cancelled",
                          weight_version=VERSION)


class Round:
    """Plays one step: requests finish in ``order``; the manager's rule (for a short round)
    cancels and decides after each delivery; rewards come back at random later moments."""

    def __init__(self, spec: StepSpec, seed: int) -> None:
        self.rng = random.Random(seed)
        self.spec = spec
        groups = {r.request_id: r.group_id for r in request(spec).requests}
        self.rule = TailBatchingStep(groups, spec.accept.prompts, spec.accept.responses) \
            if spec.accept else None
        self.step = PolicyProgress(tuple(groups), set(groups))
        self.assembler = GroupAssembler(spec)
        self.tokens = {rid: [self.rng.randrange(3, 60) for _ in range(self.rng.randint(1, 6))]
                       for rid in groups}
        self.finish_order: list[str] = []
        self.ready: list[ReadyGroup] = []
        self._unrewarded: list[tuple[int, int]] = []

    def play(self, order: list[str]) -> Round:
        for rid in order:
            if rid in self.step.outstanding:
                self._deliver(rid)
            self._reward_some()
        while self._unrewarded:
            self._reward_some(everything=True)
        self.assembler.check_complete()
        return self

    def _deliver(self, rid: str) -> None:
        self.step.deliver(rid, True)
        self.finish_order.append(rid)
        if (place := self.assembler.completion(finished(rid, self.tokens[rid]))) is not None:
            self._unrewarded.append(place)
        if self.rule is None:
            return
        cuts = list(self.rule.cut(self.step, 0.0))
        # The verdicts go out with the delivery that decided them; the cut requests resolve
        # later — cancelled, or finished anyway when they finished before the cancel reached
        # their worker (a race the manager delivers as a finished completion).
        for verdict in self.rule.verdicts(self.step):
            if (group := self.assembler.verdict(verdict.group_id, verdict.accepted)) is not None:
                self.ready.append(group)
        for cut in cuts:
            if self.rng.random() < 0.3:
                self.step.deliver(cut, True)
                self.finish_order.append(cut)
                if (place := self.assembler.completion(finished(cut, self.tokens[cut]))):
                    self._unrewarded.append(place)
            else:
                self.step.deliver(cut, False)
                assert self.assembler.completion(cancelled(cut)) is None

    def _reward_some(self, everything: bool = False) -> None:
        self.rng.shuffle(self._unrewarded)
        count = len(self._unrewarded) if everything else self.rng.randint(0, len(self._unrewarded))
        for group, sample in self._unrewarded[:count]:
            if (done := self.assembler.reward(group, sample, reward(group, sample))) is not None:
                self.ready.append(done)
        del self._unrewarded[:count]


def reward(group: int, sample: int) -> float:
    return float((group * 7 + sample * 3) % 5) / 4


def short_spec(p0: int, r0: int, eta_p: float, eta_r: float) -> StepSpec:
    return step_spec(version=VERSION, prompts=math.ceil(eta_p * p0), samples=math.ceil(eta_r * r0),
                     accept=Acceptance(p0, r0))


@settings(max_examples=150, deadline=None)
@given(p0=st.integers(1, 4), r0=st.integers(1, 4), eta_p=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
       eta_r=st.sampled_from([1.0, 1.25, 1.5, 2.0]), seed=st.integers(0, 100_000))
def test_a_short_round_trains_p0_groups_of_their_first_r0_finishes_and_no_deferred_token(
        p0, r0, eta_p, eta_r, seed):
    spec = short_spec(p0, r0, eta_p, eta_r)
    order = [r.request_id for r in request(spec).requests]
    random.Random(seed).shuffle(order)
    played = Round(spec, seed).play(order)
    a = played.assembler
    assert sorted(g.group for g in played.ready) == sorted(a.accepted)
    assert len(played.ready) == p0 and len(a.deferred) == len(spec.items) - p0
    trained: set[str] = set()
    for group in played.ready:
        first = [rid for rid in played.finish_order if a.parse(rid)[0] == group.group][:r0]
        ids = [c.request_id for c in group.completions]
        assert ids == sorted(first, key=lambda rid: a.parse(rid)[1])  # first R0, sample order
        assert list(group.rewards) == [reward(*a.parse(rid)) for rid in ids]
        trained.update(ids)
    assert not {rid for rid in trained if a.parse(rid)[0] in a.deferred}
    finished_tokens = sum(len(played.tokens[rid]) for rid in played.finish_order)
    trained_tokens = sum(len(played.tokens[rid]) for rid in trained)
    assert a.tokens_discarded == finished_tokens - trained_tokens


def train(groups: list[ReadyGroup], spec: StepSpec, micro_batch_groups: int,
          model: torch.nn.Module) -> None:
    backend = make_backend("torch", model, OptimConfig(lr=0.5, optimizer="sgd", grad_clip=0.0))
    step = StreamingStep(backend, num_groups=spec.train_groups, group_size=spec.group_size,
                         micro_batch_groups=micro_batch_groups, loss=LossConfig(), pad_id=PAD_ID)
    rewarded = [RewardedGroup(g.group, [Completion(list(spec.prompts[g.group]), list(c.token_ids),
                                                   list(c.logprobs)) for c in g.completions],
                              list(g.rewards)) for g in groups]
    if micro_batch_groups == spec.train_groups:
        step.add_groups(rewarded)  # one batch holding every group: the monolithic update
    else:
        for group in rewarded:
            step.add_group(group)
    step.finish()


def test_streaming_the_accepted_groups_gives_the_monolithic_update_over_them():
    spec = short_spec(3, 2, 1.5, 2.0)
    order = [r.request_id for r in request(spec).requests]
    random.Random(4).shuffle(order)
    played = Round(spec, 4).play(order)
    assert len(played.ready) == 3
    base = fresh_model(0)
    streamed, monolithic = copy.deepcopy(base), copy.deepcopy(base)
    train(played.ready, spec, 1, streamed)
    train(sorted(played.ready, key=lambda g: g.group), spec, spec.train_groups, monolithic)
    assert_same_parameters(streamed, monolithic)
    assert not torch.equal(next(streamed.parameters()), next(base.parameters())), "no update"


def test_without_speculation_a_short_round_is_the_plain_step():
    plain = step_spec(version=VERSION, prompts=3, samples=2)
    short = step_spec(version=VERSION, prompts=3, samples=2, accept=Acceptance(3, 2))
    wire = request(short)
    assert wire.acceptance == mpb.Acceptance(prompts=3, responses=2)
    wire.ClearField("acceptance")
    assert wire == request(plain)  # the same requests, ids and seeds
    order = [r.request_id for r in request(plain).requests]
    random.Random(1).shuffle(order)
    ran_plain, ran_short = Round(plain, 1).play(order), Round(short, 1).play(order)
    assert sorted(ran_plain.ready, key=lambda g: g.group) == \
        sorted(ran_short.ready, key=lambda g: g.group)
    assert ran_short.assembler.tokens_discarded == 0 and not ran_short.assembler.deferred
    models = [fresh_model(1), fresh_model(1)]
    train(ran_plain.ready, plain, 1, models[0])
    train(ran_short.ready, short, 1, models[1])
    assert_same_parameters(models[0], models[1], atol=0.0)


def test_a_plain_step_refuses_a_cancelled_completion_and_verdicts():
    a = GroupAssembler(step_spec(version=VERSION))
    with pytest.raises(RolloutFailed, match="cancelled"):
        a.completion(cancelled("s5-g0-r0"))
    with pytest.raises(ValueError, match="verdict"):
        a.verdict("s5-g1", True)


def test_a_stream_that_ends_before_the_round_is_decided_is_incomplete():
    spec = short_spec(1, 1, 2.0, 1.0)  # 2 prompts x 1 response, accept 1
    a = GroupAssembler(spec)
    a.completion(finished("s5-g0-r0", [5]))
    a.completion(cancelled("s5-g1-r0"))
    with pytest.raises(StreamIncomplete, match="without a verdict"):
        a.check_complete()


def test_a_failed_request_of_a_short_round_does_not_count_and_the_round_goes_on():
    spec = short_spec(1, 2, 2.0, 1.5)  # 2 prompts x 3 responses, accept 1 prompt of 2
    a = GroupAssembler(spec)
    failed = mpb.Completion(request_id="s5-g0-r0", failed=True, finish_reason="no worker",
                            weight_version=VERSION)
    assert a.completion(failed) is None
    assert a.completion(finished("s5-g0-r1", [4])) == (0, 1)
    assert a.completion(finished("s5-g0-r2", [5, 6])) == (0, 2)
    assert a.verdict("s5-g0", True) is None  # rewards pending
    a.reward(0, 1, 1.0)
    ready = a.reward(0, 2, 0.0)
    assert ready is not None and [c.request_id for c in ready.completions] == ["s5-g0-r1",
                                                                              "s5-g0-r2"]
    for r in range(3):
        a.completion(cancelled(f"s5-g1-r{r}"))
    a.verdict("s5-g1", False)
    a.check_complete()
