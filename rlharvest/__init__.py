"""rlharvest: on-policy RL post-training of LLMs on GPU capacity that would otherwise sit idle.

The code lives here: ``common/`` (infrastructure and models every service shares),
``services/`` (the six services and the local tooling) and ``sim/`` (the simulators). Run from a
checkout's root, ``rlharvest.*`` is this checkout, with no install hook. See
docs/architecture.md.
"""
