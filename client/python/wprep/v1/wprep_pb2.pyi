from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

ANSWER_WHEN_DONE: AnswerWhen
ANSWER_WHEN_QUEUED: AnswerWhen
DESCRIPTOR: _descriptor.FileDescriptor
DIRECTION_RETILE: Direction
DIRECTION_SWIZZLE: Direction
DIRECTION_UNSPECIFIED: Direction
DIRECTION_UNSWIZZLE: Direction
LAYOUT_BLACKWELL_SCALE: Layout
LAYOUT_BLACKWELL_SHUFFLED_VALUE: Layout
LAYOUT_BLACKWELL_VALUE: Layout
LAYOUT_HOPPER_SCALE: Layout
LAYOUT_HOPPER_VALUE: Layout
LAYOUT_UNSPECIFIED: Layout
MOE_DTYPE_BFLOAT16: MoeDType
MOE_DTYPE_FLOAT32: MoeDType
MOE_DTYPE_UINT8: MoeDType
MOE_DTYPE_UNSPECIFIED: MoeDType
QUANTIZE_DTYPE_BFLOAT16: QuantizeDType
QUANTIZE_DTYPE_FLOAT16: QuantizeDType
QUANTIZE_DTYPE_FLOAT32: QuantizeDType
QUANTIZE_DTYPE_UNSPECIFIED: QuantizeDType
QUANTIZE_LAYOUT_BLACKWELL: QuantizeLayout
QUANTIZE_LAYOUT_BLACKWELL_SHUFFLED: QuantizeLayout
QUANTIZE_LAYOUT_CANONICAL: QuantizeLayout
QUANTIZE_LAYOUT_HOPPER: QuantizeLayout
QUANTIZE_LAYOUT_TRTLLM_W13: QuantizeLayout
QUANTIZE_LAYOUT_TRTLLM_W2: QuantizeLayout
QUANTIZE_LAYOUT_UNSPECIFIED: QuantizeLayout
SCALE_ROUNDING_DOWN: ScaleRounding
SCALE_ROUNDING_UNSPECIFIED: ScaleRounding
SCALE_ROUNDING_UP: ScaleRounding
VMM_HANDLE_TYPE_FABRIC: VmmHandleType
VMM_HANDLE_TYPE_POSIX_FD: VmmHandleType
VMM_HANDLE_TYPE_UNSPECIFIED: VmmHandleType

class AttachWeightsRequest(_message.Message):
    __slots__ = ["name"]
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class AttachWeightsResponse(_message.Message):
    __slots__ = ["attachment_id", "ipc_handle", "manifest", "shm_path", "vmm"]
    ATTACHMENT_ID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    VMM_FIELD_NUMBER: _ClassVar[int]
    attachment_id: int
    ipc_handle: bytes
    manifest: WeightManifest
    shm_path: str
    vmm: WeightVmmHandle
    def __init__(self, attachment_id: _Optional[int] = ..., manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., shm_path: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., vmm: _Optional[_Union[WeightVmmHandle, _Mapping]] = ...) -> None: ...

class BatchItem(_message.Message):
    __slots__ = ["convert", "moe", "quantize"]
    CONVERT_FIELD_NUMBER: _ClassVar[int]
    MOE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    convert: ConvertItem
    moe: MoeItem
    quantize: QuantizeItem
    def __init__(self, convert: _Optional[_Union[ConvertItem, _Mapping]] = ..., moe: _Optional[_Union[MoeItem, _Mapping]] = ..., quantize: _Optional[_Union[QuantizeItem, _Mapping]] = ...) -> None: ...

class BatchItemResult(_message.Message):
    __slots__ = ["engine", "kernel_seconds", "outputs"]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    kernel_seconds: float
    outputs: _containers.RepeatedCompositeFieldContainer[TensorResult]
    def __init__(self, outputs: _Optional[_Iterable[_Union[TensorResult, _Mapping]]] = ..., engine: _Optional[str] = ..., kernel_seconds: _Optional[float] = ...) -> None: ...

