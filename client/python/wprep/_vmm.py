"""CUDA virtual-memory (cuMem) tensors as wprep.v1.CudaIpcBuffer with a CudaVmmBuffer.

cudaIpcGetMemHandle cannot export memory made with cuMemCreate + cuMemMap: torch's expandable
segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) and cuMem pools such as vLLM's
CuMemAllocator. wprepd maps such memory from the shareable handles of its physical chunks
(one POSIX file descriptor per chunk, which it takes from this process with pidfd_getfd, or a
fabric handle), on its Unix socket only, and only from the process that owns the descriptors.

Two sources of handles:
- torch's expandable segments: `untyped_storage()._share_cuda_()` returns an 8-tuple whose
  handle is a version byte, the kind b"e" (SHAREABLE_CUDA_EXPANDABLE_SEGMENT), then what
  c10/cuda/CUDACachingAllocator.cpp's ExpandableSegment::share writes: a header
  {pid_t pid; (4 bytes padding) size_t segment_size; size_t num_handles} in native byte order,
  then per chunk an int file descriptor (POSIX_FD, the default
  expandable_segments_handle_type) or a 64-byte CUmemFabricHandle (FABRIC_HANDLE). The chunks
  are those of the segment around the block, each segment_size bytes, and the tuple's offset is
  the storage's offset from the first of them. torch keeps the descriptors open while the
  segment lives, so the daemon can take them as often as it needs.
- any cuMem mapping (export_cumem): the driver's cuMemRetainAllocationHandle and
  cuMemExportToShareableHandle through libcuda, chunk by chunk over the mapped range.

The client sends these for every CUDA tensor whose memory they describe (_cuda/ipc.py's
share_storage): the drop-in, convert / convert_batch, trtllm and quantize_mxfp4 alike.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .v1 import wprep_pb2 as pb

KIND_EXPANDABLE = b"e"
_KNOWN_VERSIONS = (1, 2)
_HEADER = struct.Struct("=i4xQQ")  # pid_t pid; padding; size_t segment_size; size_t num_handles
_FD = struct.Struct("=i")
FABRIC_HANDLE_BYTES = 64
# cuMem's granularity on every GPU wprep serves (cuMemGetAllocationGranularity, minimum and
# recommended): chunks are multiples of it.
DEFAULT_GRANULARITY = 2 << 20


class VmmHandleError(ValueError):
    """A handle that is not a CUDA virtual-memory handle wprep can send."""


@dataclass(frozen=True)
class ExpandableHandle:
    """torch's expandable-segment handle, parsed."""

    pid: int
    segment_size: int
    fds: Tuple[int, ...] = ()  # POSIX_FD: one per chunk
    fabric_handles: Tuple[bytes, ...] = ()  # FABRIC: one per chunk

    @property
    def num_chunks(self) -> int:
        return len(self.fds) or len(self.fabric_handles)


def parse_expandable_handle(handle: bytes, fabric: Optional[bool] = None) -> ExpandableHandle:
    """Parses the handle _share_cuda_ returns for an expandable segment.

    `fabric`: whether torch exported fabric handles (expandable_segments_handle_type); None
    tells from the handle's length, which differs for every chunk count above zero.
    """
    if len(handle) < 2 + _HEADER.size:
        raise VmmHandleError(f"an expandable-segment handle has at least {2 + _HEADER.size} bytes, got {len(handle)}")
    if handle[0] not in _KNOWN_VERSIONS or handle[1:2] != KIND_EXPANDABLE:
        raise VmmHandleError(
            f"not an expandable-segment handle: version byte {handle[:1].hex()}, kind {handle[1:2]!r} "
            f"(expected version {'/'.join(map(str, _KNOWN_VERSIONS))} and kind b'e')"
        )
    pid, segment_size, n = _HEADER.unpack_from(handle, 2)
    body = handle[2 + _HEADER.size:]
    if n <= 0 or segment_size <= 0:
        raise VmmHandleError(f"expandable-segment handle with {n} chunks of {segment_size} bytes")
    if fabric is None:
        if len(body) == n * _FD.size:
            fabric = False
        elif len(body) == n * FABRIC_HANDLE_BYTES:
            fabric = True
        else:
            raise VmmHandleError(f"expandable-segment handle of {n} chunks has {len(body)} bytes after its header")
    per = FABRIC_HANDLE_BYTES if fabric else _FD.size
    if len(body) != n * per:
        raise VmmHandleError(f"expandable-segment handle of {n} chunks has {len(body)} bytes after its header, not {n * per}")
    if fabric:
        return ExpandableHandle(pid, segment_size, fabric_handles=tuple(body[i * per:(i + 1) * per] for i in range(n)))
    return ExpandableHandle(pid, segment_size, fds=tuple(_FD.unpack_from(body, i * per)[0] for i in range(n)))


