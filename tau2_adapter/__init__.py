"""The τ²-Bench adapter: the one layer between SinkFlex-RL and the `tau2` package.

- `tau2_adapter.tasks`: task sets in τ²-Bench's own format (`tasks.json` +
  `split_tasks.json`), merged with the tasks τ²-Bench ships (`domain_tasks`).
- `tau2_adapter.generate`: a generator of mock-domain tasks with held-out test content.
- `tau2_adapter.convert`: wire messages (`common_pb2.Message`) <-> tau2 messages, the one
  conversion the env service (its trajectories) and the reward service (what tau2's
  evaluator scores) share.
- `tau2_adapter.termination`: tau2's termination reasons <-> the wire's.
- `tau2_adapter.guards`: bounds on tau2 tools a model's arguments could keep computing for
  hours (retail's and airline's `calculate`), installed by the env and reward services alike.

Imports only the foundation (`sinkflex`) and `tau2`; never a service or the driver
(docs/architecture.md).
"""