class BlackwellParams(_message.Message):
    __slots__ = ["block_k", "block_n"]
    BLOCK_K_FIELD_NUMBER: _ClassVar[int]
    BLOCK_N_FIELD_NUMBER: _ClassVar[int]
    block_k: int
    block_n: int
    def __init__(self, block_k: _Optional[int] = ..., block_n: _Optional[int] = ...) -> None: ...

class ConversionSpec(_message.Message):
    __slots__ = ["blackwell", "blackwell_to", "direction", "hopper", "hopper_scale", "layout", "packing_axis"]
    BLACKWELL_FIELD_NUMBER: _ClassVar[int]
    BLACKWELL_TO_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    HOPPER_FIELD_NUMBER: _ClassVar[int]
    HOPPER_SCALE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PACKING_AXIS_FIELD_NUMBER: _ClassVar[int]
    blackwell: BlackwellParams
    blackwell_to: BlackwellParams
    direction: Direction
    hopper: HopperValueParams
    hopper_scale: HopperScaleParams
    layout: Layout
    packing_axis: int
    def __init__(self, layout: _Optional[_Union[Layout, str]] = ..., direction: _Optional[_Union[Direction, str]] = ..., hopper: _Optional[_Union[HopperValueParams, _Mapping]] = ..., blackwell: _Optional[_Union[BlackwellParams, _Mapping]] = ..., blackwell_to: _Optional[_Union[BlackwellParams, _Mapping]] = ..., hopper_scale: _Optional[_Union[HopperScaleParams, _Mapping]] = ..., packing_axis: _Optional[int] = ...) -> None: ...

class ConvertBatchRequest(_message.Message):
    __slots__ = ["answer_when", "device_uuid", "items", "signal_when_done", "wait_for"]
    ANSWER_WHEN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_WHEN_DONE_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_FIELD_NUMBER: _ClassVar[int]
    answer_when: AnswerWhen
    device_uuid: bytes
    items: _containers.RepeatedCompositeFieldContainer[BatchItem]
    signal_when_done: _containers.RepeatedCompositeFieldContainer[Fence]
    wait_for: Fence
    def __init__(self, items: _Optional[_Iterable[_Union[BatchItem, _Mapping]]] = ..., device_uuid: _Optional[bytes] = ..., wait_for: _Optional[_Union[Fence, _Mapping]] = ..., signal_when_done: _Optional[_Iterable[_Union[Fence, _Mapping]]] = ..., answer_when: _Optional[_Union[AnswerWhen, str]] = ...) -> None: ...

class ConvertBatchResponse(_message.Message):
    __slots__ = ["items", "peak_extra_device_bytes"]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PEAK_EXTRA_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[BatchItemResult]
    peak_extra_device_bytes: int
    def __init__(self, items: _Optional[_Iterable[_Union[BatchItemResult, _Mapping]]] = ..., peak_extra_device_bytes: _Optional[int] = ...) -> None: ...

class ConvertBatchesResponse(_message.Message):
    __slots__ = ["batch", "code", "index", "message", "request_id"]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    batch: ConvertBatchResponse
    code: int
    index: int
    message: str
    request_id: int
    def __init__(self, index: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., batch: _Optional[_Union[ConvertBatchResponse, _Mapping]] = ..., request_id: _Optional[int] = ...) -> None: ...

class ConvertItem(_message.Message):
    __slots__ = ["destination", "logical_shape", "source", "spec"]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    destination: TensorDestination
    logical_shape: _containers.RepeatedScalarFieldContainer[int]
    source: TensorSource
    spec: ConversionSpec
    def __init__(self, spec: _Optional[_Union[ConversionSpec, _Mapping]] = ..., logical_shape: _Optional[_Iterable[int]] = ..., source: _Optional[_Union[TensorSource, _Mapping]] = ..., destination: _Optional[_Union[TensorDestination, _Mapping]] = ...) -> None: ...

