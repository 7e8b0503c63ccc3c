"""The reward service: tau2-Bench's programmatic checker behind gRPC.

- `reward_service.scoring` — the core: a trajectory (wire messages + termination reason)
  scored by tau2's `evaluate_simulation`, returned as a per-check `RewardBreakdown`.
- `reward_service.server` — the gRPC servicer and server; `python -m reward_service`.
- `reward_service.client` — `RewardClient` with `LocalRewardClient` / `GrpcRewardClient`.
- `reward_service.config` — `RewardServiceConfig`, `JudgeConfig`.
"""
