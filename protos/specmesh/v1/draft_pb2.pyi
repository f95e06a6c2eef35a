from specmesh.v1 import common_pb2 as _common_pb2
from specmesh.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftInfo(_message.Message):
    __slots__ = ("draft_kind", "model_path", "dtype", "vocab_size", "draft_vocab_size", "hidden_size", "aux_layer_ids", "aux_numbering", "feature", "supports_images", "num_steps", "topk", "num_draft_tokens", "max_context_len", "max_batch_size", "attention_backend", "device", "max_message_bytes", "version", "occupancy", "online_learning")
    DRAFT_KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    AUX_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    AUX_NUMBERING_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_IMAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    ONLINE_LEARNING_FIELD_NUMBER: _ClassVar[int]
    draft_kind: str
    model_path: str
    dtype: str
    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    aux_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    aux_numbering: _common_pb2.AuxNumbering
    feature: _common_pb2.Feature
    supports_images: bool
    num_steps: int
    topk: int
    num_draft_tokens: int
    max_context_len: int
    max_batch_size: int
    attention_backend: str
    device: str
    max_message_bytes: int
    version: str
    occupancy: _common_pb2.Occupancy
    online_learning: OnlineLearning
    def __init__(self, draft_kind: _Optional[str] = ..., model_path: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., draft_vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., aux_layer_ids: _Optional[_Iterable[int]] = ..., aux_numbering: _Optional[_Union[_common_pb2.AuxNumbering, str]] = ..., feature: _Optional[_Union[_common_pb2.Feature, str]] = ..., supports_images: _Optional[bool] = ..., num_steps: _Optional[int] = ..., topk: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., max_context_len: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., attention_backend: _Optional[str] = ..., device: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., version: _Optional[str] = ..., occupancy: _Optional[_Union[_common_pb2.Occupancy, _Mapping]] = ..., online_learning: _Optional[_Union[OnlineLearning, _Mapping]] = ...) -> None: ...

class OnlineLearning(_message.Message):
    __slots__ = ("weight_version", "updates", "rollbacks", "resets", "tokens_observed", "train_tokens", "heldout_tokens", "heldout_accept_before", "heldout_accept_after", "heldout_accept_shipped", "last_loss", "train_seconds")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    ROLLBACKS_FIELD_NUMBER: _ClassVar[int]
    RESETS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_ACCEPT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_ACCEPT_AFTER_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_ACCEPT_SHIPPED_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    updates: int
    rollbacks: int
    resets: int
    tokens_observed: int
    train_tokens: int
    heldout_tokens: int
    heldout_accept_before: float
    heldout_accept_after: float
    heldout_accept_shipped: float
    last_loss: float
    train_seconds: float
    def __init__(self, weight_version: _Optional[int] = ..., updates: _Optional[int] = ..., rollbacks: _Optional[int] = ..., resets: _Optional[int] = ..., tokens_observed: _Optional[int] = ..., train_tokens: _Optional[int] = ..., heldout_tokens: _Optional[int] = ..., heldout_accept_before: _Optional[float] = ..., heldout_accept_after: _Optional[float] = ..., heldout_accept_shipped: _Optional[float] = ..., last_loss: _Optional[float] = ..., train_seconds: _Optional[float] = ...) -> None: ...

class DraftStepRequest(_message.Message):
    __slots__ = ("batch_id", "chunk_index", "more_chunks", "extend", "propose", "release", "prepare")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    MORE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    chunk_index: int
    more_chunks: bool
    extend: ExtendBatch
    propose: ProposeBatch
    release: _common_pb2.ReleaseBatch
    prepare: PrepareBatch
    def __init__(self, batch_id: _Optional[int] = ..., chunk_index: _Optional[int] = ..., more_chunks: _Optional[bool] = ..., extend: _Optional[_Union[ExtendBatch, _Mapping]] = ..., propose: _Optional[_Union[ProposeBatch, _Mapping]] = ..., release: _Optional[_Union[_common_pb2.ReleaseBatch, _Mapping]] = ..., prepare: _Optional[_Union[PrepareBatch, _Mapping]] = ...) -> None: ...

class PrepareBatch(_message.Message):
    __slots__ = ("constraints",)
    CONSTRAINTS_FIELD_NUMBER: _ClassVar[int]
    constraints: _containers.RepeatedCompositeFieldContainer[_generation_pb2.Constraint]
    def __init__(self, constraints: _Optional[_Iterable[_Union[_generation_pb2.Constraint, _Mapping]]] = ...) -> None: ...

class ProposeParams(_message.Message):
    __slots__ = ("num_steps", "topk", "num_draft_tokens")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    topk: int
    num_draft_tokens: int
    def __init__(self, num_steps: _Optional[int] = ..., topk: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class ExtendBatch(_message.Message):
    __slots__ = ("requests", "states", "propose_after", "propose_params")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_AFTER_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_PARAMS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ExtendRequest]
    states: _common_pb2.HiddenStates
    propose_after: bool
    propose_params: ProposeParams
    def __init__(self, requests: _Optional[_Iterable[_Union[ExtendRequest, _Mapping]]] = ..., states: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., propose_after: _Optional[bool] = ..., propose_params: _Optional[_Union[ProposeParams, _Mapping]] = ...) -> None: ...

class ExtendRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "starts_request", "next_token_id", "multimodal", "constraint", "output_start", "exclude_from_learning")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STARTS_REQUEST_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FROM_LEARNING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    starts_request: bool
    next_token_id: int
    multimodal: bool
    constraint: _generation_pb2.Constraint
    output_start: int
    exclude_from_learning: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., starts_request: _Optional[bool] = ..., next_token_id: _Optional[int] = ..., multimodal: _Optional[bool] = ..., constraint: _Optional[_Union[_generation_pb2.Constraint, _Mapping]] = ..., output_start: _Optional[int] = ..., exclude_from_learning: _Optional[bool] = ...) -> None: ...

class ProposeBatch(_message.Message):
    __slots__ = ("requests", "params")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    params: ProposeParams
    def __init__(self, requests: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ..., params: _Optional[_Union[ProposeParams, _Mapping]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("request_id", "root_token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    root_token_id: int
    def __init__(self, request_id: _Optional[str] = ..., root_token_id: _Optional[int] = ...) -> None: ...

class DraftStepResponse(_message.Message):
    __slots__ = ("batch_id", "chunk_index", "more_chunks", "status", "results")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    MORE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    chunk_index: int
    more_chunks: bool
    status: _common_pb2.Status
    results: _containers.RepeatedCompositeFieldContainer[DraftResult]
    def __init__(self, batch_id: _Optional[int] = ..., chunk_index: _Optional[int] = ..., more_chunks: _Optional[bool] = ..., status: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., results: _Optional[_Iterable[_Union[DraftResult, _Mapping]]] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("request_id", "status", "tree", "predrafted", "weight_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: _common_pb2.Status
    tree: _common_pb2.DraftTree
    predrafted: bool
    weight_version: int
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., predrafted: _Optional[bool] = ..., weight_version: _Optional[int] = ...) -> None: ...
