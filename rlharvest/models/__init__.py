"""The models every side loads: presets and their seeded weights, the decoder's parameters,
local Hugging Face checkpoints (built and read), the built-in tokenizers and a checkpoint's own.
The infrastructure the services share lives in ``rlharvest.common``."""
