"""The worker core: the parts a service composes to serve the ``RolloutWorker`` contract.

- ``engine``: the engine interface the parts drive (add, abort, step, load, load weights).
- ``session_hub``: the manager sessions and the requests each owns — ordering, the
  never-dropping outbox (``outbox``), backpressure, drain, command errors. No engine.
- ``engine_pump``: the pipelined step loop: step N+1 computes in the engine thread while step
  N's outputs are encoded and sent; engine mutations run between steps; each step is measured.
- ``admission``: the interface of an admission policy (pure): whether an add is taken and what
  a weight swap does to the requests held.
- ``session_commands``: a Session's commands (add, abort), a closed session's requests and a
  weight swap, carried out through the hub, the policy and the step loop.

The rollout worker composes them with its own policy (``rlharvest/services/rollout_worker/``); the serving
co-executor brings its own admission and may bring its own step loop.
"""
