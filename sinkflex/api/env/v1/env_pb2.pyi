from sinkflex.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListEnvironmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EnvironmentInfo(_message.Message):
    __slots__ = ("name", "description", "splits", "num_tasks", "supports_solo")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    NUM_TASKS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_SOLO_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    splits: _containers.RepeatedScalarFieldContainer[str]
    num_tasks: int
    supports_solo: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., splits: _Optional[_Iterable[str]] = ..., num_tasks: _Optional[int] = ..., supports_solo: _Optional[bool] = ...) -> None: ...

class ListEnvironmentsResponse(_message.Message):
    __slots__ = ("environments",)
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentInfo]
    def __init__(self, environments: _Optional[_Iterable[_Union[EnvironmentInfo, _Mapping]]] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("env", "split")
    ENV_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    env: str
    split: str
    def __init__(self, env: _Optional[str] = ..., split: _Optional[str] = ...) -> None: ...

class TaskInfo(_message.Message):
    __slots__ = ("task_id", "description")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    description: str
    def __init__(self, task_id: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskInfo]
    def __init__(self, tasks: _Optional[_Iterable[_Union[TaskInfo, _Mapping]]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("env", "task_id", "split", "seed", "solo_mode", "max_steps")
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SOLO_MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    env: str
    task_id: str
    split: str
    seed: int
    solo_mode: bool
    max_steps: int
    def __init__(self, env: _Optional[str] = ..., task_id: _Optional[str] = ..., split: _Optional[str] = ..., seed: _Optional[int] = ..., solo_mode: _Optional[bool] = ..., max_steps: _Optional[int] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("session_id", "task_id", "observation", "tools", "system_prompt", "policy", "info")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    task_id: str
    observation: _containers.RepeatedCompositeFieldContainer[_common_pb2.Message]
    tools: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolSpec]
    system_prompt: str
    policy: str
    info: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., task_id: _Optional[str] = ..., observation: _Optional[_Iterable[_Union[_common_pb2.Message, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[_common_pb2.ToolSpec, _Mapping]]] = ..., system_prompt: _Optional[str] = ..., policy: _Optional[str] = ..., info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "action", "stop", "request_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: _common_pb2.Message
    stop: bool
    request_id: str
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[_Union[_common_pb2.Message, _Mapping]] = ..., stop: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "terminated", "truncated", "termination_reason", "info")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TERMINATION_REASON_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    observation: _containers.RepeatedCompositeFieldContainer[_common_pb2.Message]
    reward: float
    terminated: bool
    truncated: bool
    termination_reason: _common_pb2.TerminationReason
    info: _containers.ScalarMap[str, str]
    def __init__(self, observation: _Optional[_Iterable[_Union[_common_pb2.Message, _Mapping]]] = ..., reward: _Optional[float] = ..., terminated: _Optional[bool] = ..., truncated: _Optional[bool] = ..., termination_reason: _Optional[_Union[_common_pb2.TerminationReason, str]] = ..., info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
