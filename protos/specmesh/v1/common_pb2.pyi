from specmesh.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_released", "unknown_request_ids")
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_released: _Optional[int] = ..., unknown_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("tokens", "parents", "scores")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("row_counts", "aux_hidden", "hidden", "mm_input_embeds")
    ROW_COUNTS_FIELD_NUMBER: _ClassVar[int]
    AUX_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    MM_INPUT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    row_counts: _containers.RepeatedScalarFieldContainer[int]
    aux_hidden: _tensor_pb2.Tensor
    hidden: _tensor_pb2.Tensor
    mm_input_embeds: _tensor_pb2.Tensor
    def __init__(self, row_counts: _Optional[_Iterable[int]] = ..., aux_hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., mm_input_embeds: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
