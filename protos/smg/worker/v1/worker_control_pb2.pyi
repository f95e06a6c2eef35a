import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerHealthState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_HEALTH_STATE_UNSPECIFIED: _ClassVar[WorkerHealthState]
    WORKER_HEALTH_STATE_STARTING: _ClassVar[WorkerHealthState]
    WORKER_HEALTH_STATE_SERVING: _ClassVar[WorkerHealthState]
    WORKER_HEALTH_STATE_DEGRADED: _ClassVar[WorkerHealthState]
    WORKER_HEALTH_STATE_DRAINING: _ClassVar[WorkerHealthState]
    WORKER_HEALTH_STATE_NOT_SERVING: _ClassVar[WorkerHealthState]
WORKER_HEALTH_STATE_UNSPECIFIED: WorkerHealthState
WORKER_HEALTH_STATE_STARTING: WorkerHealthState
WORKER_HEALTH_STATE_SERVING: WorkerHealthState
WORKER_HEALTH_STATE_DEGRADED: WorkerHealthState
WORKER_HEALTH_STATE_DRAINING: WorkerHealthState
WORKER_HEALTH_STATE_NOT_SERVING: WorkerHealthState

class GetIdentityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetIdentityResponse(_message.Message):
    __slots__ = ("identity",)
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    identity: WorkerIdentity
    def __init__(self, identity: _Optional[_Union[WorkerIdentity, _Mapping]] = ...) -> None: ...

class WorkerIdentity(_message.Message):
    __slots__ = ("worker_id", "instance_id", "hostname", "zone", "version", "started_at", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    instance_id: str
    hostname: str
    zone: str
    version: str
    started_at: _timestamp_pb2.Timestamp
    labels: _containers.ScalarMap[str, str]
    def __init__(self, worker_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., hostname: _Optional[str] = ..., zone: _Optional[str] = ..., version: _Optional[str] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCapabilitiesResponse(_message.Message):
    __slots__ = ("capabilities",)
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    capabilities: WorkerCapabilities
    def __init__(self, capabilities: _Optional[_Union[WorkerCapabilities, _Mapping]] = ...) -> None: ...

class WorkerCapabilities(_message.Message):
    __slots__ = ("api_major", "api_minor", "features", "engines", "max_concurrent_requests", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    API_MAJOR_FIELD_NUMBER: _ClassVar[int]
    API_MINOR_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    api_major: int
    api_minor: int
    features: _containers.RepeatedScalarFieldContainer[str]
    engines: _containers.RepeatedCompositeFieldContainer[EngineCapability]
    max_concurrent_requests: int
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, api_major: _Optional[int] = ..., api_minor: _Optional[int] = ..., features: _Optional[_Iterable[str]] = ..., engines: _Optional[_Iterable[_Union[EngineCapability, _Mapping]]] = ..., max_concurrent_requests: _Optional[int] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EngineCapability(_message.Message):
    __slots__ = ("engine_type", "engine_version", "model_ids", "features")
    ENGINE_TYPE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    engine_type: str
    engine_version: str
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_type: _Optional[str] = ..., engine_version: _Optional[str] = ..., model_ids: _Optional[_Iterable[str]] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...

class GetHealthRequest(_message.Message):
    __slots__ = ("include_components",)
    INCLUDE_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    include_components: bool
    def __init__(self, include_components: _Optional[bool] = ...) -> None: ...

class GetHealthResponse(_message.Message):
    __slots__ = ("state", "message", "checked_at", "components")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHECKED_AT_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    state: WorkerHealthState
    message: str
    checked_at: _timestamp_pb2.Timestamp
    components: _containers.RepeatedCompositeFieldContainer[ComponentHealth]
    def __init__(self, state: _Optional[_Union[WorkerHealthState, str]] = ..., message: _Optional[str] = ..., checked_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., components: _Optional[_Iterable[_Union[ComponentHealth, _Mapping]]] = ...) -> None: ...

class ComponentHealth(_message.Message):
    __slots__ = ("component_id", "state", "message", "checked_at")
    COMPONENT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHECKED_AT_FIELD_NUMBER: _ClassVar[int]
    component_id: str
    state: WorkerHealthState
    message: str
    checked_at: _timestamp_pb2.Timestamp
    def __init__(self, component_id: _Optional[str] = ..., state: _Optional[_Union[WorkerHealthState, str]] = ..., message: _Optional[str] = ..., checked_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTopologyResponse(_message.Message):
    __slots__ = ("topology",)
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    topology: WorkerTopology
    def __init__(self, topology: _Optional[_Union[WorkerTopology, _Mapping]] = ...) -> None: ...

class WorkerTopology(_message.Message):
    __slots__ = ("worker_id", "topology_version", "engines", "observed_at")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_AT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    topology_version: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineEndpoint]
    observed_at: _timestamp_pb2.Timestamp
    def __init__(self, worker_id: _Optional[str] = ..., topology_version: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineEndpoint, _Mapping]]] = ..., observed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class EngineEndpoint(_message.Message):
    __slots__ = ("engine_id", "engine_type", "endpoint", "model_ids", "replica_group", "data_parallel_rank", "tensor_parallel_rank", "pipeline_parallel_rank", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TYPE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GROUP_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    engine_type: str
    endpoint: str
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    replica_group: str
    data_parallel_rank: int
    tensor_parallel_rank: int
    pipeline_parallel_rank: int
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, engine_id: _Optional[str] = ..., engine_type: _Optional[str] = ..., endpoint: _Optional[str] = ..., model_ids: _Optional[_Iterable[str]] = ..., replica_group: _Optional[str] = ..., data_parallel_rank: _Optional[int] = ..., tensor_parallel_rank: _Optional[int] = ..., pipeline_parallel_rank: _Optional[int] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...
