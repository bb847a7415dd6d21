"""rlharvest: on-policy RL post-training of LLMs on GPU capacity that would otherwise sit idle.

The subpackages are the repository's top-level folders (``common/``, ``services/``, ``sim/``),
linked here so that ``rlharvest.*`` resolves statically from a checkout: the type checker, an IDE
and ``python -m rlharvest...`` run from the repository root all read this checkout, with no
install hook. See docs/architecture.md.
"""