class ConvertRequest(_message.Message):
    __slots__ = ["destination_ipc", "device_uuid", "logical_shape", "source_bytes", "source_ipc", "source_strides", "spec"]
    DESTINATION_IPC_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_IPC_FIELD_NUMBER: _ClassVar[int]
    SOURCE_STRIDES_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    destination_ipc: CudaIpcBuffer
    device_uuid: bytes
    logical_shape: _containers.RepeatedScalarFieldContainer[int]
    source_bytes: bytes
    source_ipc: CudaIpcBuffer
    source_strides: _containers.RepeatedScalarFieldContainer[int]
    spec: ConversionSpec
    def __init__(self, spec: _Optional[_Union[ConversionSpec, _Mapping]] = ..., logical_shape: _Optional[_Iterable[int]] = ..., source_bytes: _Optional[bytes] = ..., source_ipc: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ..., destination_ipc: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ..., device_uuid: _Optional[bytes] = ..., source_strides: _Optional[_Iterable[int]] = ...) -> None: ...

class ConvertResponse(_message.Message):
    __slots__ = ["engine", "identity", "output_bytes", "output_bytes_inline", "output_shape", "output_strides", "peak_extra_device_bytes"]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_INLINE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_STRIDES_FIELD_NUMBER: _ClassVar[int]
    PEAK_EXTRA_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    engine: str
    identity: LayoutIdentity
    output_bytes: int
    output_bytes_inline: bytes
    output_shape: _containers.RepeatedScalarFieldContainer[int]
    output_strides: _containers.RepeatedScalarFieldContainer[int]
    peak_extra_device_bytes: int
    def __init__(self, output_bytes_inline: _Optional[bytes] = ..., output_shape: _Optional[_Iterable[int]] = ..., output_strides: _Optional[_Iterable[int]] = ..., output_bytes: _Optional[int] = ..., engine: _Optional[str] = ..., peak_extra_device_bytes: _Optional[int] = ..., identity: _Optional[_Union[LayoutIdentity, _Mapping]] = ...) -> None: ...

class ConvertStreamRequest(_message.Message):
    __slots__ = ["chunk", "header"]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    chunk: DataChunk
    header: StreamRequestHeader
    def __init__(self, header: _Optional[_Union[StreamRequestHeader, _Mapping]] = ..., chunk: _Optional[_Union[DataChunk, _Mapping]] = ...) -> None: ...

class ConvertStreamResponse(_message.Message):
    __slots__ = ["chunk", "header"]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    chunk: DataChunk
    header: StreamResponseHeader
    def __init__(self, header: _Optional[_Union[StreamResponseHeader, _Mapping]] = ..., chunk: _Optional[_Union[DataChunk, _Mapping]] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ["device_uuid", "handle", "offset", "size", "strides", "vmm"]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    VMM_FIELD_NUMBER: _ClassVar[int]
    device_uuid: bytes
    handle: bytes
    offset: int
    size: int
    strides: _containers.RepeatedScalarFieldContainer[int]
    vmm: CudaVmmBuffer
    def __init__(self, handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., device_uuid: _Optional[bytes] = ..., strides: _Optional[_Iterable[int]] = ..., vmm: _Optional[_Union[CudaVmmBuffer, _Mapping]] = ...) -> None: ...

class CudaVmmBuffer(_message.Message):
    __slots__ = ["chunks", "granularity", "handle_type", "pid"]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    GRANULARITY_FIELD_NUMBER: _ClassVar[int]
    HANDLE_TYPE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[VmmChunk]
    granularity: int
    handle_type: VmmHandleType
    pid: int
    def __init__(self, handle_type: _Optional[_Union[VmmHandleType, str]] = ..., pid: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[VmmChunk, _Mapping]]] = ..., granularity: _Optional[int] = ...) -> None: ...

class DataChunk(_message.Message):
    __slots__ = ["data", "offset"]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DetachWeightsRequest(_message.Message):
    __slots__ = ["attachment_id"]
    ATTACHMENT_ID_FIELD_NUMBER: _ClassVar[int]
    attachment_id: int
    def __init__(self, attachment_id: _Optional[int] = ...) -> None: ...

