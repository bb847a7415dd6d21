"""Where the trainer's model trains: the CPU, or each rank's own GPU.

``--device cuda`` puts rank r's model on ``cuda:LOCAL_RANK`` (torchrun numbers a node's ranks
from 0, one GPU each, as DeepSpeed and veRL expect). Every tensor a step builds (token ids,
masks, old logprobs, advantages) is made where the model is (``module_device``), so the loss
code never names a device. DeepSpeed picks its accelerator once per process, and on a node
with GPUs it would move a CPU trainer's model to one: ``pin_deepspeed_accelerator`` makes it
follow this setting instead, before DeepSpeed is first imported.
"""

from __future__ import annotations

import os
import shutil

import torch

from rlharvest.common.engine_device import resolve


def published_dtype(name: str) -> torch.dtype | None:
    """``--publish-dtype`` as a torch dtype: the one floating weights are cast to before they
    are published; None (as they are) with ``model``."""
    return None if name == "model" else getattr(torch, name)


def served_dtype(name: str) -> torch.dtype:
    """The dtype the workers serve in, for the trainer's own engines (seed role, placement
    profile): ``--publish-dtype``'s, or the model's own (fp32) with ``model``."""
    return published_dtype(name) or torch.float32


def rank_device(name: str) -> torch.device:
    """This rank's device for ``--device name`` ("cpu" or "cuda"); ValueError when this
    machine cannot give it (no CUDA, or fewer GPUs than the node's ranks)."""
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {name!r}")
    # LOCAL_RANK names the GPU, as DeepSpeed takes it (engine.py, _set_distributed_vars): a
    # launcher that shows each rank only its own GPU must number them all 0.
    local = int(os.environ.get("LOCAL_RANK", "0"))
    where, _ = resolve(f"cuda:{local}", "float32")
    torch.cuda.set_device(where)  # NCCL and DeepSpeed use the current device as this rank's
    return where


def module_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: a DeepSpeed engine says so itself; a plain module, where its
    first parameter lives (the CPU for one without parameters)."""
    device = getattr(module, "device", None)
    if isinstance(device, torch.device):
        return device
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU): wall-clock timings of GPU work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pin_deepspeed_accelerator(device: torch.device) -> None:
    """Make DeepSpeed's accelerator this trainer's device type (``DS_ACCELERATOR``), or say
    why it cannot be: DeepSpeed moves the model to its accelerator at ``initialize``, and one
    chosen earlier in this process (it caches its choice) would put it elsewhere."""
    wanted = "cuda" if device.type == "cuda" else "cpu"
    os.environ["DS_ACCELERATOR"] = wanted
    from deepspeed.accelerator import get_accelerator

    chosen = get_accelerator().device_name()
    if chosen != wanted:
        raise RuntimeError(f"DeepSpeed already chose the {chosen!r} accelerator in this process; "
                           f"the trainer trains on {device} (--device): start it in a process "
                           "of its own")



def skip_uncompilable_shm_op(world_size: int) -> bool:
    """On the CPU, DeepSpeed's communication backend loads its shared-memory all-reduce op
    (``deepspeed_shm_comm``) when ``deepspeed.initialize`` starts, compiling it there and then
    unless the installed wheel carries it built. A lone trainer (``world_size`` 1) reduces
    nothing, and compiling costs minutes; where it cannot be compiled (no C++ compiler or no
    ninja: the container image carries neither) it would stop the trainer. In both cases mark the
    op unavailable, and DeepSpeed all-reduces through torch.distributed (gloo), as it does on a
    platform without the op. Call before the first ``deepspeed.initialize``; True when the op
    was marked unavailable."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import is_ninja_available

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or installed_ops.get(builder.NAME, False):
        return False
    compilable = shutil.which(os.environ.get("CXX", "c++")) and is_ninja_available()
    if world_size > 1 and compilable:
        return False
    # DeepSpeed keeps this probe's result in one dict per process and asks it before loading
    # the op (deepspeed/comm/torch.py, build_shm_op): False there is its "not on this platform".
    deepspeed.ops.__compatible_ops__[builder.NAME] = False
    return True
