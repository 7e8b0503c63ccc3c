"""`RolloutWorker`: the rollout service's core, usable in-process (no gRPC).

Builds the engine, tokenizer, env / reward clients, trajectory buffer and `AgentLoop` from a
`RolloutConfig`, and offers the RolloutService operations as plain methods:
`rollout(request)` (an iterator of TrajectoryGroups, callable from any thread),
`update_weights(version, location)`, `status()`. The gRPC servicer (server.py) is a thin
edge over it. A request is pinned to one policy version (`Engine.pinned`: no weight update
lands inside it) unless it publishes training data and `weight_updates` is between_turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading

import grpc
from typing import Any, Callable, Iterator

from rollout_service.agent import AgentLoop
from rollout_service.config import RolloutConfig
from rollout_service.engine import Engine, Sampling
from rollout_service.formatting import formatter_factory
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.rollout.v1 import rollout_pb2
from sinkflex.errors import ServiceError, invalid_argument

log = logging.getLogger(__name__)

_DONE = object()


def sampling_from_proto(p: common_pb2.SamplingParams, defaults) -> Sampling:
    """Request sampling params with the agent config's defaults for unset (0) fields.

    Temperature 0 in the request means "unset" (proto3); greedy decoding is configured with
    `agent.temperature = 0`.
    """
    return Sampling(
        temperature=p.temperature if p.temperature > 0 else defaults.temperature,
        top_p=p.top_p if 0 < p.top_p <= 1 else defaults.top_p,
        top_k=p.top_k if p.top_k > 0 else defaults.top_k,
        max_new_tokens=p.max_new_tokens if p.max_new_tokens > 0 else defaults.max_new_tokens,
        seed=p.seed if p.seed else None,
    )


class RolloutWorker:
    """The rollout service's core (engine + agent loop + clients).

    Args:
        config: the service config.
        env, reward, buffer: ready clients; None builds them from `config` (gRPC when an
            address is set, else in-process; the buffer is built only when `config.redis_url`
            is set or `publish` is first requested).
    """

    def __init__(self, config: RolloutConfig, env=None, reward=None, buffer=None, engine: Engine | None = None):
        from transformers import AutoTokenizer

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.engine.model)
        # the policy's template is checked on a tool round trip before the engine starts (ValueError)
        formatter_factory(config.agent.tool_format, self.tokenizer, model=config.engine.model, **config.agent.format_options())
        self.engine = engine or Engine(config.engine.model, dtype=config.engine.dtype, max_model_len=config.engine.max_model_len,
                                       kv_cache_gib=config.engine.kv_cache_gib, policy_version=config.engine.policy_version,
                                       enforce_eager=config.engine.enforce_eager, seed=config.engine.seed,
                                       tensor_parallel_size=config.engine.tensor_parallel_size,
                                       gpu_memory_utilization=config.engine.gpu_memory_utilization)
        self.user_sim = None
        if config.user_sim_port is not None:
            from rollout_service.user_sim import UserSimServer

            self.user_sim = UserSimServer(self.engine, self.tokenizer, port=config.user_sim_port,
                                          max_tokens=config.user_sim_max_tokens)
        self.env = env if env is not None else self._make_env()
        self._reward = reward  # the default reward client: built on first use (an env routed to "env" needs none)
        self._reward_clients: dict[str, object] = {}  # address -> client, for envs routed to another reward service
        self._reward_lock = threading.Lock()
        self._known: set[tuple[str, str, bool]] = set()  # (env, task, solo) the env's reward service knows
        self._buffer = buffer
        self._buffer_lock = threading.Lock()
        a = config.agent
        self.loop = AgentLoop(self.engine, self.tokenizer, self.env, None, buffer=None, tool_format=a.tool_format,
                              format_options=a.format_options(), model=config.engine.model,
                              env_max_steps=a.env_max_steps, max_groups_in_flight=a.max_groups_in_flight,
                              reward_for=self.reward_for, text_ends_episode=lambda env: config.route(env).text_ends_episode)

    def _make_env(self):
        if self.config.env_address:
            from env_service.client import GrpcEnvClient

            return GrpcEnvClient(self.config.env_address)
        from env_service.client import LocalEnvClient
        from env_service.config import EnvServiceConfig

        base = self.user_sim.base_url if self.user_sim else EnvServiceConfig().user_base_url
        return LocalEnvClient(EnvServiceConfig(user_base_url=base))

    def _make_reward(self):
        if self.config.reward_address:
            from reward_service.client import GrpcRewardClient

            return GrpcRewardClient(self.config.reward_address)
        from reward_service.client import LocalRewardClient

        return LocalRewardClient()

    @property
    def reward(self):
        """The default reward client (`reward_address`, else in-process τ²-Bench), built on first use."""
        with self._reward_lock:
            if self._reward is None:
                self._reward = self._make_reward()
            return self._reward

    def reward_for(self, env: str):
        """The reward client that scores `env` (`config.envs`), or None: the env's own reward is kept."""
        route = self.config.route(env)
        if route.reward == "env":
            return None
        if not route.reward_address or route.reward_address == self.config.reward_address:
            return self.reward
        with self._reward_lock:
            client = self._reward_clients.get(route.reward_address)
            if client is None:
                from reward_service.client import GrpcRewardClient

                client = self._reward_clients[route.reward_address] = GrpcRewardClient(route.reward_address)
            return client

    def reward_address(self, env: str) -> str:
        """Where `env`'s reward service is, in words (for messages)."""
        route = self.config.route(env)
        return route.reward_address or self.config.reward_address or "in-process (τ²-Bench's checker)"

    def check_reward(self, env: str, task_ids, solo_mode: bool = False) -> None:
        """Fails when `env` is routed to a reward service that does not know it or one of `task_ids`.

        Raises:
            ServiceError FAILED_PRECONDITION: naming the env, the task(s) and the reward service's address.
        """
        client = self.reward_for(env)
        todo = [t for t in dict.fromkeys(task_ids) if (env, t, solo_mode) not in self._known]
        if client is None or not todo:
            return
        from reward_service.client import unknown_message, unknown_tasks

        try:
            unknown = unknown_tasks(client, env, todo, solo_mode)
        except ServiceError as err:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"env {env!r} is scored by the reward service at {self.reward_address(env)}, which did "
                               f"not answer: {err.message}") from None
        if unknown:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, unknown_message(env, self.reward_address(env), unknown))
        self._known.update((env, t, solo_mode) for t in todo)

    @property
    def buffer(self):
        """The trajectory buffer (built on first use: `config.redis_url`, REDIS_URL, or embedded Redis)."""
        with self._buffer_lock:
            if self._buffer is None:
                from sinkflex.buffer import TrajectoryBuffer

                self._buffer = TrajectoryBuffer(self.config.redis_url)
            return self._buffer

    def rollout(self, request: rollout_pb2.RolloutRequest,
                on_end: Callable[[Callable[[], Any]], Any] | None = None) -> Iterator[common_pb2.TrajectoryGroup]:
        """Runs `request` on the engine loop; yields each finished, scored group (from any thread).

        Args:
            on_end: registers a callback to call when the caller stops waiting (gRPC's
                `ServicerContext.add_callback`: the RPC ended, cancelled by its client or past its
                deadline). The groups still in flight are then cancelled: their episodes stop, their
                env sessions are closed, and none of them is published (in synchronous training the
                controller samples the step again, and a late group would arrive stale); groups
                published before stay in the buffer. The generator then raises
                `asyncio.CancelledError`.

        Raises:
            ServiceError INVALID_ARGUMENT: no env, no task ids, or group_size < 1.
            ServiceError NOT_FOUND: unknown env or task id.
            ServiceError FAILED_PRECONDITION: the env is routed to a reward service that does not
                know it (or a task), or that does not answer.
            ServiceError UNAVAILABLE: the engine stopped during the request.
            asyncio.CancelledError: `on_end`'s callback cancelled the request.
        """
        if not request.env:
            raise invalid_argument("RolloutRequest.env is empty")
        if not request.task_ids:
            raise invalid_argument("RolloutRequest.task_ids is empty")
        if request.group_size < 1:
            raise invalid_argument(f"group_size must be >= 1, got {request.group_size}")
        known = set(self.env.list_tasks(request.env))  # NOT_FOUND: unknown env
        unknown = [t for t in request.task_ids if t not in known]
        if unknown:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"unknown task ids of env {request.env!r}: {unknown[:10]}")
        self.check_reward(request.env, request.task_ids, request.solo_mode)  # before anything is sampled
        a = self.config.agent
        sampling = sampling_from_proto(request.sampling, a)
        max_turns = request.max_turns or a.max_turns
        max_ctx = request.max_context_tokens or a.max_context_tokens
        if request.publish and self.loop.buffer is None:
            self.loop.buffer = self.buffer  # built on first use
        out: queue.Queue = queue.Queue()

        # one policy version for the whole request, unless training data may span an update
        pin = not (request.publish and self.config.weight_updates == "between_turns")

        async def produce():
            try:
                async with (self.engine.pinned() if pin else contextlib.nullcontext()):
                    async for group in self.loop.run_tasks(request.env, list(request.task_ids), request.group_size,
                                                           sampling, max_turns, max_ctx, request.solo_mode, request.publish):
                        out.put(group)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer thread
                out.put(err)
            finally:
                out.put(_DONE)

        fut = self.engine.submit(produce())
        if on_end is not None:
            on_end(fut.cancel)  # a no-op once every group was handed over
        try:
            while True:
                try:
                    item = out.get(timeout=1.0)
                except queue.Empty:
                    if fut.cancelled():  # before `produce` ran: it hands nothing over
                        raise asyncio.CancelledError() from None
                    if not self.engine.loop.is_running():  # shut down: `produce` will never end
                        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the engine stopped during the request") from None
                    continue
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()

    def update_weights(self, policy_version: int, location: str) -> float:
        """Loads a new policy version into the running engine; returns seconds spent."""
        return self.engine.run(self.engine.update_weights(policy_version, location))

    def status(self) -> rollout_pb2.StatusResponse:
        resp = rollout_pb2.StatusResponse(model=self.engine.model, policy_version=self.engine.policy_version,
                                          groups_in_flight=self.loop.groups_in_flight,
                                          groups_completed=self.loop.groups_completed,
                                          tokens_generated=self.engine.tokens_generated)
        for k, v in self.loop.totals.items():
            resp.metrics[k] = v
        # utilisation: 1 - d(busy)/d(uptime) over an interval is the engine's idle fraction
        resp.metrics["engine_busy_seconds"] = self.engine.busy_seconds()
        resp.metrics["engine_uptime_seconds"] = self.engine.uptime_seconds()
        if self.user_sim is not None:
            resp.metrics["user_sim_requests"] = float(self.user_sim.requests)
        return resp

    def begin_stop(self) -> None:
        """The graceful stop begins (SIGTERM): in-flight episodes end at their next turn boundary
        and come back as failed with the reason (`AgentLoop.stopping`), so every in-flight
        Rollout stream ends within the grace period with all its groups instead of being cut."""
        log.warning("stopping: in-flight episodes end at their next turn (returned as failed, not published)")
        self.loop.stopping.set()

    def close(self) -> None:
        if self.user_sim is not None:
            self.user_sim.close()
        self.engine.shutdown()
