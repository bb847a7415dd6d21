"""RLBoost §4.1's promise that seeding changes where tokens are made, not what is learnt: a step
rolled out with a seeding window (a seed worker first, its requests handed over mid-flight to a
remote worker, which only prefills them) gives the same completions as the same step without
one, and so the same GRPO update. Real manager and worker processes; the seed worker is a
rollout worker of kind ``seed`` (what the trainer's seed role registers), slowed so its
requests are mid-flight when the window closes."""

from __future__ import annotations

import pytest
import torch

from rlharvest.models.tiny_model import build_model
from rlharvest.models.tokenizer import PAD_ID
from rlharvest.services.rollout_manager.client import wait_workers
from rlharvest.services.trainer.backend import OptimConfig, make_backend
from rlharvest.services.trainer.grpo import LossConfig
from rlharvest.services.trainer.stream_trainer import Completion, RewardedGroup, StreamingStep

from .test_manager import run_step, scrape, start_manager, step_request
from .worker_client import launch_worker, wait_serving

pytestmark = pytest.mark.integration
REQUESTS, GROUP, TOKENS = 8, 4, 24


def grpo_update(completions: dict, request: object) -> torch.nn.Module:
    """One GRPO step of the trainer's stream trainer on these completions (reward: the share of
    even tokens, a function of the tokens alone), from a fixed tiny model."""
    model = build_model("tiny", seed=0)
    step = StreamingStep(make_backend("torch", model, OptimConfig(lr=0.5, optimizer="sgd",
                                                                  grad_clip=0.0)),
                         num_groups=REQUESTS // GROUP, group_size=GROUP, micro_batch_groups=1,
                         loss=LossConfig(), pad_id=PAD_ID)
    requests = list(request.requests)  # type: ignore[attr-defined]
    for g in range(REQUESTS // GROUP):
        members = requests[g * GROUP:(g + 1) * GROUP]
        comps = [completions[r.request_id] for r in members]
        step.add_groups([RewardedGroup(g, [
            Completion(list(r.prompt_token_ids), list(c.token_ids), list(c.logprobs))
            for r, c in zip(members, comps)],
            [sum(t % 2 == 0 for t in c.token_ids) / max(len(c.token_ids), 1) for c in comps])])
    step.finish()
    return model


async def test_a_seeded_step_gives_the_same_completions_and_update_as_an_unseeded_one(stack):
    seed = launch_worker(stack, "seed", "--kind", "seed", "--max-running", "8",
                         "--step-delay-s", "0.03")
    remote = launch_worker(stack, "w0", "--max-running", "8")
    manager = start_manager(stack)
    for worker in (seed, remote):
        wait_serving(worker, 120)
    await wait_workers(manager.endpoint, names=["seed", "w0"])

    seeded = step_request(REQUESTS, TOKENS, prefix="a")
    seeded.seed_window_s = 0.3  # ~10 of the seed's slowed steps: its requests are mid-flight
    got_seeded = await run_step(manager.endpoint, seeded)
    metrics = scrape(manager.metrics_port)
    handed = metrics.get("rlh_manager_seed_handoffs_total", 0)
    assert handed > 0, "the window closed with nothing to hand over: the test proves nothing"
    assert metrics.get('rlh_manager_migrations_total{cause="seed_window"}', 0) > 0
    # Handed over mid-flight: the seed generated tokens, and the remote worker resumed some.
    seed_metrics = scrape(seed.metrics_port)
    assert seed_metrics.get("rlh_worker_tokens_generated_total", 0) > 0
    # ...and stopped generating them within one engine step of the close's abort.
    aborts = seed_metrics.get("rlh_worker_abort_wait_steps_count", 0)
    assert aborts > 0 and seed_metrics.get('rlh_worker_abort_wait_steps_bucket{le="1.0"}') == aborts
    assert scrape(remote.metrics_port).get('rlh_worker_requests_added_total{resumed="true"}',
                                           0) > 0

    plain = step_request(REQUESTS, TOKENS, prefix="b")  # the same prompts and seeds
    plain.seed_window_s = 0.0  # no window: the seed worker takes nothing
    got_plain = await run_step(manager.endpoint, plain)
    assert scrape(manager.metrics_port).get("rlh_manager_seed_handoffs_total", 0) == handed

    for i in range(REQUESTS):
        a, b = got_seeded[f"a{i}"], got_plain[f"b{i}"]
        assert list(a.token_ids) == list(b.token_ids), f"request {i} differs after the handover"
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    updated_seeded = grpo_update({f"b{i}": got_seeded[f"a{i}"] for i in range(REQUESTS)}, plain)
    updated_plain = grpo_update(got_plain, plain)
    base = build_model("tiny", seed=0)
    for (name, p), q in zip(updated_seeded.named_parameters(), updated_plain.parameters()):
        assert torch.allclose(p, q, atol=1e-5, rtol=0), f"{name} differs"
    assert any(not torch.equal(p, b) for p, b in zip(updated_plain.parameters(),
                                                      base.parameters())), \
        "the update moved no parameter: the comparison proves nothing"
