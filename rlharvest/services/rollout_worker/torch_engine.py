"""The built-in inference engine of a rollout worker: continuous batching in plain torch.

RLBoost §4.2 (live request tracking and migration): a worker must accept requests at any time,
stream every token as it is produced, drop requests on command, and *resume* a request migrated
from another worker by prefilling prompt + tokens generated so far, then continue as if it had never
moved. Here that means:

- up to ``max_running`` requests execute, each owning a KV-cache slot; the rest wait FIFO;
- every ``step`` admits waiting requests into free slots (one batched prefill per group), runs ONE
  batched decode over the requests already running, and samples one token for every executing
  request; finished requests leave the batch at once;
- sampling noise is keyed by (seed, token position) (``sampling.py``), so a resumed request draws
  the same tokens it would have drawn uninterrupted.

Chunked prefill (ROSE §4.1, ``prefill_chunk`` > 0): one step prefills at most ``prefill_chunk``
tokens in all, beside its one decode, so a step never runs longer than one chunk plus one decode
however long the prompts that arrive. Pending requests are taken FIFO while they fit in what is left
of the chunk; the first that does not fit is prefilled as far as the chunk allows and goes on in the
next steps (at most one request is mid-prefill at a time). It holds a KV slot meanwhile (``load``
counts it as executing) but is not decoded and emits nothing until its last chunk runs; that step
samples its first token and it joins the decode batch. ``prefill_chunk`` = 0 prefills every admitted
prompt whole in its first step.

KV budget (RollPacker §4.2, ``kv_budget_tokens`` > 0): the executing requests may hold at most that
many KV tokens, as if the GPU memory left for KV were that small. Like vLLM's preemption by
recomputation, before a decode that would take the running requests past it the newest admitted
request gives up its slot and waits at the head of the queue with prompt + every token it generated;
it is prefilled again later through the same path a migrated request takes, and samples on from the
same (seed, position), so its completion does not change. ``preemptions`` counts them (``load``
reports it): the memory pressure signal the paper's parallelism planner reads.

Resumed output equals uninterrupted output up to float numerics: the resumed prefill computes the
same attention in one pass that decode computed token by token, and the two differ in the last
bits, which can flip a near-tie between two tokens (``tests/unit/test_torch_engine.py`` measures
how often).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rlharvest.common import start_weights
from rlharvest.models.decoder_weights import decoder_config, load_decoder
from rlharvest.common.engine_types import EngineInputError, EngineLoad, EngineRequest, RequestOutput
from rlharvest.services.rollout_worker.kv_cache import SlotKVCache
from rlharvest.services.rollout_worker.kv_pages import (
    KVPages,
    OwnPages,
    PagedKVCache,
    PageStore,
    page_bytes,
)
from rlharvest.services.rollout_worker.decoder_forward import DecoderForward
from rlharvest.services.rollout_worker.prefix_cache import PrefixCache, check_prefix_cache
from rlharvest.services.rollout_worker.sampling import (
    GREEDY_BELOW,
    SamplingBatch,
    sample,
    seed_key,
)


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

def kv_page_bytes(model: str, page_tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes a KV page of ``page_tokens`` tokens takes for ``model`` (a preset or checkpoint)."""
    cfg = decoder_config(model)
    return page_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                      page_tokens, dtype)


@dataclass(frozen=True)
class PagedKV:
    """The paged KV cache option: the engine's KV lives in pages of ``store`` (maybe shared
    with another model), ``page_tokens`` tokens each, and ``pages`` says which pages each
    request holds (``kv_pages.OwnPages`` for an engine of its own, the co-executor's pool for
    its two)."""

    store: PageStore
    page_tokens: int
    pages: KVPages


@dataclass
class _Admitted:
    """A request the engine accepted, with the token ids it will prefill."""

    request: EngineRequest
    known_tokens: list[int]  # prompt + tokens generated before a resume
    stop_ids: frozenset[int]
    generated: int  # tokens generated so far, including those before a resume
    prefilled: int = 0  # known tokens already in the KV cache (chunked prefill, a cached prefix)
    emitted: list[int] = dataclasses.field(default_factory=list)  # tokens sampled since admission
    seq: int = 0  # admission order (the KV budget preempts the newest first)
    prefix_keys: list[bytes] = dataclasses.field(default_factory=list)  # prefix-cache hit read
    # The prefix cache's generation it was admitted under (its KV's weights): PrefixCache.generation
    kv_generation: int = -1