def granularity_of(chunk_size: int) -> int:
    """The granularity to declare for chunks of `chunk_size` bytes: the largest power of two
    dividing it, at most DEFAULT_GRANULARITY."""
    if chunk_size <= 0:
        raise VmmHandleError(f"chunk size {chunk_size}")
    return min(chunk_size & -chunk_size, DEFAULT_GRANULARITY)


def vmm_buffer(
    *,
    pid: int,
    chunk_sizes: Sequence[int],
    offset: int,
    size: int,
    device_uuid: bytes,
    fds: Sequence[int] = (),
    fabric_handles: Sequence[bytes] = (),
    granularity: Optional[int] = None,
    strides: Sequence[int] = (),
) -> pb.CudaIpcBuffer:
    """A CudaIpcBuffer naming a cuMem allocation by its chunks (fds or fabric handles)."""
    if bool(fds) == bool(fabric_handles):
        raise VmmHandleError("give the chunks' fds or their fabric handles")
    handles: Sequence[Any] = fds or fabric_handles
    if len(handles) != len(chunk_sizes):
        raise VmmHandleError(f"{len(handles)} handles for {len(chunk_sizes)} chunk sizes")
    if granularity is None:
        granularity = min(granularity_of(s) for s in chunk_sizes)
    b = pb.CudaIpcBuffer(offset=offset, size=size, device_uuid=device_uuid, strides=list(strides))
    v = b.vmm
    v.handle_type = pb.VMM_HANDLE_TYPE_POSIX_FD if fds else pb.VMM_HANDLE_TYPE_FABRIC
    v.pid = pid if fds else 0
    v.granularity = granularity
    for h, s in zip(handles, chunk_sizes):
        c = v.chunks.add(size=s)
        if fds:
            c.fd = int(h)
        else:
            c.fabric_handle = bytes(h)
    return b


def buffer_from_expandable(handle: bytes, storage_offset: int, size: int, device_uuid: bytes,
                           strides: Sequence[int] = ()) -> pb.CudaIpcBuffer:
    """The buffer of [storage_offset, storage_offset + size) of an expandable segment, from the
    handle and offset _share_cuda_ returned. The pid in the handle must be this process's: the
    daemon serves descriptors only to the process that holds them."""
    h = parse_expandable_handle(handle)
    if h.fds and h.pid != os.getpid():
        raise VmmHandleError(f"the expandable segment was shared by process {h.pid}, not this one ({os.getpid()})")
    sizes = [h.segment_size] * h.num_chunks
    return vmm_buffer(pid=h.pid, chunk_sizes=sizes, offset=storage_offset, size=size, device_uuid=device_uuid,
                      fds=h.fds, fabric_handles=h.fabric_handles, strides=strides)


def share_expandable(t: Any, device_uuid: bytes) -> pb.CudaIpcBuffer:
    """The buffer of torch tensor `t` (one-byte elements, memory of an expandable segment)."""
    import torch

    storage = t.untyped_storage()
    info = storage._share_cuda_()
    _device, handle, _nbytes, offset, ref_handle, ref_offset, _event, _event_sync = info
    try:
        if handle is None or len(handle) < 2 or handle[1:2] != KIND_EXPANDABLE:
            raise VmmHandleError("the tensor's memory is not from an expandable segment; send it as a legacy IPC handle")
        size = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
        return buffer_from_expandable(handle, int(offset) + t.storage_offset() * t.element_size(), size, device_uuid)
    finally:
        if ref_handle is not None:
            release = getattr(torch.UntypedStorage, "_release_ipc_counter_cuda", None)
            if release is not None:
                release(ref_handle, ref_offset)


