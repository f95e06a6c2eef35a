from specmesh.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Feature(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FEATURE_NONE: _ClassVar[Feature]
    FEATURE_AUX_HIDDEN: _ClassVar[Feature]
    FEATURE_HIDDEN: _ClassVar[Feature]
    FEATURE_HIDDEN_PRE_NORM: _ClassVar[Feature]

class AuxNumbering(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUX_NUMBERING_INPUT: _ClassVar[AuxNumbering]
    AUX_NUMBERING_OUTPUT: _ClassVar[AuxNumbering]
FEATURE_NONE: Feature
FEATURE_AUX_HIDDEN: Feature
FEATURE_HIDDEN: Feature
FEATURE_HIDDEN_PRE_NORM: Feature
AUX_NUMBERING_INPUT: AuxNumbering
AUX_NUMBERING_OUTPUT: AuxNumbering

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ReleaseBatch(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Occupancy(_message.Message):
    __slots__ = ("num_requests", "num_streams", "kv_slots_used", "kv_slots_free", "prefix_cached_tokens")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    num_streams: int
    kv_slots_used: int
    kv_slots_free: int
    prefix_cached_tokens: int
    def __init__(self, num_requests: _Optional[int] = ..., num_streams: _Optional[int] = ..., kv_slots_used: _Optional[int] = ..., kv_slots_free: _Optional[int] = ..., prefix_cached_tokens: _Optional[int] = ...) -> None: ...

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
