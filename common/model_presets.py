"""The built-in model presets' shapes: plain data, importable without torch (the CLI's help
text names them; ``tiny_model.py`` builds them)."""

from __future__ import annotations

# name -> Qwen3Config overrides. "tiny" learns the built-in tasks on 2 CPU cores in minutes.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32),
}
