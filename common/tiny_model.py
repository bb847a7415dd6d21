"""Tiny models of a real architecture (Qwen3), built from a config with a seeded init.

Tests, the demo and CPU runs use these; GPU nodes pass a local checkpoint path instead and go
through the same loading code. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from rlharvest.common.model_presets import PRESETS
from rlharvest.common.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE





def tiny_config(preset: str = "tiny", max_position_embeddings: int = 1024) -> Qwen3Config:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    # rope_theta and attn_implementation are taken by every supported transformers (>=4.51); v5's
    # typed Qwen3Config signature omits them (they go through **kwargs), so mypy cannot see them.
    return Qwen3Config(  # type: ignore[call-arg]
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attn_implementation="sdpa",
        **PRESETS[preset],
    )


def model_config(model: str):
    """The configuration of a preset or a local checkpoint directory, without building it."""
    if model in PRESETS:
        return tiny_config(model)
    if not Path(model).is_dir():
        raise ValueError(f"model {model!r} is neither a preset ({sorted(PRESETS)}) nor a local "
                         "checkpoint directory; rlharvest never downloads weights")
    return AutoConfig.from_pretrained(Path(model), local_files_only=True)


def build_model(model: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A preset name builds a seeded random init; anything else is a local checkpoint directory."""
    if model in PRESETS:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = AutoModelForCausalLM.from_config(tiny_config(model), dtype=dtype)
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
