"""env_service: tau2-Bench domains behind a Gymnasium interface, served over gRPC.

Modules: `convert` (wire <-> tau2 messages), `config` (EnvServiceConfig), `catalog`
(domains, tasks, splits), `session` (one episode driven step by step through tau2's
Orchestrator), `core` (sessions: ids, TTL, limits), `server` (gRPC servicer),
`client` (EnvClient: in-process and gRPC), `gym_env` (Gymnasium envs).
"""
