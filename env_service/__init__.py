"""env_service: tau2-Bench domains behind a Gymnasium interface, served over gRPC.

Modules: `convert` (wire <-> tau2 messages), `config` (EnvServiceConfig), `catalog`
(domains, tasks, splits), `session` (one episode driven step by step through tau2's
Orchestrator), `core` (sessions: ids, TTL, limits), `server` (gRPC servicer),
`client` (EnvClient: in-process and gRPC), `gym_env` (Gymnasium envs).
"""

import gymnasium as _gym

#: Gymnasium ids: `gym.make(TAU2_ENV_ID, env="retail")` (in-process) and
#: `gym.make(REMOTE_TAU2_ENV_ID, address="host:port", env="retail")` (gRPC).
TAU2_ENV_ID = "SinkFlex/Tau2-v0"
REMOTE_TAU2_ENV_ID = "SinkFlex/RemoteTau2-v0"

for _id, _entry in ((TAU2_ENV_ID, "env_service.gym_env:Tau2Env"), (REMOTE_TAU2_ENV_ID, "env_service.gym_env:RemoteTau2Env")):
    if _id not in _gym.registry:
        _gym.register(id=_id, entry_point=_entry, disable_env_checker=True)
