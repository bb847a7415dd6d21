"""Where an engine's weights and KV cache live: the ``device`` and ``dtype`` settings of every
service that hosts a TorchEngine (rollout worker, co-executor), and their check at start.

Importable without torch (configs are read by the CLI's help); ``resolve`` imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from rlharvest.common.config import ServiceConfig

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")


class EngineDeviceConfig(ServiceConfig):
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$", description="where the "
                        "engine's weights and KV cache live: cpu, cuda or cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the engine's weight and KV dtype (bfloat16 halves the memory "
        "of a GPU model; sampling and logprobs are computed in float32 either way)")
    held_weights: Literal["host", "device"] = Field(
        "host", description="where the copy of the pulled weights lives that deltas apply to: "
        "host memory, or the engine's device (one more copy of the model in device memory; a "
        "sparse delta then applies there at device speed and a load is a device-to-device "
        "copy, bench/transfer_delta.py --worker-device)")

    @property
    def held_device(self) -> str:
        """Where the puller keeps the pulled weights (``held_weights``)."""
        return self.device if self.held_weights == "device" else "cpu"

    @model_validator(mode="after")
    def _device_present(self) -> EngineDeviceConfig:
        # Checked with the config, so a GPU flag on a machine without one exits 2 at once
        # instead of after the service has joined etcd. Only a GPU device imports torch here.
        if self.device != "cpu":
            resolve(self.device, self.dtype)
        return self


def resolve(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """The torch device and dtype, or ValueError saying why this machine cannot run them."""
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    where = torch.device(device)
    if where.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA "
                             "device; use --device cpu")
        index = where.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA "
                             "device(s) here")
    return where, getattr(torch, dtype)