def _admission(request: EngineRequest) -> _Admitted:
    """A request as the engine queues it: a resumed one prefills prompt + generated tokens."""
    return _Admitted(request=request,
                     known_tokens=list(request.prompt_token_ids) + list(request.generated_token_ids),
                     stop_ids=frozenset(request.sampling.stop_token_ids),
                     generated=len(request.generated_token_ids))


def check_kv_budget(kv_budget_tokens: int, max_len: int, paged: bool) -> None:
    """Raises ValueError saying why ``kv_budget_tokens`` cannot be used with these options."""
    if kv_budget_tokens < 0:
        raise ValueError(f"kv_budget_tokens must be >= 0 (0 = no budget), got {kv_budget_tokens}")
    if kv_budget_tokens and paged:
        raise ValueError("kv_budget_tokens cannot be combined with paged KV (paged / kv_pages): "
                         "paged KV reserves pages for prompt + max_tokens when a request starts, "
                         "so a running request never outgrows memory and there is nothing to "
                         "preempt; bound memory with kv_pages, or set kv_budget_tokens=0")
    # Every request validate_request accepts (prompt + max_tokens <= max_len) must fit alone, as
    # vLLM refuses a max_model_len its KV cache cannot hold: then add never has to refuse a
    # request for the budget, admission always takes the first pending request into an idle
    # engine, and preemption always leaves the oldest request running, so every request finishes.
    if 0 < kv_budget_tokens < max_len:
        raise ValueError(f"kv_budget_tokens ({kv_budget_tokens}) must be >= max_len ({max_len}) "
                         "so a request of max_len tokens fits alone; raise the budget or lower "
                         "max_len")


def check_kv_pages(kv_pages: int, page_tokens: int, max_len: int) -> None:
    """Raises ValueError when a paged KV pool of its own (``kv_pages``) cannot hold one request
    of ``max_len`` tokens."""
    # A request reserves its pages for prompt + max_tokens when it starts, in FIFO order: one
    # the whole pool cannot hold would wait at the head of the queue forever, every request
    # behind it with it. As vLLM refuses a max_model_len its KV cache cannot hold, refuse the
    # configuration, so every request validate_request accepts fits alone.
    if kv_pages and kv_pages * page_tokens < max_len:
        raise ValueError(f"kv_pages ({kv_pages}) x page_tokens ({page_tokens}) = "
                         f"{kv_pages * page_tokens} KV tokens cannot hold one request of max_len "
                         f"({max_len}) tokens; raise kv_pages to at least "
                         f"{math.ceil(max_len / page_tokens)} or lower max_len")


@dataclass
class PrefixStats:
    """Prefix-cache totals since start (``EngineLoad`` carries them to the metrics)."""

    lookups: int = 0  # requests admitted with the cache on
    hits: int = 0  # of which started after a cached prefix
    cached_tokens: int = 0  # prefill tokens the hits skipped

    def count(self, cached_tokens: int) -> None:
        self.lookups += 1
        self.hits += cached_tokens > 0
        self.cached_tokens += cached_tokens

    def as_load(self, cache: PrefixCache | None) -> dict[str, int]:
        return {"prefix_lookups": self.lookups, "prefix_hits": self.hits,
                "prefix_cached_tokens": self.cached_tokens,
                "prefix_cache_pages": cache.pages if cache is not None else 0}


