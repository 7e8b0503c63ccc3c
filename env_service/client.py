"""`EnvClient`: one interface to an env service, in-process or over gRPC.

`LocalEnvClient` calls the same `EnvCore` the gRPC servicer uses (tests, debugging,
single-process runs); `GrpcEnvClient` speaks the EnvService contract to any env server
(ours or an external one, see examples/). Both raise `sinkflex.errors.ServiceError`
with the same status codes, so callers handle one exception type.

A trajectory for the reward service is `ResetResponse.observation` followed, for each
step, by the action sent and `StepResponse.observation` (system prompt excluded: it is
`ResetResponse.system_prompt`); see `env_service.session` for the details.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from env_service.config import EnvServiceConfig
from sinkflex.api.env.v1 import env_pb2, env_pb2_grpc
from sinkflex.errors import raise_as_service_error
from sinkflex.serving import DEFAULT_MAX_MESSAGE_BYTES, make_channel, wait_for_serving


@runtime_checkable
class EnvClient(Protocol):
    """The EnvService calls. Every method raises `ServiceError` on failure."""

    def list_environments(self) -> list[env_pb2.EnvironmentInfo]: ...

    def list_tasks(self, env: str, split: str = "") -> list[str]: ...

    def task_infos(self, env: str, split: str = "") -> list[env_pb2.TaskInfo]:
        """The tasks of `split` of `env` (all splits when empty) with their descriptions
        (τ²-Bench's ``Task.description.purpose``), in the server's order. Raises ServiceError
        NOT_FOUND for an unknown env or split."""
        ...

    def reset(self, request: env_pb2.ResetRequest) -> env_pb2.ResetResponse: ...

    def step(self, request: env_pb2.StepRequest) -> env_pb2.StepResponse: ...

    def close(self, session_id: str) -> None: ...


class LocalEnvClient:
    """In-process client over an `EnvCore` (built from `config`, or the given `core`).

    Building the core loads the tau2 domains (a few seconds). Responses are copies made
    by the core, as over the wire.
    """

    def __init__(self, config: EnvServiceConfig | None = None, core=None):
        from env_service.core import EnvCore

        self.core = core if core is not None else EnvCore(config or EnvServiceConfig())

    def list_environments(self) -> list[env_pb2.EnvironmentInfo]:
        return self.core.list_environments()

    def list_tasks(self, env: str, split: str = "") -> list[str]:
        return [t.task_id for t in self.core.list_tasks(env, split)]

    def task_infos(self, env: str, split: str = "") -> list[env_pb2.TaskInfo]:
        return list(self.core.list_tasks(env, split))

    def reset(self, request: env_pb2.ResetRequest) -> env_pb2.ResetResponse:
        return self.core.reset(request)

    def step(self, request: env_pb2.StepRequest) -> env_pb2.StepResponse:
        return self.core.step(request)

    def close(self, session_id: str) -> None:
        self.core.close(session_id)


class GrpcEnvClient:
    """gRPC client of any EnvService server at `address` ("host:port").

    Args:
        address: the server.
        timeout: deadline of each call in seconds (a Step may wait for the user LLM).
        max_message_bytes: send/receive size limit of the channel (RESOURCE_EXHAUSTED beyond).
        wait_ready: block until the server's health check says SERVING (up to `timeout`).
    """

    def __init__(self, address: str, timeout: float = 300.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 wait_ready: bool = False):
        self.address = address
        self.timeout = timeout
        self.channel = make_channel(address, max_message_bytes)
        self.stub = env_pb2_grpc.EnvServiceStub(self.channel)
        if wait_ready:
            wait_for_serving(self.channel, "", timeout=timeout)

    @raise_as_service_error
    def list_environments(self) -> list[env_pb2.EnvironmentInfo]:
        return list(self.stub.ListEnvironments(env_pb2.ListEnvironmentsRequest(), timeout=self.timeout).environments)

    @raise_as_service_error
    def list_tasks(self, env: str, split: str = "") -> list[str]:
        resp = self.stub.ListTasks(env_pb2.ListTasksRequest(env=env, split=split), timeout=self.timeout)
        return [t.task_id for t in resp.tasks]

    @raise_as_service_error
    def task_infos(self, env: str, split: str = "") -> list[env_pb2.TaskInfo]:
        return list(self.stub.ListTasks(env_pb2.ListTasksRequest(env=env, split=split), timeout=self.timeout).tasks)

    @raise_as_service_error
    def reset(self, request: env_pb2.ResetRequest) -> env_pb2.ResetResponse:
        return self.stub.Reset(request, timeout=self.timeout)

    @raise_as_service_error
    def step(self, request: env_pb2.StepRequest) -> env_pb2.StepResponse:
        return self.stub.Step(request, timeout=self.timeout)

    @raise_as_service_error
    def close(self, session_id: str) -> None:
        self.stub.Close(env_pb2.CloseRequest(session_id=session_id), timeout=self.timeout)

    def shutdown(self) -> None:
        """Closes the channel."""
        self.channel.close()

    def __enter__(self) -> "GrpcEnvClient":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
