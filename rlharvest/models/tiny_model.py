"""Tiny models of a real architecture (Qwen3), built from a config with a seeded init.

Tests, the demo and CPU runs use these; GPU nodes pass a local checkpoint path instead and go
through the same loading code. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from rlharvest.models.decoder_weights import preset_config_dict, preset_state
from rlharvest.models.model_presets import PRESETS


def tiny_config(preset: str = "tiny") -> Qwen3Config:
    """A preset's config for transformers: the same dict ``decoder_weights`` builds from."""
    # attn_implementation is taken by every supported transformers (>=4.51); v5's typed
    # Qwen3Config signature omits it (it goes through **kwargs), so mypy cannot see it.
    return Qwen3Config(**preset_config_dict(preset), attn_implementation="sdpa")  # type: ignore[call-arg]


def build_model(model: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A preset name builds a seeded random init; anything else is a local checkpoint directory."""
    if model in PRESETS:
        # The values are preset_state's, the rollout engine's too (it never builds this module);
        # transformers' own init still runs, so it runs on a forked RNG.
        with torch.random.fork_rng(devices=[]):
            net = AutoModelForCausalLM.from_config(tiny_config(model), dtype=dtype)
        net.load_state_dict(preset_state(model, seed, dtype))
        return net.eval()
    path = Path(model)
    if not path.is_dir():
        raise ValueError(
            f"model {model!r} is neither a preset ({sorted(PRESETS)}) nor a local checkpoint "
            "directory; rlharvest never downloads weights"
        )
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    net = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, local_files_only=True)
    return net.eval()
