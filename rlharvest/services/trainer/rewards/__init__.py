"""Reward computation next to rollout: verifiers, a code sandbox, RollPacker's adaptive timeout
(§4.3) and the bounded async pool that runs them."""