class DetachWeightsResponse(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ["allocated_bytes", "compute_capability_major", "compute_capability_minor", "import_capabilities", "in_flight", "name", "ordinal", "streams", "total_memory_bytes", "uuid", "warm"]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_MAJOR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_MINOR_FIELD_NUMBER: _ClassVar[int]
    IMPORT_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    allocated_bytes: int
    compute_capability_major: int
    compute_capability_minor: int
    import_capabilities: ImportCapabilities
    in_flight: int
    name: str
    ordinal: int
    streams: int
    total_memory_bytes: int
    uuid: bytes
    warm: bool
    def __init__(self, uuid: _Optional[bytes] = ..., name: _Optional[str] = ..., ordinal: _Optional[int] = ..., compute_capability_major: _Optional[int] = ..., compute_capability_minor: _Optional[int] = ..., total_memory_bytes: _Optional[int] = ..., warm: bool = ..., streams: _Optional[int] = ..., in_flight: _Optional[int] = ..., allocated_bytes: _Optional[int] = ..., import_capabilities: _Optional[_Union[ImportCapabilities, _Mapping]] = ...) -> None: ...

class DropWeightsRequest(_message.Message):
    __slots__ = ["force", "name"]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    force: bool
    name: str
    def __init__(self, name: _Optional[str] = ..., force: bool = ...) -> None: ...

class DropWeightsResponse(_message.Message):
    __slots__ = ["freed_bytes"]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...

class Fence(_message.Message):
    __slots__ = ["event", "word"]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    WORD_FIELD_NUMBER: _ClassVar[int]
    event: IpcEventRef
    word: FenceWord
    def __init__(self, event: _Optional[_Union[IpcEventRef, _Mapping]] = ..., word: _Optional[_Union[FenceWord, _Mapping]] = ...) -> None: ...

class FenceWord(_message.Message):
    __slots__ = ["buffer", "host_word", "value"]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    HOST_WORD_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    buffer: CudaIpcBuffer
    host_word: SharedHostWord
    value: int
    def __init__(self, buffer: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ..., host_word: _Optional[_Union[SharedHostWord, _Mapping]] = ..., value: _Optional[int] = ...) -> None: ...

class HopperScaleParams(_message.Message):
    __slots__ = ["align_k", "mx_axis", "num_warps"]
    ALIGN_K_FIELD_NUMBER: _ClassVar[int]
    MX_AXIS_FIELD_NUMBER: _ClassVar[int]
    NUM_WARPS_FIELD_NUMBER: _ClassVar[int]
    align_k: int
    mx_axis: int
    num_warps: int
    def __init__(self, mx_axis: _Optional[int] = ..., num_warps: _Optional[int] = ..., align_k: _Optional[int] = ...) -> None: ...

class HopperValueParams(_message.Message):
    __slots__ = ["mma_version", "mx_axis"]
    MMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    MX_AXIS_FIELD_NUMBER: _ClassVar[int]
    mma_version: int
    mx_axis: int
    def __init__(self, mx_axis: _Optional[int] = ..., mma_version: _Optional[int] = ...) -> None: ...

class ImportCapabilities(_message.Message):
    __slots__ = ["fabric", "legacy_ipc", "posix_fd"]
    FABRIC_FIELD_NUMBER: _ClassVar[int]
    LEGACY_IPC_FIELD_NUMBER: _ClassVar[int]
    POSIX_FD_FIELD_NUMBER: _ClassVar[int]
    fabric: bool
    legacy_ipc: bool
    posix_fd: bool
    def __init__(self, legacy_ipc: bool = ..., posix_fd: bool = ..., fabric: bool = ...) -> None: ...

class IpcEventRef(_message.Message):
    __slots__ = ["device_uuid", "handle"]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    device_uuid: bytes
    handle: bytes
    def __init__(self, handle: _Optional[bytes] = ..., device_uuid: _Optional[bytes] = ...) -> None: ...

class IpcHandleRef(_message.Message):
    __slots__ = ["device_uuid", "handle", "vmm"]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    VMM_FIELD_NUMBER: _ClassVar[int]
    device_uuid: bytes
    handle: bytes
    vmm: CudaVmmBuffer
    def __init__(self, handle: _Optional[bytes] = ..., device_uuid: _Optional[bytes] = ..., vmm: _Optional[_Union[CudaVmmBuffer, _Mapping]] = ...) -> None: ...

class LayoutIdentity(_message.Message):
    __slots__ = ["contract_version", "conversion", "layout"]
    CONTRACT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONVERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    contract_version: int
    conversion: str
    layout: str
    def __init__(self, layout: _Optional[str] = ..., conversion: _Optional[str] = ..., contract_version: _Optional[int] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ["cpu_engine", "cpu_threads", "devices"]
    CPU_ENGINE_FIELD_NUMBER: _ClassVar[int]
    CPU_THREADS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    cpu_engine: bool
    cpu_threads: int
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., cpu_engine: bool = ..., cpu_threads: _Optional[int] = ...) -> None: ...

class ListWeightsRequest(_message.Message):
    __slots__ = ["with_tensors"]
    WITH_TENSORS_FIELD_NUMBER: _ClassVar[int]
    with_tensors: bool
    def __init__(self, with_tensors: bool = ...) -> None: ...

class ListWeightsResponse(_message.Message):
    __slots__ = ["budget_bytes", "resident_bytes", "sets"]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SETS_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    resident_bytes: int
    sets: _containers.RepeatedCompositeFieldContainer[WeightSetInfo]
    def __init__(self, sets: _Optional[_Iterable[_Union[WeightSetInfo, _Mapping]]] = ..., budget_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ["device_index", "device_uuid", "name", "path", "rules", "vmm"]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    VMM_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    device_uuid: bytes
    name: str
    path: str
    rules: _containers.RepeatedCompositeFieldContainer[WeightRule]
    vmm: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rules: _Optional[_Iterable[_Union[WeightRule, _Mapping]]] = ..., device_uuid: _Optional[bytes] = ..., device_index: _Optional[int] = ..., vmm: bool = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ["bytes_done", "bytes_total", "load_seconds", "manifest", "tensors_done", "tensors_total"]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TENSORS_DONE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    load_seconds: float
    manifest: WeightManifest
    tensors_done: int
    tensors_total: int
    def __init__(self, tensors_done: _Optional[int] = ..., tensors_total: _Optional[int] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class MoeIdentity(_message.Message):
    __slots__ = ["contract_version", "description", "format", "op", "params"]
    CONTRACT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    contract_version: int
    description: str
    format: str
    op: str
    params: MoeParams
    def __init__(self, format: _Optional[str] = ..., op: _Optional[str] = ..., params: _Optional[_Union[MoeParams, _Mapping]] = ..., contract_version: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...

class MoeInput(_message.Message):
    __slots__ = ["dtype", "name", "shape", "source"]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    dtype: MoeDType
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    source: TensorSource
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[MoeDType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., source: _Optional[_Union[TensorSource, _Mapping]] = ...) -> None: ...

class MoeItem(_message.Message):
    __slots__ = ["inputs", "op", "outputs", "params"]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[MoeInput]
    op: str
    outputs: _containers.RepeatedCompositeFieldContainer[MoeOutput]
    params: MoeParams
    def __init__(self, op: _Optional[str] = ..., params: _Optional[_Union[MoeParams, _Mapping]] = ..., inputs: _Optional[_Iterable[_Union[MoeInput, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[MoeOutput, _Mapping]]] = ...) -> None: ...

class MoeOutput(_message.Message):
    __slots__ = ["destination", "name"]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    destination: TensorDestination
    name: str
    def __init__(self, name: _Optional[str] = ..., destination: _Optional[_Union[TensorDestination, _Mapping]] = ...) -> None: ...

class MoeParams(_message.Message):
    __slots__ = ["align", "align_h", "align_i", "axis", "block_k", "epilogue_tile_m", "format", "gated", "num_elts_per_sf"]
    ALIGN_FIELD_NUMBER: _ClassVar[int]
    ALIGN_H_FIELD_NUMBER: _ClassVar[int]
    ALIGN_I_FIELD_NUMBER: _ClassVar[int]
    AXIS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_K_FIELD_NUMBER: _ClassVar[int]
    EPILOGUE_TILE_M_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    GATED_FIELD_NUMBER: _ClassVar[int]
    NUM_ELTS_PER_SF_FIELD_NUMBER: _ClassVar[int]
    align: int
    align_h: int
    align_i: int
    axis: int
    block_k: int
    epilogue_tile_m: int
    format: str
    gated: bool
    num_elts_per_sf: int
    def __init__(self, format: _Optional[str] = ..., gated: bool = ..., align_h: _Optional[int] = ..., align_i: _Optional[int] = ..., block_k: _Optional[int] = ..., axis: _Optional[int] = ..., epilogue_tile_m: _Optional[int] = ..., num_elts_per_sf: _Optional[int] = ..., align: _Optional[int] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ["input_buffer_bytes", "input_strides", "logical_shape", "spec"]
    INPUT_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_STRIDES_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    input_buffer_bytes: int
    input_strides: _containers.RepeatedScalarFieldContainer[int]
    logical_shape: _containers.RepeatedScalarFieldContainer[int]
    spec: ConversionSpec
    def __init__(self, spec: _Optional[_Union[ConversionSpec, _Mapping]] = ..., logical_shape: _Optional[_Iterable[int]] = ..., input_strides: _Optional[_Iterable[int]] = ..., input_buffer_bytes: _Optional[int] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ["description", "identity", "input_bytes", "input_shape", "input_strides", "output_bytes", "output_shape", "output_strides"]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    INPUT_STRIDES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_STRIDES_FIELD_NUMBER: _ClassVar[int]
    description: str
    identity: LayoutIdentity
    input_bytes: int
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    input_strides: _containers.RepeatedScalarFieldContainer[int]
    output_bytes: int
    output_shape: _containers.RepeatedScalarFieldContainer[int]
    output_strides: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, input_shape: _Optional[_Iterable[int]] = ..., input_strides: _Optional[_Iterable[int]] = ..., input_bytes: _Optional[int] = ..., output_shape: _Optional[_Iterable[int]] = ..., output_strides: _Optional[_Iterable[int]] = ..., output_bytes: _Optional[int] = ..., description: _Optional[str] = ..., identity: _Optional[_Union[LayoutIdentity, _Mapping]] = ...) -> None: ...

class QuantizeItem(_message.Message):
    __slots__ = ["align", "bias", "bias_dtype", "bias_out", "blackwell", "dtype", "hopper", "hopper_scale", "layout", "scale_rounding", "scales", "shape", "source", "values"]
    ALIGN_FIELD_NUMBER: _ClassVar[int]
    BIAS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    BIAS_OUT_FIELD_NUMBER: _ClassVar[int]
    BLACKWELL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HOPPER_FIELD_NUMBER: _ClassVar[int]
    HOPPER_SCALE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    SCALE_ROUNDING_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    align: int
    bias: TensorSource
    bias_dtype: QuantizeDType
    bias_out: TensorDestination
    blackwell: BlackwellParams
    dtype: QuantizeDType
    hopper: HopperValueParams
    hopper_scale: HopperScaleParams
    layout: QuantizeLayout
    scale_rounding: ScaleRounding
    scales: TensorDestination
    shape: _containers.RepeatedScalarFieldContainer[int]
    source: TensorSource
    values: TensorDestination
    def __init__(self, dtype: _Optional[_Union[QuantizeDType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., scale_rounding: _Optional[_Union[ScaleRounding, str]] = ..., layout: _Optional[_Union[QuantizeLayout, str]] = ..., source: _Optional[_Union[TensorSource, _Mapping]] = ..., values: _Optional[_Union[TensorDestination, _Mapping]] = ..., scales: _Optional[_Union[TensorDestination, _Mapping]] = ..., hopper: _Optional[_Union[HopperValueParams, _Mapping]] = ..., hopper_scale: _Optional[_Union[HopperScaleParams, _Mapping]] = ..., align: _Optional[int] = ..., bias: _Optional[_Union[TensorSource, _Mapping]] = ..., bias_dtype: _Optional[_Union[QuantizeDType, str]] = ..., bias_out: _Optional[_Union[TensorDestination, _Mapping]] = ..., blackwell: _Optional[_Union[BlackwellParams, _Mapping]] = ...) -> None: ...

class RegisterIpcHandlesRequest(_message.Message):
    __slots__ = ["handles"]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[IpcHandleRef]
    def __init__(self, handles: _Optional[_Iterable[_Union[IpcHandleRef, _Mapping]]] = ...) -> None: ...

class RegisterIpcHandlesResponse(_message.Message):
    __slots__ = ["allocation_bytes", "already_open"]
    ALLOCATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALREADY_OPEN_FIELD_NUMBER: _ClassVar[int]
    allocation_bytes: _containers.RepeatedScalarFieldContainer[int]
    already_open: int
    def __init__(self, allocation_bytes: _Optional[_Iterable[int]] = ..., already_open: _Optional[int] = ...) -> None: ...

class ReleaseIpcHandlesRequest(_message.Message):
    __slots__ = ["handles"]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[IpcHandleRef]
    def __init__(self, handles: _Optional[_Iterable[_Union[IpcHandleRef, _Mapping]]] = ...) -> None: ...

class ReleaseIpcHandlesResponse(_message.Message):
    __slots__ = ["deferred", "released"]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    deferred: int
    released: int
    def __init__(self, released: _Optional[int] = ..., deferred: _Optional[int] = ...) -> None: ...

class SharedHostWord(_message.Message):
    __slots__ = ["name", "offset"]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class StreamRequestHeader(_message.Message):
    __slots__ = ["device_uuid", "logical_shape", "spec"]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    device_uuid: bytes
    logical_shape: _containers.RepeatedScalarFieldContainer[int]
    spec: ConversionSpec
    def __init__(self, spec: _Optional[_Union[ConversionSpec, _Mapping]] = ..., logical_shape: _Optional[_Iterable[int]] = ..., device_uuid: _Optional[bytes] = ...) -> None: ...

class StreamResponseHeader(_message.Message):
    __slots__ = ["engine", "identity", "input_bytes", "output_bytes", "output_shape", "output_strides"]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_STRIDES_FIELD_NUMBER: _ClassVar[int]
    engine: str
    identity: LayoutIdentity
    input_bytes: int
    output_bytes: int
    output_shape: _containers.RepeatedScalarFieldContainer[int]
    output_strides: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, output_shape: _Optional[_Iterable[int]] = ..., output_strides: _Optional[_Iterable[int]] = ..., output_bytes: _Optional[int] = ..., input_bytes: _Optional[int] = ..., engine: _Optional[str] = ..., identity: _Optional[_Union[LayoutIdentity, _Mapping]] = ...) -> None: ...

class TensorDestination(_message.Message):
    __slots__ = ["ipc"]
    IPC_FIELD_NUMBER: _ClassVar[int]
    ipc: CudaIpcBuffer
    def __init__(self, ipc: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ...) -> None: ...

class TensorResult(_message.Message):
    __slots__ = ["bytes", "dtype", "identity", "inline_bytes", "moe_identity", "name", "shape", "strides"]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    INLINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MOE_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    dtype: MoeDType
    identity: LayoutIdentity
    inline_bytes: bytes
    moe_identity: MoeIdentity
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    strides: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., strides: _Optional[_Iterable[int]] = ..., bytes: _Optional[int] = ..., inline_bytes: _Optional[bytes] = ..., identity: _Optional[_Union[LayoutIdentity, _Mapping]] = ..., name: _Optional[str] = ..., moe_identity: _Optional[_Union[MoeIdentity, _Mapping]] = ..., dtype: _Optional[_Union[MoeDType, str]] = ...) -> None: ...

class TensorSource(_message.Message):
    __slots__ = ["inline_bytes", "inline_strides", "ipc"]
    INLINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INLINE_STRIDES_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    inline_bytes: bytes
    inline_strides: _containers.RepeatedScalarFieldContainer[int]
    ipc: CudaIpcBuffer
    def __init__(self, inline_bytes: _Optional[bytes] = ..., ipc: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ..., inline_strides: _Optional[_Iterable[int]] = ...) -> None: ...

class VmmChunk(_message.Message):
    __slots__ = ["fabric_handle", "fd", "size"]
    FABRIC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    fabric_handle: bytes
    fd: int
    size: int
    def __init__(self, fd: _Optional[int] = ..., fabric_handle: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ["device_uuid", "name", "path", "source_checksum", "tensors", "total_bytes", "vmm"]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    VMM_FIELD_NUMBER: _ClassVar[int]
    device_uuid: bytes
    name: str
    path: str
    source_checksum: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[WeightTensor]
    total_bytes: int
    vmm: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[WeightTensor, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., source_checksum: _Optional[bytes] = ..., device_uuid: _Optional[bytes] = ..., vmm: bool = ...) -> None: ...

class WeightPreload(_message.Message):
    __slots__ = ["sets"]
    SETS_FIELD_NUMBER: _ClassVar[int]
    sets: _containers.RepeatedCompositeFieldContainer[LoadWeightsRequest]
    def __init__(self, sets: _Optional[_Iterable[_Union[LoadWeightsRequest, _Mapping]]] = ...) -> None: ...

class WeightRule(_message.Message):
    __slots__ = ["checkpoint", "convert", "pattern", "slice", "verbatim"]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CONVERT_FIELD_NUMBER: _ClassVar[int]
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    VERBATIM_FIELD_NUMBER: _ClassVar[int]
    checkpoint: bool
    convert: ConversionSpec
    pattern: str
    slice: WeightSlice
    verbatim: bool
    def __init__(self, pattern: _Optional[str] = ..., convert: _Optional[_Union[ConversionSpec, _Mapping]] = ..., verbatim: bool = ..., slice: _Optional[_Union[WeightSlice, _Mapping]] = ..., checkpoint: bool = ...) -> None: ...

class WeightSetInfo(_message.Message):
    __slots__ = ["attachments", "manifest"]
    ATTACHMENTS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    attachments: int
    manifest: WeightManifest
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., attachments: _Optional[int] = ...) -> None: ...

class WeightSlice(_message.Message):
    __slots__ = ["axis", "length", "start"]
    AXIS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    axis: int
    length: int
    start: int
    def __init__(self, axis: _Optional[int] = ..., start: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class WeightTensor(_message.Message):
    __slots__ = ["bytes", "dtype", "identity", "name", "offset", "rule", "shape", "slice", "strides"]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    dtype: str
    identity: LayoutIdentity
    name: str
    offset: int
    rule: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    slice: WeightSlice
    strides: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., strides: _Optional[_Iterable[int]] = ..., bytes: _Optional[int] = ..., offset: _Optional[int] = ..., identity: _Optional[_Union[LayoutIdentity, _Mapping]] = ..., rule: _Optional[int] = ..., slice: _Optional[_Union[WeightSlice, _Mapping]] = ...) -> None: ...

class WeightVmmHandle(_message.Message):
    __slots__ = ["token"]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    def __init__(self, token: _Optional[bytes] = ...) -> None: ...

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class VmmHandleType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class QuantizeDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class ScaleRounding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class QuantizeLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class MoeDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class AnswerWhen(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