# ---------------------------------------------------------------------------------------
# Any cuMem mapping, through the driver.

_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CUDA_SUCCESS = 0


def driver_fn(lib: Any, name: str, argtypes: List[Any]) -> Any:
    """Driver call `name` of libcuda `lib` (its _v2 form where there is one), returning a CUresult."""
    fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


class _Driver:
    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, p = ctypes.c_uint64, ctypes.POINTER
        self.retain = driver_fn(lib, "cuMemRetainAllocationHandle", [p(u64), ctypes.c_void_p])
        self.release = driver_fn(lib, "cuMemRelease", [u64])
        self.export = driver_fn(lib, "cuMemExportToShareableHandle", [ctypes.c_void_p, u64, ctypes.c_int, ctypes.c_ulonglong])
        self.range = driver_fn(lib, "cuMemGetAddressRange", [p(u64), p(ctypes.c_size_t), u64])


_driver: Optional[_Driver] = None
_driver_mu = threading.Lock()
# Chunk base -> (fd, bytes, allocation handle): one export per chunk, so repeated requests
# name the same descriptors and the daemon reuses its mapping. An entry whose allocation
# handle no longer matches what is mapped at its base (the chunk was unmapped and another
# mapped there) is exported afresh. Closed by forget_cumem.
_exported: Dict[int, Tuple[int, int, int]] = {}


def _drv() -> _Driver:
    global _driver
    with _driver_mu:
        if _driver is None:
            _driver = _Driver()
        return _driver


def _check(r: int, what: str) -> None:
    if r != _CUDA_SUCCESS:
        raise VmmHandleError(f"{what} failed with CUresult {r}")


def export_cumem(ptr: int, nbytes: int, device_uuid: bytes) -> pb.CudaIpcBuffer:
    """The buffer of [ptr, ptr + nbytes) of this process's cuMem mappings (made with a
    POSIX_FD-exportable cuMemCreate, as vLLM's CuMemAllocator does), chunk after chunk."""
    d = _drv()
    u64 = ctypes.c_uint64
    first_base = None
    fds: List[int] = []
    sizes: List[int] = []
    at = ptr
    with _driver_mu:
        while at < ptr + max(nbytes, 1):
            base, size = u64(0), ctypes.c_size_t(0)
            _check(d.range(ctypes.byref(base), ctypes.byref(size), at), "cuMemGetAddressRange")
            if first_base is None:
                first_base = base.value
            h = u64(0)
            _check(d.retain(ctypes.byref(h), ctypes.c_void_p(base.value)),
                   "cuMemRetainAllocationHandle (is this cuMem memory?)")
            try:
                cached = _exported.get(base.value)
                if cached is None or cached[1:] != (size.value, h.value):
                    fd = ctypes.c_int(-1)
                    _check(d.export(ctypes.byref(fd), h.value, _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                           "cuMemExportToShareableHandle (was the allocation made with POSIX_FD?)")
                    if cached is not None:
                        os.close(cached[0])
                    _exported[base.value] = (fd.value, size.value, h.value)
            finally:
                d.release(h.value)
            fd_value, chunk, _ = _exported[base.value]
            fds.append(fd_value)
            sizes.append(chunk)
            at = base.value + chunk
    assert first_base is not None
    return vmm_buffer(pid=os.getpid(), chunk_sizes=sizes, offset=ptr - first_base, size=nbytes,
                      device_uuid=device_uuid, fds=fds)


def forget_cumem(ptr: int) -> None:
    """Closes the exported descriptor of the chunk based at `ptr` (call before unmapping it)."""
    with _driver_mu:
        entry = _exported.pop(ptr, None)
    if entry is not None:
        os.close(entry[0])