def validate_request(request: EngineRequest, vocab_size: int, max_len: int) -> None:
    """Raises EngineInputError saying what is wrong with ``request`` (and how to fix it)."""
    rid, sp = request.request_id, request.sampling
    if not isinstance(rid, str) or not rid:
        raise EngineInputError(f"request_id must be a non-empty string, got {rid!r}")
    if not request.prompt_token_ids:
        raise EngineInputError(f"request {rid}: empty prompt; send at least one token")
    for field, ids in (("prompt_token_ids", request.prompt_token_ids),
                       ("generated_token_ids", request.generated_token_ids),
                       ("stop_token_ids", sp.stop_token_ids)):
        for index, token in enumerate(ids):
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                raise EngineInputError(f"request {rid}: {field}[{index}] = {token!r} is not a "
                                       f"token id in [0, {vocab_size})")
    if not isinstance(sp.max_tokens, int) or sp.max_tokens <= 0:
        raise EngineInputError(f"request {rid}: max_tokens must be a positive int, got "
                               f"{sp.max_tokens!r}")
    # The sampling rows are float32 and int64 tensors: a value they cannot hold would raise in
    # the engine's step, ending it for every request (an API caller's temperature of 1e300).
    if not (0 <= sp.temperature <= _FLOAT32_MAX):  # also refuses NaN and infinities
        raise EngineInputError(f"request {rid}: temperature must be in [0, {_FLOAT32_MAX:.3g}] "
                               f"(0 = greedy), got {sp.temperature!r}")
    if not 0 < sp.top_p <= 1:
        raise EngineInputError(f"request {rid}: top_p must be in (0, 1], got {sp.top_p!r}")
    if not isinstance(sp.top_k, int) or isinstance(sp.top_k, bool) or not 0 <= sp.top_k < 2**63:
        raise EngineInputError(f"request {rid}: top_k must be an int >= 0 (0 = no cut), got "
                               f"{sp.top_k!r}")
    if not isinstance(sp.seed, int):
        raise EngineInputError(f"request {rid}: seed must be an int, got {sp.seed!r}")
    done = len(request.generated_token_ids)
    if done >= sp.max_tokens:
        raise EngineInputError(f"request {rid}: {done} tokens already generated, max_tokens is "
                               f"{sp.max_tokens}: nothing left to generate")
    stops = set(sp.stop_token_ids)
    for index, token in enumerate(request.generated_token_ids):
        if token in stops:
            raise EngineInputError(f"request {rid}: generated_token_ids[{index}] = {token} is a "
                                   "stop token, so the request already finished; do not resume it")
    need = len(request.prompt_token_ids) + sp.max_tokens
    if need > max_len:
        raise EngineInputError(f"request {rid}: prompt ({len(request.prompt_token_ids)} tokens) + "
                               f"max_tokens ({sp.max_tokens}) = {need} exceeds the context of "
                               f"{max_len} tokens; shorten the prompt or lower max_tokens")


class _SlotSampling:
    """Per-slot sampling state on the device, so a step slices it instead of rebuilding it."""

    def __init__(self, slots: int, device: torch.device | str) -> None:
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.int64, device=device)
        self.keys = torch.zeros(slots, dtype=torch.int64, device=device)
        self.positions = torch.zeros(slots, dtype=torch.int64, device=device)
        self.last_token = torch.zeros(slots, dtype=torch.int64, device=device)
        self._rows = (self.temperature, self.top_p, self.top_k, self.keys, self.positions,
                      self.last_token)

    def set(self, slot: int, admitted: _Admitted) -> None:
        sp = admitted.request.sampling
        self.temperature[slot] = sp.temperature
        self.top_p[slot] = sp.top_p
        self.top_k[slot] = sp.top_k
        self.keys[slot] = seed_key(sp.seed)
        self.positions[slot] = admitted.generated

    def move(self, src: int, dst: int) -> None:
        for row in self._rows:
            row[dst] = row[src]

    def batch(self, running: list[_Admitted]) -> SamplingBatch:
        count = len(running)
        params = [a.request.sampling for a in running]
        top_ks = [p.top_k for p in params]
        return SamplingBatch(
            temperature=self.temperature[:count], top_k=self.top_k[:count],
            top_p=self.top_p[:count], keys=self.keys[:count], positions=self.positions[:count],
            any_sampled=any(p.temperature >= GREEDY_BELOW for p in params),
            any_filtered=any(p.top_k > 0 or p.top_p < 1 for p in params),
            top_k_bound=max(top_ks) if min(top_ks) > 0 else 0,
        )


