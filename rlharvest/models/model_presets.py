"""The built-in model presets' shapes: plain data, importable without torch (the CLI's help
text names them; ``tiny_model.py`` builds them)."""

from __future__ import annotations

# name -> Qwen3Config overrides. "tiny" learns the built-in tasks on 2 CPU cores in minutes.
# "qwen3-0.6b" and "qwen3-8b" are the released models' shapes (vocabulary included) with seeded
# random weights, for GPU benchmarks that must download nothing; on the built-in tokenizer their
# ids past its 128 decode to nothing, which costs a benchmark nothing.
_QWEN3 = dict(vocab_size=151936, num_key_value_heads=8, head_dim=128,
              max_position_embeddings=40960, rope_theta=1000000.0)
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False),
}
