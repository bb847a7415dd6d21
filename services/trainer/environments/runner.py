"""Plays agentic trajectories through the rollout manager, turn by turn (issue 18).

One trajectory: the environment's first observation is the prompt. Every turn is one ``Generate``
over the whole history, carrying ``trajectory_id`` and ``turn`` so the manager routes it to the
worker that holds the history's KV (``turn_routing.py``). The completion is decoded and passed to
the environment as the action. Its observation is appended to the history. The loop ends when the
environment says done, after ``max_turns``, or when the next turn would not fit the context.

What comes out is what GRPO trains on: the tokens after the prompt, each marked as the model's
(``trained``, with its rollout logprob) or the environment's (an observation, masked out of the
loss), and the trajectory's reward (the sum of its steps' rewards). An environment that raises,
hangs past ``env_timeout_s``, or returns something malformed fails that trajectory with the reason
recorded (``failed``); the others go on. A manager or rollout failure raises, as a step's does.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from rlharvest.common import rpc
from rlharvest.common.daemon_thread import run_in_daemon_thread
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb, rollout_manager_pb2_grpc
from rlharvest.common.tokenizer import CharTokenizer
from rlharvest.services.trainer.environments.interface import (
    Environment,
    EnvironmentError_,
    checked_observation,
    checked_step,
)


@dataclass(frozen=True)
class PlayConfig:
    weight_version: int = 0
    max_turns: int = 8
    max_new_tokens: int = 4  # per turn
    temperature: float = 1.0
    top_p: float = 1.0
    context: int = 512  # prompt + everything after it, as the workers' max_len
    env_timeout_s: float = 5.0
    no_worker_deadline_s: float = 60.0


@dataclass
class Trajectory:
    trajectory_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # completions and observations, in order
    trained: list[bool] = field(default_factory=list)  # per token: the model's (True) or not
    logprobs: list[float] = field(default_factory=list)  # per token; 0.0 for observations
    reward: float = 0.0
    turns: int = 0
    done: bool = False  # the environment ended the episode (else: turns or context ran out)
    failed: str = ""  # why the environment failed it; "" when it did not

    def append(self, tokens: list[int], logprobs: list[float] | None) -> None:
        self.token_ids += tokens
        self.trained += [logprobs is not None] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


async def play(endpoint: str, env: Environment, trajectory_id: str, seed: int,
               cfg: PlayConfig, tokenizer: CharTokenizer | None = None) -> Trajectory:
    """One trajectory of ``env`` (a fresh instance) from ``reset(seed)``."""
    tok = tokenizer or CharTokenizer()
    try:
        first = checked_observation(await _call(lambda: env.reset(seed), cfg), "reset")
        prompt = _encode(tok, first, bos=True)
    except EnvironmentError_ as exc:
        return Trajectory(trajectory_id, [], failed=f"reset: {exc}")
    out = Trajectory(trajectory_id, prompt)
    async with rpc.channel(endpoint) as chan:
        stub = rollout_manager_pb2_grpc.RolloutManagerStub(chan)
        for turn in range(cfg.max_turns):
            history = out.prompt_ids + out.token_ids
            if len(history) + cfg.max_new_tokens > cfg.context:
                break  # the context is full: the trajectory ends here, scored as it is
            tokens, logprobs = await _generate(stub, trajectory_id, turn, history, seed, cfg)
            out.append(tokens, logprobs)
            out.turns += 1
            try:
                step = checked_step(await _call(lambda: env.step(tok.decode(tokens)), cfg))
                observation = _encode(tok, step.observation, bos=False)
            except EnvironmentError_ as exc:
                out.failed = f"turn {turn}: {exc}"
                return out
            out.reward += step.reward
            if step.done:
                out.done = True
                break
            out.append(observation, None)
    return out


async def play_group(endpoint: str, make_env: Callable[[], Environment], group_id: str,
                     seed: int, size: int, cfg: PlayConfig) -> list[Trajectory]:
    """A GRPO group: ``size`` trajectories of one episode (the same reset seed), at once; each
    samples with its own seeds (they follow from its trajectory id)."""
    return list(await asyncio.gather(*(
        play(endpoint, make_env(), f"{group_id}-t{i}", seed, cfg) for i in range(size))))


async def _call(fn: Callable[[], object], cfg: PlayConfig) -> object:
    """The environment's call in a daemon thread under the timeout; its failures as
    EnvironmentError_ (a hung call is abandoned: the thread dies with the process)."""
    try:
        return await asyncio.wait_for(run_in_daemon_thread(fn, "environment"), cfg.env_timeout_s)
    except asyncio.TimeoutError:
        raise EnvironmentError_(f"no answer within {cfg.env_timeout_s:g} s") from None
    except EnvironmentError_:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure fails the trajectory
        raise EnvironmentError_(f"raised {type(exc).__name__}: {exc}") from exc


def _turn_seed(trajectory_id: str, turn: int, seed: int) -> int:
    """A turn's sampling seed: stable across processes (``hash`` of a str is not)."""
    return zlib.crc32(f"{trajectory_id}/{turn}/{seed}".encode())


def _encode(tok: CharTokenizer, text: str, bos: bool) -> list[int]:
    try:
        return tok.encode(text, add_bos=bos)
    except ValueError as exc:
        raise EnvironmentError_(f"observation not encodable: {exc}") from None


async def _generate(stub: rollout_manager_pb2_grpc.RolloutManagerStub, trajectory_id: str,
                    turn: int, history: list[int], seed: int,
                    cfg: PlayConfig) -> tuple[list[int], list[float]]:
    request = mpb.RolloutRequest(
        request_id=f"{trajectory_id}-{turn}", group_id=trajectory_id, prompt_token_ids=history,
        trajectory_id=trajectory_id, turn=turn, last_turn=turn == cfg.max_turns - 1,
        sampling=common_pb2.SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                           max_tokens=cfg.max_new_tokens,
                                           seed=_turn_seed(trajectory_id, turn, seed)))
    completion = None
    async for event in stub.Generate(mpb.GenerateRequest(
            request=request, weight_version=cfg.weight_version,
            no_worker_deadline_s=cfg.no_worker_deadline_s)):
        for c in event.completions:
            completion = c
    if completion is None or completion.failed:
        reason = "no completion" if completion is None else completion.finish_reason
        raise RuntimeError(f"turn {turn} of {trajectory_id} failed in rollout: {reason}")
    return list(completion.token_ids), list(completion.logprobs)