class TorchEngine:
    """``Engine`` (``rlharvest/common/worker_core/engine.py``) over a Qwen3, Qwen2 or Llama model (a preset
    name or a local checkpoint directory).

    ``prefill_token_budget`` caps the padded tokens of one prefill call (admitted requests are
    prefilled in groups below it), bounding activation memory when many requests join at once.
    ``prefill_chunk`` > 0 caps the tokens one step prefills (chunked prefill, see the module
    docstring); 0 prefills whole prompts. ``paged`` puts the KV in pages (``PagedKV``; ``kv_pages`` > 0: a
    store of that many ``page_tokens``-token pages of its own) instead of a ``max_len`` row per
    slot: a request reserves pages for prompt + max_tokens when it starts and waits while they
    are short. ``kv_budget_tokens`` > 0 caps the KV tokens executing requests hold, preempting the
    newest to stay under it (module docstring); it excludes paged KV and must be >= ``max_len``
    (``check_kv_budget`` says why).

    Slots: running requests hold KV slots [0, len(running)), which decode reads as one slice. The
    request mid-prefill, if any, holds the slot right after them, outside the decode slice, and
    ``_release`` keeps it there; when its last chunk runs it is appended to the running list,
    whose next index is exactly its slot.
    """

    def __init__(self, model: str = "tiny", seed: int = 0, max_running: int = 64,
                 max_len: int = 512, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", weight_version: int = 0,
                 prefill_token_budget: int = 8192, prefill_chunk: int = 0,
                 paged: PagedKV | None = None, kv_pages: int = 0, page_tokens: int = 16,
                 kv_budget_tokens: int = 0, prefix_cache: bool = False,
                 prefix_lease_s: float = 60.0) -> None:
        if max_running < 1 or max_len < 2:
            raise ValueError(f"need max_running >= 1 and max_len >= 2, got max_running="
                             f"{max_running}, max_len={max_len}")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 tokens per step (0 = prefill whole "
                             f"prompts), got {prefill_chunk}")
        check_kv_budget(kv_budget_tokens, max_len, paged is not None or kv_pages > 0)
        if paged is None:  # a shared pool is sized and admitted by its owner (the co-executor)
            check_kv_pages(kv_pages, page_tokens, max_len)
        check_prefix_cache(prefix_cache, kv_pages, shared_pool=paged is not None)
        self._model = load_decoder(model, seed, dtype, device)
        cfg = self._model.config
        self._vocab_size = cfg.vocab_size
        self._max_len = max_len
        self._prefill_token_budget = prefill_token_budget
        self._prefill_chunk = prefill_chunk
        self._weight_version = weight_version
        self._forward = DecoderForward(self._model, max_len)
        self._own: OwnPages | None = None
        if paged is None and kv_pages:  # paged KV in a store of its own
            self._own = OwnPages(kv_pages, page_tokens)
            paged = PagedKV(PageStore(kv_pages, page_bytes(
                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, page_tokens,
                dtype), device), page_tokens, self._own)
        self._paged = paged
        self._prefix = PrefixCache(page_tokens, prefix_lease_s) if prefix_cache else None
        self.prefix_stats = PrefixStats()
        self._cache: SlotKVCache | PagedKVCache
        if paged is None:
            self._cache = SlotKVCache(cfg.num_hidden_layers, max_running,
                                      cfg.num_key_value_heads, max_len, cfg.head_dim, dtype,
                                      device)
        else:
            view = paged.store.view(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                    cfg.head_dim, paged.page_tokens, dtype)
            self._cache = PagedKVCache(view, max_running, max_len)
        self._slot_sampling = _SlotSampling(max_running, device)
        self._device = torch.device(device)
        self._pending: OrderedDict[str, _Admitted] = OrderedDict()
        self._running: list[_Admitted] = []  # index = KV slot
        self._partial: _Admitted | None = None  # mid-prefill, in slot len(self._running)
        self._slot_of: dict[str, int] = {}  # running and partial requests
        self._weight_targets = self._state_dict_targets()
        self._start_weights = start_weights.fingerprint(self._weight_targets) \
            if weight_version == 0 else ""
        self._last_step_prefill_tokens = 0
        self._kv_budget = kv_budget_tokens
        self._budget_left = 0  # of the KV budget, while a step admits requests
        self._admissions = 0
        self.preemptions = 0  # requests preempted for the KV budget, since start

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
        return "slots"  # one KV slot of max_len tokens per running request

    @property
    def last_step_prefill_tokens(self) -> int:
        return self._last_step_prefill_tokens

    def add(self, request: EngineRequest) -> None:
        validate_request(request, self._vocab_size, self._max_len)
        rid = request.request_id
        if rid in self._pending or rid in self._slot_of:
            raise EngineInputError(f"request {rid} is already queued or running; use a new id "
                                   "or abort it first")
        self._pending[rid] = _admission(request)

    def abort(self, request_id: str) -> RequestOutput:
        if request_id in self._pending:
            del self._pending[request_id]
        elif self._partial is not None and self._partial.request.request_id == request_id:
            self._drop_partial()
        elif request_id in self._slot_of:
            self._release(self._slot_of[request_id])
        else:
            raise KeyError(f"request {request_id!r} is neither pending nor running")
        return RequestOutput(request_id, [], [], finished=True, finish_reason="abort")

    def has_work(self) -> bool:
        return bool(self._pending or self._running or self._partial)

    def step(self) -> list[RequestOutput]:
        with torch.inference_mode():
            logits = []
            self._preempt_over_budget()
            if self._running:
                self._bind_growth()
                logits.append(self._forward.decode(
                    self._slot_sampling.last_token[:len(self._running)], self._cache))
            logits.extend(self._admit_chunked() if self._prefill_chunk else self._admit())
            if not logits:
                return []
            tokens, logprobs = sample(torch.cat(logits) if len(logits) > 1 else logits[0],
                                      self._slot_sampling.batch(self._running))
            count = len(self._running)
            self._slot_sampling.last_token[:count] = tokens
            self._slot_sampling.positions[:count] += 1
            return self._emit(tokens.tolist(), logprobs.tolist())

    def load(self) -> EngineLoad:
        """``executing`` counts a request mid-prefill: it holds a KV slot, as running ones do."""
        executing = len(self._running) + (self._partial is not None)
        capacity = self._cache.capacity_tokens
        if self._kv_budget:  # the budget stands for the memory KV may take
            capacity = min(capacity, self._kv_budget)
        return EngineLoad(pending=len(self._pending), executing=executing,
                          kv_used_tokens=self._cache.used_tokens, kv_capacity_tokens=capacity,
                          weight_version=self._weight_version, preemptions=self.preemptions,
                          **self.prefix_stats.as_load(self._prefix))

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Copies ``tensors`` (a full state_dict or any subset of it, e.g. a sparse delta) into
        the model in place, after validating all of them: on any error nothing is copied.

        Requests already running keep their KV cache from the old weights; the caller aborts
        them (the on-policy invariant forbids finishing them under a new version).
        """
        check_weights(tensors, version, self._weight_targets)
        with torch.no_grad():
            for name, value in tensors.items():
                self._weight_targets[name].copy_(value)
        self._forward.refresh()
        self._weight_version = version
        if version == 0:  # start weights loaded (a placed worker's cold switch, a checkpoint)
            self._start_weights = start_weights.fingerprint(self._weight_targets)
        if self._prefix is not None and self._own is not None:  # old weights' KV is useless
            self._own.give(self._prefix.flush())

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the weights in host memory, by state_dict name (what ``load_weights``
        takes back): a placed worker keeps each job's this way (placement_follower.py)."""
        with torch.no_grad():
            return {name: t.detach().to("cpu", copy=True)
                    for name, t in self._weight_targets.items()}

    def load_safetensors(self, path: str | Path, version: int) -> None:
        self.load_weights(read_safetensors(path), version)

    # ---- scheduling ------------------------------------------------------------------------

    def _admit(self) -> list[torch.Tensor]:
        """Moves pending requests (FIFO) into free slots and prefills them in padded groups
        under the token budget; returns each group's last-token logits, in slot order."""
        self._open_budget()
        admitted: list[_Admitted] = []
        while self._pending and len(self._running) + len(admitted) < self._cache.max_slots \
                and self._reserve_next():
            admitted.append(self._pending.popitem(last=False)[1])
        self._last_step_prefill_tokens = sum(len(entry.known_tokens) - entry.prefilled
                                             for entry in admitted)
        return self._prefill_whole(admitted)

    def _prefill_whole(self, admitted: list[_Admitted]) -> list[torch.Tensor]:
        """Gives ``admitted`` the next slots and prefills their known tokens whole."""
        logits = []
        for group in self._prefill_groups(admitted):
            first_slot = len(self._running)
            for entry in group:
                self._occupy(entry)
                self._running.append(entry)
            logits.append(self._prefill(group, first_slot))
        return logits

    def _admit_chunked(self) -> list[torch.Tensor]:
        """Prefills at most ``prefill_chunk`` tokens: the next chunk of the request mid-prefill,
        then pending requests (FIFO) that fit whole in what is left, then the first that does not
        fit, partly. Returns the last-token logits of the requests whose prefill completed, in
        slot order (each is running now)."""
        self._open_budget()
        budget = self._prefill_chunk
        logits: list[torch.Tensor] = []
        if self._partial is not None:
            budget -= self._prefill_partial(budget, logits)
        whole: list[_Admitted] = []
        longer: _Admitted | None = None  # the first that does not fit whole in what is left
        # Reserved before it is measured: a prefix-cache hit prefills only past its cached
        # prefix (``entry.prefilled``), which the reservation finds.
        while (budget and self._pending and len(whole) < self._cache.free_slots
               and self._reserve_next()):
            entry = self._pending.popitem(last=False)[1]
            rest = len(entry.known_tokens) - entry.prefilled
            if rest > budget:
                longer = entry
                break
            whole.append(entry)
            budget -= rest
        logits.extend(self._prefill_whole(whole))
        # Budget left means no request is mid-prefill now, so the new partial takes the slot
        # right after the running ones (``whole`` left it free: it stopped below free_slots).
        if longer is not None:
            self._begin_partial(longer)
            budget -= self._prefill_partial(budget, logits)
        self._last_step_prefill_tokens = self._prefill_chunk - budget
        return logits

    def _begin_partial(self, entry: _Admitted) -> None:
        self._occupy(entry)
        self._partial = entry

    def _occupy(self, entry: _Admitted) -> None:
        """Gives ``entry`` the next free slot, with its sampling state and admission order."""
        slot = self._cache.acquire()
        self._bind(slot, entry, len(entry.known_tokens))
        self._slot_of[entry.request.request_id] = slot
        self._slot_sampling.set(slot, entry)
        self._admissions += 1
        entry.seq = self._admissions
        # What a request computed may go back to the prefix cache only under the weights it was
        # admitted with: a load may keep the version number and change the weights (a placed
        # worker switching jobs, a LoadWeights of the current version), and every load flushes
        # the cache into a new generation, so the generation names the weights.
        entry.kv_generation = self._prefix.generation if self._prefix is not None else 0

    def _prefill_partial(self, budget: int, logits: list[torch.Tensor]) -> int:
        """Prefills the partial request's next chunk (at most ``budget`` tokens); if that was its
        last, appends its logits and moves it into the running batch. Returns the tokens run."""
        entry = self._partial
        assert entry is not None
        start = entry.prefilled
        chunk = entry.known_tokens[start:start + budget]
        out = self._forward.prefill_from(torch.tensor(chunk, device=self._device), self._cache,
                                         len(self._running), start)
        entry.prefilled += len(chunk)
        if entry.prefilled == len(entry.known_tokens):
            self._running.append(entry)  # its slot is len(running) before the append
            self._partial = None
            logits.append(out)
        return len(chunk)

    def _drop_partial(self) -> None:
        assert self._partial is not None
        del self._slot_of[self._partial.request.request_id]
        self._give_back(self._partial, self._partial.prefilled)
        self._cache.release(len(self._running))  # the last occupied slot: nothing moves
        self._partial = None

    def _prefill_groups(self, admitted: list[_Admitted]) -> list[list[_Admitted]]:
        """Padded groups under the token budget; a prefix-cache hit is a group of its own (it
        prefills from the end of its cached prefix, attending to the cached pages)."""
        groups: list[list[_Admitted]] = []
        longest = 0
        for entry in admitted:
            length = len(entry.known_tokens)
            padded = (len(groups[-1]) + 1) * max(longest, length) if groups else 0
            if groups and padded <= self._prefill_token_budget and not entry.prefilled \
                    and not groups[-1][0].prefilled:
                groups[-1].append(entry)
                longest = max(longest, length)
            else:  # a request longer than the budget still gets a group of its own
                groups.append([entry])
                longest = length
        return groups

    def _prefill(self, group: list[_Admitted], first_slot: int) -> torch.Tensor:
        if group[0].prefilled:  # a prefix-cache hit (``_prefill_groups``: alone in its group)
            entry = group[0]
            rest = torch.tensor(entry.known_tokens[entry.prefilled:], device=self._device)
            return self._forward.prefill_from(rest, self._cache, first_slot, entry.prefilled)
        lengths = [len(entry.known_tokens) for entry in group]
        padded = torch.zeros(len(group), max(lengths), dtype=torch.int64)
        for row, entry in enumerate(group):
            padded[row, :lengths[row]] = torch.tensor(entry.known_tokens)
        return self._forward.prefill(padded.to(self._device), lengths, self._cache, first_slot)

    def _emit(self, tokens: list[int], logprobs: list[float]) -> list[RequestOutput]:
        outputs, finished = [], []
        for slot, (entry, token, logprob) in enumerate(zip(self._running, tokens, logprobs)):
            entry.generated += 1
            entry.emitted.append(token)  # what a preemption must prefill again
            # A stop token is part of the completion (the trainer scores and trains on it).
            if token in entry.stop_ids:
                reason = "stop"
            elif entry.generated >= entry.request.sampling.max_tokens:
                reason = "length"
            else:
                reason = ""
            if reason:
                finished.append(slot)
            outputs.append(RequestOutput(entry.request.request_id, [token], [logprob],
                                         finished=bool(reason), finish_reason=reason))
        for slot in reversed(finished):  # highest first: a release only moves unfinished slots
            self._release(slot)
        return outputs

    def _release(self, slot: int) -> None:
        """Frees running ``slot``, keeping the running requests in slots [0, len(running)) and
        the partial one right after them (see the class docstring)."""
        del self._slot_of[self._running[slot].request.request_id]
        self._give_back(self._running[slot], self._cache.host_lengths[slot])
        last = len(self._running) - 1
        if slot != last:  # the last running request fills the hole
            self._move_slot(last, slot)
            self._running[slot] = self._running[last]
            self._slot_of[self._running[slot].request.request_id] = slot
        self._running.pop()
        if self._partial is not None:  # it moves down one, out of the shrunk decode slice
            self._move_slot(last + 1, last)
            self._slot_of[self._partial.request.request_id] = last
            last += 1
        self._cache.release(last)  # the last occupied slot now: nothing moves

    # ---- KV budget (``kv_budget_tokens``): preemption by recomputation -------------------------

    def _executing(self) -> list[_Admitted]:
        return self._running + ([self._partial] if self._partial is not None else [])

    def _held_after_decode(self, entry: _Admitted, grow: int) -> int:
        """KV tokens ``entry`` holds once it has decoded once more; ``grow`` = 1 counts the token
        this step is sampling (admission runs before it is emitted). A request mid-prefill counts
        whole (its known tokens + the token its first decode writes): it was admitted for all."""
        if entry is self._partial:
            return len(entry.known_tokens) + 1
        return len(entry.known_tokens) + len(entry.emitted) + grow

    def _open_budget(self) -> None:
        """Before a step admits: reserves the next decode of every executing request, so a
        request admitted now is not preempted by the very next step."""
        if self._kv_budget:
            self._budget_left = self._kv_budget - sum(
                self._held_after_decode(entry, grow=1) for entry in self._executing())

    def _take_budget(self, entry: _Admitted) -> bool:
        need = len(entry.known_tokens) + 1  # its prefill, then the token its first decode writes
        if need > self._budget_left:
            return False  # FIFO: it waits at the head, later requests wait behind it
        self._budget_left -= need
        return True

    def _preempt_over_budget(self) -> None:
        """Before a decode: while it would take the executing requests past the budget, the
        newest admitted one is preempted. The oldest always fits (``check_kv_budget``)."""
        if not self._kv_budget:
            return
        held = sum(self._held_after_decode(entry, grow=0) for entry in self._executing())
        while held > self._kv_budget:
            victim = max(self._executing(), key=lambda entry: entry.seq)
            held -= self._held_after_decode(victim, grow=0)
            self._preempt(victim)

    def _preempt(self, entry: _Admitted) -> None:
        """Frees ``entry``'s slot and queues it first, as a resume of everything it generated,
        so prefill recomputes its KV and sampling continues at the same (seed, position)."""
        rid = entry.request.request_id
        if entry is self._partial:
            self._drop_partial()
        else:
            self._release(self._slot_of[rid])
        generated = list(entry.request.generated_token_ids) + entry.emitted
        self._pending[rid] = _admission(replace(entry.request, generated_token_ids=generated))
        self._pending.move_to_end(rid, last=False)
        self.preemptions += 1

    # ---- paged KV (``paged``): which pages a slot's KV lives in --------------------------------

    def _reserve_next(self) -> bool:
        """Whether the first pending request may start: with paged KV, its pages for the whole
        request (prompt + what it may still generate) are reserved now, or it waits; with a KV
        budget, what it holds after its first decode is taken from the budget, or it waits."""
        entry = next(iter(self._pending.values()))
        if self._kv_budget:
            return self._take_budget(entry)
        if self._paged is None:
            return True
        left = entry.request.sampling.max_tokens - entry.generated
        tokens = len(entry.known_tokens) + left
        if self._prefix is not None:
            return self._reserve_with_prefix(entry, tokens)
        rid = entry.request.request_id
        if not self._paged.pages.reserve(rid, tokens):
            return False
        cached = self._paged.pages.cached_tokens(rid)  # a prefix the pool handed over
        if cached is not None:
            entry.prefilled = min(cached, len(entry.known_tokens) - 1)
            self.prefix_stats.count(entry.prefilled)
        return True

    def _reserve_with_prefix(self, entry: _Admitted, tokens: int) -> bool:
        """Reserves ``tokens`` tokens' pages, reading the longest cached prefix instead of
        owning it; when free pages are short, the cache gives back what it may evict."""
        prefix, own = self._prefix, self._own
        assert prefix is not None and own is not None
        keys, pages = prefix.match(entry.known_tokens, self._weight_version)
        prefix.acquire(keys)  # before eviction can take them
        short = math.ceil(tokens / own.page_tokens) - len(pages) - own.free_pages
        if short > 0:
            own.give(prefix.evict(short))
        if not own.reserve(entry.request.request_id, tokens, prefix=pages):
            own.give(prefix.release(keys))
            return False
        entry.prefix_keys = keys
        entry.prefilled = len(pages) * own.page_tokens
        self.prefix_stats.count(entry.prefilled)
        return True

    def _bind(self, slot: int, entry: _Admitted, tokens: int) -> None:
        if self._paged is not None:
            assert isinstance(self._cache, PagedKVCache)
            self._cache.bind(slot, self._paged.pages.table(entry.request.request_id, tokens))

    def _bind_growth(self) -> None:
        """Before a decode: every running slot has a page for the token it writes."""
        if self._paged is None:
            return
        cache = self._cache
        assert isinstance(cache, PagedKVCache)
        for slot, entry in enumerate(self._running):
            need = cache.host_lengths[slot] + 1
            if need > cache.bound[slot] * cache.page_tokens:
                self._bind(slot, entry, need)

    def _give_back(self, entry: _Admitted, kv_tokens: int) -> None:
        """Frees ``entry``'s pages; with a prefix cache, first offers the full pages of its
        ``kv_tokens`` tokens that hold KV (prompt, then every generated token but the last)."""
        rid = entry.request.request_id
        if self._prefix is not None and self._own is not None:
            pages = self._own.held(rid)
            keep = set(pages[:len(entry.prefix_keys)])  # the cache's already
            if entry.kv_generation == self._prefix.generation:  # older weights' KV: no prefix
                tokens = (entry.known_tokens + entry.emitted)[:kv_tokens]
                keep |= self._prefix.insert(tokens, pages, self._weight_version)
            self._own.give(self._prefix.release(entry.prefix_keys))
            self._own.release(rid, keep)
        elif self._paged is not None:
            self._paged.pages.release(rid)

    def _move_slot(self, src: int, dst: int) -> None:
        self._cache.move(src, dst)
        self._slot_sampling.move(src, dst)

    # ---- weights ---------------------------------------------------------------------------

    def _state_dict_targets(self) -> dict[str, torch.Tensor]:
        """state_dict name -> the live tensor it names (tied weights map to one tensor)."""
        live: dict[str, torch.Tensor] = dict(self._model.named_parameters(remove_duplicate=False))
        live.update(self._model.named_buffers(remove_duplicate=False))
        return {name: live[name] for name in self._model.state_dict()}



