from sinkflex.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutRequest(_message.Message):
    __slots__ = ("env", "task_ids", "group_size", "sampling", "max_turns", "max_context_tokens", "publish", "solo_mode")
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    SOLO_MODE_FIELD_NUMBER: _ClassVar[int]
    env: str
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    group_size: int
    sampling: _common_pb2.SamplingParams
    max_turns: int
    max_context_tokens: int
    publish: bool
    solo_mode: bool
    def __init__(self, env: _Optional[str] = ..., task_ids: _Optional[_Iterable[str]] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_turns: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., publish: _Optional[bool] = ..., solo_mode: _Optional[bool] = ...) -> None: ...

class RolloutResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: _common_pb2.TrajectoryGroup
    def __init__(self, group: _Optional[_Union[_common_pb2.TrajectoryGroup, _Mapping]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("policy_version", "location")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    location: str
    def __init__(self, policy_version: _Optional[int] = ..., location: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "load_seconds")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    load_seconds: float
    def __init__(self, policy_version: _Optional[int] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("model", "policy_version", "groups_in_flight", "groups_completed", "tokens_generated", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    model: str
    policy_version: int
    groups_in_flight: int
    groups_completed: int
    tokens_generated: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, model: _Optional[str] = ..., policy_version: _Optional[int] = ..., groups_in_flight: _Optional[int] = ..., groups_completed: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...
