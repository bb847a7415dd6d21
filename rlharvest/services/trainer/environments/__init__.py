"""Environments for agentic (multi-turn) rollout: the interface a user's environment implements,
the built-in text FrozenLake, and the runner that plays one trajectory through the rollout
manager turn by turn."""