# ---- weight loads, every engine's ----------------------------------------------------------


def check_weights(tensors: Mapping[str, torch.Tensor], version: int,
                  targets: Mapping[str, torch.Tensor]) -> None:
    """Raises EngineInputError naming what is wrong with loading ``tensors`` (any subset of
    ``targets``, the model's weights by state_dict name) as ``version``; every engine checks a
    load with it before changing anything."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise EngineInputError(f"weight version must be an int >= 0, got {version!r}")
    problems = [p for name, value in tensors.items()
                if (p := _weight_problem(name, value, targets.get(name)))]
    if problems:
        shown = "; ".join(problems[:5])
        if len(problems) > 5:
            shown += f"; and {len(problems) - 5} more"
        raise EngineInputError(f"refusing weights for version {version} (nothing was loaded): "
                               f"{shown}")


def _weight_problem(name: str, value: object, target: torch.Tensor | None) -> str:
    if target is None:
        return f"unknown tensor name {name!r} (names follow the model's state_dict)"
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return f"{name}: expected a floating-point tensor, got {type(value).__name__}"
    if value.shape != target.shape:
        return f"{name}: shape {tuple(value.shape)} != expected {tuple(target.shape)}"
    if not torch.isfinite(value).all():
        return f"{name}: contains NaN or inf"
    return ""


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; EngineInputError when it cannot be read as one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise EngineInputError(f"cannot read weights from {str(path)!r}: {exc}") from exc
