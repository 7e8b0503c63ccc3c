"""The driver's clients of the four services, from addresses or in-process objects: `connect`.

Every service has one client interface with an in-process and a gRPC implementation
(`env_service.client`, `reward_service.client`, `rollout_service.client`,
`learner_service.client`); `connect` is the one place that picks them. The controller
(`sinkflex_rl.controller.Controller`) takes the `ServiceClients` it returns and never sees a
channel, a stub or a `grpc.RpcError`: every client raises `sinkflex.errors.ServiceError`
(`ServiceError.retryable` for a service that is busy, loading or restarting).

    clients = connect(Addresses(env="127.0.0.1:50051", reward="127.0.0.1:50052",
                                rollout="127.0.0.1:50053", learner="127.0.0.1:50054"))
    clients = connect(env=env_core, reward=task_catalog, rollout=worker, learner=learner_servicer)  # in-process
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from env_service.client import EnvClient, GrpcEnvClient, LocalEnvClient
from learner_service.client import GrpcLearnerClient, LearnerClient, LocalLearnerClient
from reward_service.client import GrpcRewardClient, LocalRewardClient, RewardClient
from rollout_service.client import GrpcRolloutClient, LocalRolloutClient, RolloutClient

#: Default deadlines (seconds) of the gRPC clients `connect` builds: an env call may wait for the
#: user LLM; the reward check scores empty episodes; rollout calls get their own per call (a Rollout
#: stream: run.step_timeout_s); a busy learner answers Status late.
ENV_TIMEOUT_S = 300.0
REWARD_TIMEOUT_S = 60.0
ROLLOUT_TIMEOUT_S = 3600.0
LEARNER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Addresses:
    env: str
    reward: str
    """"": no reward service was launched (nothing uses it: task.reward env, or task.reward_address)."""
    rollout: str
    learner: str
    """"": no learner (`sinkflex-rl eval`: a policy scored alone)."""


@dataclass
class ServiceClients:
    """One client per service (what `connect` returns).

    Attributes:
        env, rollout, learner: the services' clients.
        reward: the reward service that scores the experiment's env (the controller's start check,
            `Controller.check_reward`); None: none is connected (task.reward env).
        learner: None: none is connected (`sinkflex-rl eval`, which validates without training).
    """

    env: EnvClient
    reward: RewardClient | None
    rollout: RolloutClient
    learner: LearnerClient | None

    def close(self) -> None:
        """Closes the gRPC channels (in-process clients hold none). Idempotent."""
        shutdown = getattr(self.env, "shutdown", None)  # EnvClient.close(session_id) is the env's Close RPC
        if callable(shutdown):
            shutdown()
        for client in (self.reward, self.rollout, self.learner):
            close = getattr(client, "close", None)
            if callable(close):
                close()


def connect(addresses: Addresses | None = None, *, env: Any = None, reward: Any = None, rollout: Any = None,
            learner: Any = None, learner_required: bool = True) -> ServiceClients:
    """The four clients: each service from its keyword, else from `addresses`.

    A service is given as
      - an address "host:port": its gRPC client (`Grpc*Client`, deadlines `*_TIMEOUT_S`);
      - an in-process object: env — an `EnvCore` or `EnvServicer`; reward — a `TaskCatalog` or
        `RewardServicer`; rollout — a `RolloutWorker` or `RolloutServicer`; learner — a
        `LearnerServicer` or `LearnerRunner`: its `Local*Client`;
      - a client (anything implementing the service's client Protocol): as is.
    The reward service may be missing ("" or None: `ServiceClients.reward` None), and so may the
    learner with `learner_required` False (`ServiceClients.learner` None: evaluation alone).

    Raises:
        ValueError: env, rollout or learner given neither here nor in `addresses`.
        TypeError: an object that is none of the above.
    """
    given = {"env": env, "reward": reward, "rollout": rollout, "learner": learner}
    for name, value in given.items():
        if value is None and addresses is not None:
            given[name] = getattr(addresses, name)
    missing = [name for name in ("env", "rollout", "learner")[: 3 if learner_required else 2] if not given[name]]
    if missing:
        raise ValueError(f"connect: no address or in-process object for {', '.join(missing)}")
    return ServiceClients(env=_env(given["env"]), reward=_reward(given["reward"]), rollout=_rollout(given["rollout"]),
                          learner=_learner(given["learner"]) if given["learner"] else None)


def _is(obj: Any, module: str, name: str) -> bool:
    """`obj` is a `module.name`, without importing `module` (an instance of it means it was imported)."""
    mod = sys.modules.get(module)
    return mod is not None and isinstance(obj, getattr(mod, name, ()))


def _env(x: Any) -> EnvClient:
    if isinstance(x, str):
        return GrpcEnvClient(x, timeout=ENV_TIMEOUT_S)
    if _is(x, "env_service.server", "EnvServicer"):
        return LocalEnvClient(core=x.core)
    if _is(x, "env_service.core", "EnvCore"):
        return LocalEnvClient(core=x)
    if isinstance(x, EnvClient):
        return x
    raise TypeError(f"connect: env is {type(x).__name__}, not an address, EnvCore, EnvServicer or EnvClient")


def _reward(x: Any) -> RewardClient | None:
    if not x:
        return None
    if isinstance(x, str):
        return GrpcRewardClient(x, timeout=REWARD_TIMEOUT_S)
    if _is(x, "reward_service.server", "RewardServicer"):
        return LocalRewardClient(x.catalog, judge=x.judge)
    if _is(x, "reward_service.scoring", "TaskCatalog"):
        return LocalRewardClient(x)
    if callable(getattr(x, "score", None)) and callable(getattr(x, "score_batch", None)):
        return x
    raise TypeError(f"connect: reward is {type(x).__name__}, not an address, TaskCatalog, RewardServicer or RewardClient")


def _rollout(x: Any) -> RolloutClient:
    if isinstance(x, str):
        return GrpcRolloutClient(x, timeout=ROLLOUT_TIMEOUT_S)
    if _is(x, "rollout_service.server", "RolloutServicer"):
        return LocalRolloutClient(x.worker)
    if _is(x, "rollout_service.worker", "RolloutWorker"):
        return LocalRolloutClient(x)
    if isinstance(x, RolloutClient):
        return x
    raise TypeError(f"connect: rollout is {type(x).__name__}, not an address, RolloutWorker, RolloutServicer or RolloutClient")


def _learner(x: Any) -> LearnerClient:
    if isinstance(x, str):
        return GrpcLearnerClient(x, timeout=LEARNER_TIMEOUT_S)
    if _is(x, "learner_service.server", "LearnerServicer"):
        return LocalLearnerClient(x)
    if _is(x, "learner_service.loop", "LearnerRunner"):
        from learner_service.server import LearnerServicer

        return LocalLearnerClient(LearnerServicer(x))
    if isinstance(x, LearnerClient):
        return x
    raise TypeError(f"connect: learner is {type(x).__name__}, not an address, LearnerServicer, LearnerRunner or LearnerClient")
