"""What the client takes and returns, as plain Python values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, List, Optional, Sequence, Tuple, Union, overload

import numpy as np

from ._spec import LayoutIdentity, Spec
from .v1 import wprep_pb2 as pb

if TYPE_CHECKING:  # torch is optional
    import torch

Shape = Tuple[int, ...]
# bytes in memory order, a uint8 (or other one-byte dtype) numpy array or view, or a torch
# tensor (CUDA: sent as a CUDA IPC buffer; CPU: as bytes).
Source = Union[bytes, bytearray, memoryview, np.ndarray, "torch.Tensor"]


@dataclass(frozen=True)
class Plan:
    """A validated conversion's input and output (wprep.v1.PlanResponse). Sizes in bytes.

    input_shape / input_strides: the storage view the input must have (strides in bytes).
    output_shape / output_strides: the output as the reference implementation reports it
    (Hopper mx_axis=-2 reports a transposed view of row-major memory).
    """

    input_shape: Shape
    input_strides: Shape
    input_bytes: int
    output_shape: Shape
    output_strides: Shape
    output_bytes: int
    description: str
    identity: LayoutIdentity

    @classmethod
    def from_proto(cls, p: pb.PlanResponse) -> "Plan":
        return cls(
            input_shape=tuple(p.input_shape),
            input_strides=tuple(p.input_strides),
            input_bytes=p.input_bytes,
            output_shape=tuple(p.output_shape),
            output_strides=tuple(p.output_strides),
            output_bytes=p.output_bytes,
            description=p.description,
            identity=LayoutIdentity.from_proto(p.identity),
        )


def _strided_view(data: bytes, shape: Shape, strides: Shape) -> np.ndarray:
    flat = np.frombuffer(data, dtype=np.uint8)
    if len(shape) == 0:
        return flat
    if len(strides) != len(shape):
        raise ValueError(f"shape {shape} and strides {strides} differ in rank")
    if any(d == 0 for d in shape):  # nothing is read: any strides fit
        return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides, writeable=False)
    reach = sum((d - 1) * s for d, s in zip(shape, strides))
    if any(s < 0 for s in strides) or reach >= len(flat):
        raise ValueError(f"shape {shape} with strides {strides} does not fit {len(flat)} bytes")
    return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides, writeable=False)


@dataclass(frozen=True)
class Result:
    """One converted tensor.

    shape / strides: the output's storage shape and byte strides, as the reference
    implementation reports them. nbytes: bytes written, always dense in memory order.
    identity: the upstream layout object the bytes equal. engine: "cpu" or "cuda:GPU-...".
    kernel_seconds: engine time of a batch item (0 for Convert). data: the output bytes in
    memory order when it came back inline, else None. tensor: the CUDA output (the caller's
    `out`, or the tensor the client allocated), viewed with shape and strides, else None.
    """

    shape: Shape
    strides: Shape
    nbytes: int
    identity: LayoutIdentity
    engine: str
    kernel_seconds: float = 0.0
    data: Optional[bytes] = None
    tensor: Any = None

    def numpy(self) -> np.ndarray:
        """The inline output as a read-only uint8 array with `shape` and `strides` (no copy)."""
        if self.data is None:
            raise ValueError("this output went to a CUDA tensor (Result.tensor), not inline")
        return _strided_view(self.data, self.shape, self.strides)


@dataclass(frozen=True)
class BatchResult(Sequence[Result]):
    """The results of a ConvertBatch, in request order; indexes like a list."""

    items: List[Result]
    peak_extra_device_bytes: int = 0

    @overload
    def __getitem__(self, i: int) -> Result: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Result]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[Result, Sequence[Result]]:
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Result]:
        return iter(self.items)

    @property
    def kernel_seconds(self) -> float:
        """The sum of the items' engine times."""
        return sum(r.kernel_seconds for r in self.items)


@dataclass
class Item:
    """One conversion of a ConvertBatch.

    source: bytes in memory order (with `strides` for a strided view), a numpy array (a
    non-contiguous view is sent with its own strides), or a torch tensor (CUDA: read in
    place through CUDA IPC, views and slices included).
    out: a CUDA tensor to write the output into, dense, of the plan's output_bytes. None: a
    CUDA source gets an output allocated on its device; other sources get the bytes back.
    """

    spec: Spec
    logical_shape: Sequence[int]
    source: Source
    out: Any = None
    strides: Optional[Sequence[int]] = None


@dataclass(frozen=True)
class Device:
    """A GPU the daemon serves (wprep.v1.DeviceInfo); uuid is the 16-byte identity."""

    uuid: bytes
    name: str
    ordinal: int
    compute_capability: Tuple[int, int]
    total_memory_bytes: int
    warm: bool
    streams: int
    in_flight: int
    allocated_bytes: int

    @property
    def uuid_string(self) -> str:
        """The UUID as nvidia-smi prints it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
        h = self.uuid.hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclass(frozen=True)
class Devices:
    """What serves requests: the GPUs in use and whether the CPU engine serves bytes requests."""

    devices: List[Device] = field(default_factory=list)
    cpu_engine: bool = False
    cpu_threads: int = 0

    @classmethod
    def from_proto(cls, p: pb.ListDevicesResponse) -> "Devices":
        return cls(
            devices=[
                Device(
                    uuid=d.uuid,
                    name=d.name,
                    ordinal=d.ordinal,
                    compute_capability=(d.compute_capability_major, d.compute_capability_minor),
                    total_memory_bytes=d.total_memory_bytes,
                    warm=d.warm,
                    streams=d.streams,
                    in_flight=d.in_flight,
                    allocated_bytes=d.allocated_bytes,
                )
                for d in p.devices
            ],
            cpu_engine=p.cpu_engine,
            cpu_threads=p.cpu_threads,
        )
