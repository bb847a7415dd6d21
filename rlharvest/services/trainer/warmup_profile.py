"""The job's profile for the placement scheduler, measured at start-up (WEAVE §5 workflow ①②).

``--placement-scheduler`` without ``--placement-t-roll-s``/``--placement-t-train-s``: before it
submits, the trainer measures what the scheduler's worst-case estimate needs (``JobProfile``)
and the scheduler derives the phase durations from it (every response at the token limit).

- Rollout: the workers' own engine (``TorchEngine``) on the job's model preset or checkpoint,
  one step's batch (prompts x samples) of prompts as long as the longest the job sends: the
  first engine step is the prefill, the median of the next ``decode_steps`` the decode step.
  Measured where the trainer runs, not on a rollout node: on a different accelerator the
  estimate is off by their speed ratio, which the drift check (§5.3) then corrects. Decode is
  timed at a context of the prompt plus a few tokens, so for long responses (attention over a
  longer context) it is optimistic too.
- Training: forward passes of the policy itself, without gradients (its weights and optimizer
  state are untouched), run by every rank (under ZeRO-3 a forward gathers from them all), times
  3 for forward + backward (the usual FLOP ratio), over a sample of at most
  ``sample_sequences`` sequences of at most ``sample_tokens`` tokens, scaled linearly to the
  step (attention's quadratic share ignored: an optimistic estimate for long responses).

The weights' values do not change the timings, so the rollout engine loads the start weights.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from rlharvest.common.engine_types import EngineRequest, SamplingParams
from rlharvest.services.placement_scheduler.model import JobProfile
from rlharvest.services.rollout_worker.torch_engine import TorchEngine
from rlharvest.services.trainer.device import module_device, synchronize

log = logging.getLogger(__name__)

FORWARD_BACKWARD_FLOPS = 3.0  # backward costs about twice the forward


def measure_rollout(model: str, batch: int, prompt_tokens: int, decode_steps: int = 8,
                    device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(prefill seconds of the whole batch, seconds of one decode step of it), the engine on
    ``device`` (the trainer's) in ``dtype`` (the workers')."""
    engine = TorchEngine(model=model, seed=0, max_running=batch,
                         max_len=prompt_tokens + decode_steps + 1,
                         prefill_token_budget=batch * prompt_tokens, device=device, dtype=dtype)
    # Untimed: a device's first steps pay its one-off setup (CUDA context, cuBLAS handles).
    # Every step's tokens are read back to the host, so a step's wall time is its device time.
    engine.add(EngineRequest("warmup", [1, 2], SamplingParams(temperature=1.0, max_tokens=2)))
    while engine.has_work():
        engine.step()
    for i in range(batch):  # token ids below any vocabulary's size; no stop token: full length
        engine.add(EngineRequest(f"warmup-{i}", [1 + (i + k) % 7 for k in range(prompt_tokens)],
                                 SamplingParams(temperature=1.0, max_tokens=decode_steps)))
    times = []
    while engine.has_work():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times[0], statistics.median(times[1:]) if len(times) > 1 else times[0]


@torch.no_grad()
def time_forward(policy: torch.nn.Module, rows: int, length: int) -> float:
    """Seconds of one forward pass of ``policy`` over ``rows`` x ``length`` tokens: the median
    of 3 after a warm one. Each rank of a ZeRO-3 trainer runs it (``Ranks.forward_seconds``):
    the forward gathers the parameters from all of them."""
    device = module_device(policy)
    ids = torch.ones(rows, length, dtype=torch.long, device=device)
    policy(ids)  # warm: allocations and kernels of the first call
    times = []
    for _ in range(3):
        synchronize(device)  # on a GPU, time the kernels, not their launch
        started = time.perf_counter()
        policy(ids)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_train_tokens_per_s(forward_seconds: Callable[[int, int], float], sequences: int,
                               tokens: int, sample_sequences: int = 16,
                               sample_tokens: int = 256) -> float:
    """Training tokens per second of forward + backward, estimated from forward passes
    (``forward_seconds(rows, length)``: the trainer's ranks time one)."""
    rows, length = min(sequences, sample_sequences), max(min(tokens, sample_tokens), 2)
    seconds = forward_seconds(rows, length)
    return rows * length / (FORWARD_BACKWARD_FLOPS * max(seconds, 1e-6))


def measure_profile(model: str, forward_seconds: Callable[[int, int], float],
                    device: torch.device, batch: int, prompt_tokens: int,
                    max_response_tokens: int, decode_steps: int = 8,
                    served: torch.dtype = torch.float32) -> JobProfile:
    """The profile: the rollout engine on ``device`` (the trainer's) in ``served``, the dtype
    the workers serve in (on a GPU bf16 decodes about twice as fast as fp32); training from
    ``forward_seconds`` (``Ranks.forward_seconds``)."""
    prompt_tokens = max(prompt_tokens, 1)
    prefill_s, decode_s = measure_rollout(model, batch, prompt_tokens, decode_steps, device,
                                          served)
    train = measure_train_tokens_per_s(forward_seconds, batch,
                                       prompt_tokens + max_response_tokens)
    profile = JobProfile(batch_size=batch, prompt_tokens=prompt_tokens,
                         max_response_tokens=max_response_tokens, decode_s_per_token=decode_s,
                         prefill_s=prefill_s, train_tokens_per_s=train)
    log.info("placement: measured profile: prefill %.3f s and decode %.4f s per token for %d "
             "responses, training %.0f tokens/s: worst case rollout %.2f s, training %.2f s",
             prefill_s, decode_s, batch, train, profile.worst_case_rollout_s(),
             profile.worst_case_train_s())
    return profile
