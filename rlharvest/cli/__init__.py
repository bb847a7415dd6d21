"""The local tooling: the `rlharvest` command (`up`, `train`, `status`, `build-checkpoint`), the
launcher of local service processes (which the tests use too), the demos behind `make run`, the
chaos soak, the load generator and the Prometheus stack of `up --prometheus`. None of the
services imports this package."""
