"""Where gradients accumulate and the optimizer steps: DeepSpeed, or plain torch for fast tests.

Both backends give ``StreamingStep`` the same four moves: forward, backward (accumulate, never
step), rescale the accumulated gradients, and one optimizer step. DeepSpeed runs with
``managed_gradient_accumulation: false`` so that *we* own the accumulation boundary: backward
only accumulates, ``engine.step()`` reduces and updates once (DeepSpeed 0.19 engine.py), and
``scale_wrt_gas=False`` keeps it from dividing losses that already carry the step's denominator.

With N data-parallel ranks (``ranks.py``) every rank's loss already carries the step's global
denominator, so the update needs the *sum* of the ranks' gradients. ZeRO 1-3 average them (divide
by N), so their rescale folds in a factor N; at stage 0 we reduce ourselves (one flat all-reduce,
a sum) and switch DeepSpeed's own off, which also lets the reported norm be the global one.

``save``/``load`` write and read this rank's part of a checkpoint: the whole model and optimizer
for plain torch, a DeepSpeed checkpoint (every rank's ZeRO partition) for DeepSpeed.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from rlharvest.services.trainer.device import (
    module_device,
    pin_deepspeed_accelerator,
    skip_uncompilable_shm_op,
)
from rlharvest.services.transfer_agent.flat_shards import flat_shard, flat_shards

log = logging.getLogger(__name__)

BackendName = Literal["torch", "deepspeed"]
_TORCH_FILE = "weights.pt"
_DS_TAG = "deepspeed"  # the one tag under a checkpoint directory's deepspeed/ folder


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    optimizer: Literal["adamw", "sgd"] = "adamw"  # sgd: exact-update tests (Adam amplifies ulps)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    zero_stage: int = 0  # DeepSpeed only; 0-3 (3 partitions the parameters themselves)
    # ZeRO-3 keeps parameters smaller than this whole on every rank (DeepSpeed's default);
    # tests set 0 so a tiny model is really partitioned.
    zero3_persistence_threshold: int = 100_000


class TrainBackend(Protocol):
    @property
    def module(self) -> torch.nn.Module:
        """The model to call for forward passes (a DeepSpeed engine is itself a module)."""

    @property
    def model(self) -> torch.nn.Module:
        """The bare model: weights to publish and checkpoint."""

    @property
    def optimizer(self) -> Any: ...

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate d(loss)/d(params) into the pending gradients; never steps."""

    def step(self, grad_scale: float = 1.0) -> float:
        """Multiply the pending gradients by ``grad_scale``, clip, update once, zero them.
        Returns the global gradient norm before clipping (after the rescale)."""

    def save(self, path: Path) -> None:
        """Write this rank's weights and optimizer state under the directory ``path``."""

    def load(self, path: Path) -> None:
        """Read back what ``save`` wrote, in place."""

    def weights(self, keep: bool = True, where: Where | None = None) -> dict[str, torch.Tensor]:
        """A detached copy of the whole model's weights: what a version IS, independent of later
        updates; on the CPU, or ``where`` says. Collective under ZeRO-3 (every rank must call
        it); ``keep=False``: join the gather, copy nothing (a follower rank), return {}."""

    @property
    def weights_are_sharded(self) -> bool:
        """Whether ``weights`` needs every rank (ZeRO-3) or rank 0 holds them all."""

    def weights_shard(self, rank: int, size: int, dtype: torch.dtype | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
        """Rank ``rank`` of ``size``'s flat slice of every tensor ``weights`` would give (copies;
        transfer_agent/flat_shards.py) and the whole tensors' shapes; floating tensors in
        ``dtype`` (the serving dtype; None: the model's). Never collective: under ZeRO-3 it is
        the partition this rank holds, so only this rank's own (rank, size)."""


@dataclass(frozen=True)
class Where:
    """Where a copy of the weights goes: a device, and the dtype its floating tensors take
    there (None: the model's). A GPU trainer that publishes deltas keeps its copy on the GPU
    in the serving dtype: the delta is found and encoded there (delta_publish.LastPublished)
    and a bf16 copy costs half the fp32 model's memory, not all of it."""

    device: torch.device | str = "cpu"
    dtype: torch.dtype | None = None


def served_as(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` is published in: ``dtype`` for a floating tensor (None: its own)."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def snapshot(model: torch.nn.Module, where: Where | None = None) -> dict[str, torch.Tensor]:
    where = where or Where()
    return {name: t.detach().to(where.device, dtype=served_as(t, where.dtype),
                                copy=True).contiguous()
            for name, t in model.state_dict().items()}


def _replicated_shard(model: torch.nn.Module, rank: int, size: int, dtype: torch.dtype | None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """Every rank holds the whole model (no ZeRO-3): rank ``rank``'s slices of it."""
    state = model.state_dict()
    return (flat_shards(state, rank, size, dtype),
            {name: tuple(t.shape) for name, t in state.items()})


def _make_optimizer(params: Any, config: OptimConfig) -> torch.optim.Optimizer:
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, betas=config.betas,
                                 weight_decay=config.weight_decay)
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {config.optimizer!r}")


class TorchBackend:
    """Plain torch: the reference the DeepSpeed path is tested against, and the fast unit path."""

    def __init__(self, model: torch.nn.Module, config: OptimConfig) -> None:
        self._model = model.train()
        self._config = config
        self._optimizer = _make_optimizer(model.parameters(), config)

    @property
    def module(self) -> torch.nn.Module:
        return self._model

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, grad_scale: float = 1.0) -> float:
        grads = [p.grad for p in self._model.parameters() if p.grad is not None]
        if grad_scale != 1.0:
            torch._foreach_mul_(grads, grad_scale)
        params = [p for p in self._model.parameters() if p.grad is not None]
        max_norm = self._config.grad_clip if self._config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def save(self, path: Path) -> None:
        with open(path / _TORCH_FILE, "wb") as f:
            torch.save({"model": self._model.state_dict(),
                        "optimizer": self._optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, path: Path) -> None:
        file = path / _TORCH_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist: not a checkpoint of the torch backend")
        payload = torch.load(file, map_location="cpu", weights_only=True)
        self._model.load_state_dict(payload["model"])
        self._optimizer.load_state_dict(payload["optimizer"])

    def weights(self, keep: bool = True, where: Where | None = None) -> dict[str, torch.Tensor]:
        return snapshot(self._model, where) if keep else {}

    @property
    def weights_are_sharded(self) -> bool:
        return False

    def weights_shard(self, rank: int, size: int, dtype: torch.dtype | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
        return _replicated_shard(self._model, rank, size, dtype)


def _grad_norm(model: torch.nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def _fsync_tree(root: Path) -> None:
    """DeepSpeed writes without fsync; the checkpoint is only complete once it is on disk."""
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(file, "rb") as f:
            os.fsync(f.fileno())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_single_process_dist_env() -> None:
    """A lone trainer (world size 1) needs the torch.distributed rendezvous variables too.
    Only sets what is absent, so a real launcher's values always win."""
    defaults = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())


def _init_restarted_group(backend: str) -> bool:
    """Join a torchrun group through the agent's store with keys scoped to this restart.

    Why: torchrun hands a restarted group the agent's store with the previous attempt's keys
    still in it, so gloo dials the dead ranks' listening ports and the new group never forms
    (seen with torch 2.13 ``--max-restarts``). Returns False when not under torchrun's agent
    store; the caller then initialises the usual way."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return False
    agent = torch.distributed.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                                       is_master=False, timeout=timedelta(minutes=10))
    store = torch.distributed.PrefixStore(
        f"rlharvest/attempt-{env['TORCHELASTIC_RESTART_COUNT']}", agent)
    torch.distributed.init_process_group(backend, store=store, rank=int(env["RANK"]),
                                         world_size=int(env["WORLD_SIZE"]))
    return True


class DeepSpeedBackend:
    def __init__(self, model: torch.nn.Module, config: OptimConfig) -> None:
        if config.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {config.zero_stage}")
        ensure_single_process_dist_env()
        device = module_device(model)
        pin_deepspeed_accelerator(device)  # else on a GPU node it moves a CPU model to a GPU
        import deepspeed  # late: importing it probes accelerators and costs ~1 s

        if device.type == "cpu" and skip_uncompilable_shm_op(int(os.environ["WORLD_SIZE"])):
            log.info("DeepSpeed's shared-memory all-reduce op is not built, and a lone trainer "
                     "or a machine without a compiler does without it: DeepSpeed uses gloo")
        if not torch.distributed.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            if not _init_restarted_group(backend):
                deepspeed.init_distributed(dist_backend=backend)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            # We own the accumulation boundary: backward accumulates, step() reduces + updates.
            "managed_gradient_accumulation": False,
            "gradient_clipping": config.grad_clip,
            "zero_optimization": {"stage": config.zero_stage} if config.zero_stage < 3 else {
                "stage": 3,
                "stage3_param_persistence_threshold": config.zero3_persistence_threshold},
            "zero_allow_untested_optimizer": True,  # our torch AdamW/SGD under ZeRO
            "steps_per_print": 2**31 - 1,
        }
        optimizer = _make_optimizer(model.parameters(), config)
        self._model = model.train()
        self._engine, self._optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config)
        self._zero = config.zero_stage > 0
        self._stage = config.zero_stage
        self._world = torch.distributed.get_world_size()
        if not self._zero and self._world > 1:
            self._engine.enable_backward_allreduce = False  # step() reduces: a sum, see above

    @property
    def module(self) -> torch.nn.Module:
        return self._engine

    @property
    def model(self) -> torch.nn.Module:
        return self._engine.module

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    def backward(self, loss: torch.Tensor) -> None:
        # scale_wrt_gas=False: the loss already carries the whole step's denominator.
        self._engine.backward(loss, scale_wrt_gas=False)

    def step(self, grad_scale: float = 1.0) -> float:
        if not self._zero and self._world > 1:
            self._all_reduce_sum()
        if self._zero:
            grad_scale *= self._world  # ZeRO averages over the ranks; we want the sum
        if grad_scale != 1.0:
            self._rescale(grad_scale)
        # Stage 0 clips param.grad in place and records no norm, so take it before the step.
        norm = None if self._zero else _grad_norm(self._engine.module)
        try:
            self._engine.step()
        finally:
            if self._zero:
                self._optimizer.loss_scale = 1.0
        if norm is None:
            norm = self._engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def _all_reduce_sum(self) -> None:
        params = [p for p in self._engine.module.parameters() if p.requires_grad]
        for p in params:  # a rank whose share touched no parameter still joins the sum
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        torch.distributed.all_reduce(flat)
        for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    def save(self, path: Path) -> None:
        self._engine.save_checkpoint(str(path / _DS_TAG), tag=_DS_TAG, save_latest=False)
        _fsync_tree(path / _DS_TAG)

    def load(self, path: Path) -> None:
        folder = path / _DS_TAG / _DS_TAG
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} does not exist: not a checkpoint of the deepspeed "
                                    "backend")
        loaded, _ = self._engine.load_checkpoint(str(path / _DS_TAG), tag=_DS_TAG,
                                                 load_optimizer_states=True,
                                                 load_lr_scheduler_states=False)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {folder}")

    @property
    def weights_are_sharded(self) -> bool:
        return self._stage == 3

    def weights(self, keep: bool = True, where: Where | None = None) -> dict[str, torch.Tensor]:
        if self._stage < 3:  # every rank holds every parameter
            return snapshot(self._engine.module, where) if keep else {}
        import deepspeed

        # ZeRO-3: each rank holds a slice; gather them all (on every rank: a collective), copy,
        # and let the context re-partition. Buffers are never partitioned.
        with deepspeed.zero.GatheredParameters(list(self._engine.module.parameters()),
                                               modifier_rank=None):
            return snapshot(self._engine.module, where) if keep else {}

    def weights_shard(self, rank: int, size: int, dtype: torch.dtype | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
        if self._stage < 3:
            return _replicated_shard(self._engine.module, rank, size, dtype)
        if (rank, size) != (torch.distributed.get_rank(), self._world):
            raise ValueError(f"under ZeRO-3 rank {torch.distributed.get_rank()} of {self._world} "
                             f"holds only its own partition, not rank {rank} of {size}'s")
        # A partitioned parameter's ds_tensor is exactly its flat_shards slice (DeepSpeed pads
        # numel up to a multiple of the world size and gives rank r the r-th run): copy it. Tied
        # names share one parameter; buffers are never partitioned, so they are sliced here.
        params = dict(self._engine.module.named_parameters(remove_duplicate=False))
        shard, shapes = {}, {}
        for name, value in self._engine.module.state_dict().items():
            param = params.get(name)
            if param is not None and hasattr(param, "ds_tensor"):
                part = param.ds_tensor.detach()
                shard[name] = part.to("cpu", dtype=served_as(part, dtype), copy=True).reshape(-1)
                shapes[name] = tuple(param.ds_shape)
            else:
                shard[name] = flat_shard(value, rank, size, served_as(value, dtype))
                shapes[name] = tuple(value.shape)
        return shard, shapes

    def _rescale(self, grad_scale: float) -> None:
        if self._zero:
            # ZeRO 1-3 keep gradients in partitioned flat buffers that no public API reaches
            # before step() in unmanaged mode; the optimizer divides them by its (fp32: static,
            # 1.0) loss scale inside step() before clipping, so a loss scale of 1/grad_scale
            # applies exactly our rescale — and the clip sees the rescaled norm.
            self._optimizer.loss_scale = 1.0 / grad_scale
            return
        grads = [p.grad for p in self._engine.module.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, grad_scale)


def make_backend(name: BackendName, model: torch.nn.Module, config: OptimConfig) -> TrainBackend:
    if name == "torch":
        return TorchBackend(model, config)
    if name == "deepspeed":
        return DeepSpeedBackend(model, config)
    raise ValueError(f"backend must be 'torch' or 'deepspeed', got {name!r}")
