from specmesh.v1 import common_pb2 as _common_pb2
from specmesh.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files", "sha256")
    FILES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[TokenizerFile]
    sha256: str
    def __init__(self, files: _Optional[_Iterable[_Union[TokenizerFile, _Mapping]]] = ..., sha256: _Optional[str] = ...) -> None: ...

class TokenizerFile(_message.Message):
    __slots__ = ("name", "content")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    content: bytes
    def __init__(self, name: _Optional[str] = ..., content: _Optional[bytes] = ...) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model_path", "architecture", "dtype", "vocab_size", "hidden_size", "num_layers", "aux_layer_ids", "max_context_len", "max_batch_size", "max_tokens_per_batch", "max_draft_tokens", "eos_token_ids", "supports_images", "image_token_id", "attention_backend", "device", "max_message_bytes", "chunk_bytes", "version", "occupancy", "tensor_parallel_size")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    AUX_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_IMAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    architecture: str
    dtype: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    aux_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context_len: int
    max_batch_size: int
    max_tokens_per_batch: int
    max_draft_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    supports_images: bool
    image_token_id: int
    attention_backend: str
    device: str
    max_message_bytes: int
    chunk_bytes: int
    version: str
    occupancy: _common_pb2.Occupancy
    tensor_parallel_size: int
    def __init__(self, model_path: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., aux_layer_ids: _Optional[_Iterable[int]] = ..., max_context_len: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_tokens_per_batch: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., supports_images: _Optional[bool] = ..., image_token_id: _Optional[int] = ..., attention_backend: _Optional[str] = ..., device: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., version: _Optional[str] = ..., occupancy: _Optional[_Union[_common_pb2.Occupancy, _Mapping]] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class StreamOpen(_message.Message):
    __slots__ = ("feature", "aux_layer_ids", "aux_numbering", "rows_in_shared_memory")
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    AUX_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    AUX_NUMBERING_FIELD_NUMBER: _ClassVar[int]
    ROWS_IN_SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    feature: _common_pb2.Feature
    aux_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    aux_numbering: _common_pb2.AuxNumbering
    rows_in_shared_memory: bool
    def __init__(self, feature: _Optional[_Union[_common_pb2.Feature, str]] = ..., aux_layer_ids: _Optional[_Iterable[int]] = ..., aux_numbering: _Optional[_Union[_common_pb2.AuxNumbering, str]] = ..., rows_in_shared_memory: _Optional[bool] = ...) -> None: ...

class TargetStepRequest(_message.Message):
    __slots__ = ("batch_id", "chunk_index", "more_chunks", "return_mm_input_embeds", "skip_features", "prefill", "decode", "verify", "release", "open")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    MORE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RETURN_MM_INPUT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_FEATURES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    chunk_index: int
    more_chunks: bool
    return_mm_input_embeds: bool
    skip_features: bool
    prefill: PrefillBatch
    decode: DecodeBatch
    verify: VerifyBatch
    release: _common_pb2.ReleaseBatch
    open: StreamOpen
    def __init__(self, batch_id: _Optional[int] = ..., chunk_index: _Optional[int] = ..., more_chunks: _Optional[bool] = ..., return_mm_input_embeds: _Optional[bool] = ..., skip_features: _Optional[bool] = ..., prefill: _Optional[_Union[PrefillBatch, _Mapping]] = ..., decode: _Optional[_Union[DecodeBatch, _Mapping]] = ..., verify: _Optional[_Union[VerifyBatch, _Mapping]] = ..., release: _Optional[_Union[_common_pb2.ReleaseBatch, _Mapping]] = ..., open: _Optional[_Union[StreamOpen, _Mapping]] = ...) -> None: ...

class PrefillBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[PrefillRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[PrefillRequest, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "input_ids", "sampling", "sample_offset", "images", "input_start", "more_input")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    INPUT_START_FIELD_NUMBER: _ClassVar[int]
    MORE_INPUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    sample_offset: int
    images: _containers.RepeatedScalarFieldContainer[bytes]
    input_start: int
    more_input: bool
    def __init__(self, request_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., sample_offset: _Optional[int] = ..., images: _Optional[_Iterable[bytes]] = ..., input_start: _Optional[int] = ..., more_input: _Optional[bool] = ...) -> None: ...

class DecodeBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[DecodeRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[DecodeRequest, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ...) -> None: ...

class VerifyBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("request_id", "tree")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tree: _common_pb2.DraftTree
    def __init__(self, request_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ...) -> None: ...

class TargetStepResponse(_message.Message):
    __slots__ = ("batch_id", "chunk_index", "more_chunks", "status", "results", "states")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    MORE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    chunk_index: int
    more_chunks: bool
    status: _common_pb2.Status
    results: _containers.RepeatedCompositeFieldContainer[TargetResult]
    states: _common_pb2.HiddenStates
    def __init__(self, batch_id: _Optional[int] = ..., chunk_index: _Optional[int] = ..., more_chunks: _Optional[bool] = ..., status: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., results: _Optional[_Iterable[_Union[TargetResult, _Mapping]]] = ..., states: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ...) -> None: ...

class TargetResult(_message.Message):
    __slots__ = ("request_id", "status", "token_ids", "accepted_nodes", "prompt_ids", "logprobs", "prompt_logprobs", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: _common_pb2.Status
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.Status, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
