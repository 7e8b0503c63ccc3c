from sinkflex.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("env", "task_id", "messages", "termination_reason", "solo_mode")
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TERMINATION_REASON_FIELD_NUMBER: _ClassVar[int]
    SOLO_MODE_FIELD_NUMBER: _ClassVar[int]
    env: str
    task_id: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.Message]
    termination_reason: _common_pb2.TerminationReason
    solo_mode: bool
    def __init__(self, env: _Optional[str] = ..., task_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.Message, _Mapping]]] = ..., termination_reason: _Optional[_Union[_common_pb2.TerminationReason, str]] = ..., solo_mode: _Optional[bool] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("breakdown",)
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    breakdown: _common_pb2.RewardBreakdown
    def __init__(self, breakdown: _Optional[_Union[_common_pb2.RewardBreakdown, _Mapping]] = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ...) -> None: ...

class ScoreBatchItem(_message.Message):
    __slots__ = ("breakdown", "error", "error_code")
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    breakdown: _common_pb2.RewardBreakdown
    error: str
    error_code: int
    def __init__(self, breakdown: _Optional[_Union[_common_pb2.RewardBreakdown, _Mapping]] = ..., error: _Optional[str] = ..., error_code: _Optional[int] = ...) -> None: ...

class ScoreBatchResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreBatchItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreBatchItem, _Mapping]]] = ...) -> None: ...
