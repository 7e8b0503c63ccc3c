import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_SYSTEM: _ClassVar[Role]
    ROLE_USER: _ClassVar[Role]
    ROLE_ASSISTANT: _ClassVar[Role]
    ROLE_TOOL: _ClassVar[Role]

class TerminationReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TERMINATION_REASON_UNSPECIFIED: _ClassVar[TerminationReason]
    TERMINATION_REASON_AGENT_STOP: _ClassVar[TerminationReason]
    TERMINATION_REASON_USER_STOP: _ClassVar[TerminationReason]
    TERMINATION_REASON_MAX_STEPS: _ClassVar[TerminationReason]
    TERMINATION_REASON_TOO_MANY_ERRORS: _ClassVar[TerminationReason]
    TERMINATION_REASON_AGENT_ERROR: _ClassVar[TerminationReason]
    TERMINATION_REASON_USER_ERROR: _ClassVar[TerminationReason]
    TERMINATION_REASON_MAX_TURNS: _ClassVar[TerminationReason]
    TERMINATION_REASON_MAX_CONTEXT_TOKENS: _ClassVar[TerminationReason]
    TERMINATION_REASON_INFRASTRUCTURE_ERROR: _ClassVar[TerminationReason]

class RewardType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REWARD_TYPE_UNSPECIFIED: _ClassVar[RewardType]
    REWARD_TYPE_DB: _ClassVar[RewardType]
    REWARD_TYPE_ACTION: _ClassVar[RewardType]
    REWARD_TYPE_COMMUNICATE: _ClassVar[RewardType]
    REWARD_TYPE_ENV_ASSERTION: _ClassVar[RewardType]
    REWARD_TYPE_NL_ASSERTION: _ClassVar[RewardType]
ROLE_UNSPECIFIED: Role
ROLE_SYSTEM: Role
ROLE_USER: Role
ROLE_ASSISTANT: Role
ROLE_TOOL: Role
TERMINATION_REASON_UNSPECIFIED: TerminationReason
TERMINATION_REASON_AGENT_STOP: TerminationReason
TERMINATION_REASON_USER_STOP: TerminationReason
TERMINATION_REASON_MAX_STEPS: TerminationReason
TERMINATION_REASON_TOO_MANY_ERRORS: TerminationReason
TERMINATION_REASON_AGENT_ERROR: TerminationReason
TERMINATION_REASON_USER_ERROR: TerminationReason
TERMINATION_REASON_MAX_TURNS: TerminationReason
TERMINATION_REASON_MAX_CONTEXT_TOKENS: TerminationReason
TERMINATION_REASON_INFRASTRUCTURE_ERROR: TerminationReason
REWARD_TYPE_UNSPECIFIED: RewardType
REWARD_TYPE_DB: RewardType
REWARD_TYPE_ACTION: RewardType
REWARD_TYPE_COMMUNICATE: RewardType
REWARD_TYPE_ENV_ASSERTION: RewardType
REWARD_TYPE_NL_ASSERTION: RewardType

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json", "requestor")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    REQUESTOR_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    requestor: Role
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., requestor: _Optional[_Union[Role, str]] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "error", "requestor")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REQUESTOR_FIELD_NUMBER: _ClassVar[int]
    role: Role
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    error: bool
    requestor: Role
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., error: _Optional[bool] = ..., requestor: _Optional[_Union[Role, str]] = ...) -> None: ...

class ToolSpec(_message.Message):
    __slots__ = ("name", "description", "parameters_json_schema")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json_schema: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json_schema: _Optional[str] = ...) -> None: ...

class RewardComponent(_message.Message):
    __slots__ = ("type", "reward", "details_json")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    type: RewardType
    reward: float
    details_json: str
    def __init__(self, type: _Optional[_Union[RewardType, str]] = ..., reward: _Optional[float] = ..., details_json: _Optional[str] = ...) -> None: ...

class RewardBreakdown(_message.Message):
    __slots__ = ("reward", "components", "reward_basis", "info")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_BASIS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    reward: float
    components: _containers.RepeatedCompositeFieldContainer[RewardComponent]
    reward_basis: _containers.RepeatedScalarFieldContainer[RewardType]
    info: str
    def __init__(self, reward: _Optional[float] = ..., components: _Optional[_Iterable[_Union[RewardComponent, _Mapping]]] = ..., reward_basis: _Optional[_Iterable[_Union[RewardType, str]]] = ..., info: _Optional[str] = ...) -> None: ...

class TurnInfo(_message.Message):
    __slots__ = ("prompt_start", "generation_start", "num_generated", "policy_version", "truncated", "parse_error")
    PROMPT_START_FIELD_NUMBER: _ClassVar[int]
    GENERATION_START_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    PARSE_ERROR_FIELD_NUMBER: _ClassVar[int]
    prompt_start: int
    generation_start: int
    num_generated: int
    policy_version: int
    truncated: bool
    parse_error: bool
    def __init__(self, prompt_start: _Optional[int] = ..., generation_start: _Optional[int] = ..., num_generated: _Optional[int] = ..., policy_version: _Optional[int] = ..., truncated: _Optional[bool] = ..., parse_error: _Optional[bool] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "task_id", "env", "policy_version", "token_ids", "logprobs", "loss_mask", "messages", "reward", "reward_breakdown", "termination_reason", "metrics", "turns")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    TERMINATION_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    task_id: str
    env: str
    policy_version: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    reward: float
    reward_breakdown: RewardBreakdown
    termination_reason: TerminationReason
    metrics: _containers.ScalarMap[str, float]
    turns: _containers.RepeatedCompositeFieldContainer[TurnInfo]
    def __init__(self, trajectory_id: _Optional[str] = ..., task_id: _Optional[str] = ..., env: _Optional[str] = ..., policy_version: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., reward: _Optional[float] = ..., reward_breakdown: _Optional[_Union[RewardBreakdown, _Mapping]] = ..., termination_reason: _Optional[_Union[TerminationReason, str]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., turns: _Optional[_Iterable[_Union[TurnInfo, _Mapping]]] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("group_id", "task_id", "env", "trajectories", "created_at")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    task_id: str
    env: str
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, group_id: _Optional[str] = ..., task_id: _Optional[str] = ..., env: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...
