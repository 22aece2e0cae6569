"""CUDA tensors as wprep.v1.CudaIpcBuffer: torch's IPC handles, offsets, strides and GPU UUIDs.

torch is imported only when a torch tensor is handed in; the rest of the package needs no torch.

How a tensor becomes a buffer the daemon can open:
- `tensor.untyped_storage()._share_cuda_()` returns an 8-tuple (torch/csrc/StorageSharing.cpp):
  (device index, handle, storage bytes, storage offset in its allocation, ref-counter file,
  ref-counter offset, event handle, event sync required). For memory of torch's caching
  allocator (cudaMalloc segments) the handle is 66 bytes: a version byte (1 or 2), the kind
  b"c" (SHAREABLE_CUDA_MALLOC), then the cudaIpcMemHandle_t of the segment's base; older
  torch returned the 64 bytes alone. Memory of expandable segments is kind b"e": CUDA's
  virtual-memory API (cuMemCreate + cuMemMap), which cudaIpcGetMemHandle cannot export.
  Its handle names the segment's physical chunks by file descriptor (_vmm.py parses it),
  and the buffer goes as a CudaVmmBuffer, which wprepd takes on its Unix socket with
  pidfd_getfd. torch exports each chunk once and hands out the same descriptors on every
  _share_cuda_ of the segment, so the daemon's mapping is reused from call to call; the
  parsed handle is cached here by its bytes.
- Memory torch cannot share at all (a torch that refuses expandable segments, a pluggable
  allocator such as vLLM's CuMemAllocator) is exported through the driver when it is cuMem
  memory made with POSIX-fd handles (_vmm.export_cumem, one descriptor per chunk, kept);
  else ExpandableSegmentsError says what to change.
- The buffer's offset is the storage's offset in the segment plus the view's
  storage_offset() (element size 1); strides are the view's (bytes, for one-byte dtypes).
- _share_cuda_ also registers the storage as "sent": a counter in a shared-memory file that a
  torch consumer decrements when it lets go, without which the block stays out of the caching
  allocator after the tensor dies. The daemon is no torch consumer, so the client decrements it
  right away (torch.UntypedStorage._release_ipc_counter_cuda); the client itself keeps the
  tensors alive until the daemon has answered. Each _share_cuda_ also records an interprocess
  event on the current stream, which the daemon does not use: ordering is the client's
  stream synchronization (Client.convert's `stream`), or, with completion="stream", an
  event of EventPool recorded on that stream, which the daemon waits for on the GPU.
- GPUs are named by UUID (torch.cuda.get_device_properties(i).uuid), never by ordinal.
- One export per allocation (Exports): _share_cuda_ costs an event, an IPC handle and a
  ref-counter entry each time, and a loader's tensors share a few allocations (the caching
  allocator's segments). The CUDA driver names every allocation with a process-wide unique
  id that is never reused (CU_POINTER_ATTRIBUTE_BUFFER_ID) and gives its start address; an
  allocation exported once serves every later storage inside it, at its pointer minus that
  start, with no torch call. A freed and remade allocation has a new id, so nothing stale is
  ever sent. Without the driver (no libcuda, a fake pointer) every storage is exported.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import os
import socket
import struct
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import _vmm
from ..v1 import wprep_pb2 as pb


class ExpandableSegmentsError(ValueError):
    """The tensor's memory is CUDA virtual memory (torch's expandable segments, a cuMem pool)
    that cannot be shared with this daemon; the message says what to change."""


_EXPANDABLE_HELP = (
    "the tensor's memory comes from torch's expandable segments (PYTORCH_CUDA_ALLOC_CONF="
    "expandable_segments:True) or another CUDA virtual-memory allocator, and cannot be exported "
    "here. wprep sends such memory as file descriptors when torch's _share_cuda_ returns an "
    "expandable-segment handle (a torch that shares expandable segments) or when the memory "
    "was made with cuMemCreate for POSIX file descriptors. Otherwise allocate the tensors wprep reads and "
    "writes with expandable segments off, e.g. "
    "torch.cuda.memory._set_allocator_settings('expandable_segments:False') around their "
    "allocation, or send host copies (numpy arrays) instead"
)

VMM_SHARING_HELP = (
    "CUDA virtual memory (torch's expandable segments, cuMem pools) is shared as file "
    "descriptors that wprepd takes from this process with pidfd_getfd, so the client must "
    "connect on the daemon's Unix socket (unix:///...), from the PID namespace the daemon sees "
    "(the same container or pod with shareProcessNamespace, or hostPID on both sides), and the "
    "daemon needs ptrace rights over the client (the same user, or CAP_SYS_PTRACE: "
    "deploy/k8s/sidecar-vmm, deploy/k8s/daemonset-vmm; docs/OPERATIONS.md). Where that cannot "
    "be, allocate these tensors with expandable_segments:False or send host copies"
)

_KNOWN_HANDLE_VERSIONS = (1, 2)


def is_tensor(x: object) -> bool:
    """True for a torch.Tensor (without importing torch when nothing imported it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_cuda_tensor(x: object) -> bool:
    return is_tensor(x) and bool(x.is_cuda)  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=None)
def device_uuid(index: int) -> bytes:
    """The 16-byte UUID of CUDA device `index` of this process."""
    import torch

    u = torch.cuda.get_device_properties(index).uuid
    raw = bytes(u.bytes) if hasattr(u, "bytes") else bytes.fromhex(str(u).replace("GPU-", "").replace("-", ""))
    if len(raw) != 16:
        raise RuntimeError(f"torch reported a {len(raw)}-byte UUID for cuda:{index}")
    return raw


def decode_handle(handle: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside the handle torch's _share_cuda_ returns."""
    if len(handle) == 64:
        return bytes(handle)
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise ExpandableSegmentsError(_EXPANDABLE_HELP)
    if len(handle) == 66 and handle[1:2] == b"c" and handle[0] in _KNOWN_HANDLE_VERSIONS:
        return bytes(handle[2:])
    import torch

    raise RuntimeError(
        f"torch {torch.__version__} returned a CUDA IPC handle wprep does not know: {len(handle)} bytes, "
        f"version byte {handle[:1].hex() or '-'}, kind {handle[1:2]!r} (known: 64 bytes, or version "
        f"{'/'.join(map(str, _KNOWN_HANDLE_VERSIONS))} + b'c' + 64 bytes)"
    )


@dataclass(frozen=True)
class SharedStorage:
    """Where a storage lives for the daemon: its allocation's handle and its offset in it."""

    handle: bytes  # the 64-byte cudaIpcMemHandle_t of the allocation (segment) base; b"" for vmm
    offset: int  # byte offset of the storage's first byte from the allocation's start
    device_uuid: bytes
    device_index: int
    # CUDA virtual memory: the allocation's chunks (shared, never changed), offset counted
    # from the first chunk's start.
    vmm: Optional[pb.CudaVmmBuffer] = None


def _release_ref_counter(ref_handle: Any, ref_offset: Any) -> None:
    import torch

    release = getattr(torch.UntypedStorage, "_release_ipc_counter_cuda", None)
    if release is not None:
        release(ref_handle, ref_offset)


def _expandable_segments_configured() -> bool:
    conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", ""))
    return "expandable_segments:true" in conf.lower().replace(" ", "")


# Set once this process has sent CUDA virtual memory's descriptors: the clients then let
# their daemon ptrace this process where yama asks for that (allow_daemon_ptrace).
vmm_exported = False

# Expandable-segment handles (their bytes) -> their chunks as a CudaVmmBuffer: torch hands out
# the same descriptors for a segment on every _share_cuda_, so the handle repeats call after
# call. Bounded: cleared when full (a parse is cheap; the daemon's mapping does not depend on it).
_VMM_CACHE_ENTRIES = 4096
_vmm_mu = threading.Lock()
_vmm_parsed: Dict[bytes, pb.CudaVmmBuffer] = {}  # guarded by _vmm_mu


def is_expandable_handle(handle: bytes) -> bool:
    """torch's handle of an expandable segment (version byte, then kind b"e")."""
    return len(handle) != 64 and len(handle) >= 2 and handle[1:2] == _vmm.KIND_EXPANDABLE


def expandable_vmm(handle: bytes) -> pb.CudaVmmBuffer:
    """The chunks of an expandable-segment handle (cached by its bytes). The returned message
    is shared: copy it (CopyFrom), never change it."""
    key = bytes(handle)
    with _vmm_mu:
        v = _vmm_parsed.get(key)
    if v is not None:
        return v
    try:
        v = _vmm.buffer_from_expandable(key, 0, 0, b"").vmm
    except _vmm.VmmHandleError as e:
        raise ExpandableSegmentsError(f"torch's expandable-segment handle cannot be sent to wprepd: {e}") from e
    with _vmm_mu:
        if len(_vmm_parsed) >= _VMM_CACHE_ENTRIES:
            _vmm_parsed.clear()
        _vmm_parsed[key] = v
    return v


def _share_cumem(storage: Any, device_index: int) -> Optional[SharedStorage]:
    """`storage` exported through the driver when it is cuMem memory with POSIX-fd handles;
    None when it is not (or no driver is loaded)."""
    try:
        b = _vmm.export_cumem(int(storage.data_ptr()), int(storage.nbytes()), b"")
    except (OSError, AttributeError, _vmm.VmmHandleError):
        return None
    global vmm_exported
    vmm_exported = True
    return SharedStorage(handle=b"", offset=int(b.offset), device_uuid=device_uuid(device_index),
                         device_index=device_index, vmm=b.vmm)


def share_storage(storage: Any, device_index: int) -> SharedStorage:
    """Exports `storage` (a CUDA torch.UntypedStorage) through _share_cuda_ (or, for cuMem
    memory torch will not share, through the driver)."""
    try:
        info = storage._share_cuda_()
    except RuntimeError as e:
        # torch refuses what it cannot give a handle for: its older expandable segments, a
        # pluggable allocator's memory. cuMem memory can still go by file descriptor.
        shared = _share_cumem(storage, device_index)
        if shared is not None:
            return shared
        if "expandable" in str(e).lower() or _expandable_segments_configured():
            raise ExpandableSegmentsError(f"{_EXPANDABLE_HELP} (torch: {e})") from e
        raise RuntimeError(f"torch could not export a CUDA IPC handle for this tensor: {e}") from e
    if not isinstance(info, tuple) or len(info) != 8:
        raise RuntimeError(f"torch's _share_cuda_ returned {type(info).__name__} of {len(info)} items, not 8")
    _device, handle, _nbytes, offset, ref_handle, ref_offset, _event, _event_sync = info
    vmm: Optional[pb.CudaVmmBuffer] = None
    try:
        if handle is None:
            raise ValueError("the tensor has no memory (an empty storage)")
        if is_expandable_handle(handle):
            global vmm_exported
            vmm, mem = expandable_vmm(handle), b""
            vmm_exported = True
        else:
            mem = decode_handle(handle)
    finally:
        if ref_handle is not None:
            _release_ref_counter(ref_handle, ref_offset)
    return SharedStorage(handle=mem, offset=int(offset), device_uuid=device_uuid(device_index),
                         device_index=device_index, vmm=vmm)


_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
_driver: Dict[str, Any] = {}
_driver_mu = threading.Lock()


def _pointer_attributes_fn() -> Any:
    """cuPointerGetAttributes of the driver torch loaded, or None (asked once)."""
    with _driver_mu:
        if "fn" not in _driver:
            fn = None
            try:
                import ctypes

                fn = ctypes.CDLL("libcuda.so.1").cuPointerGetAttributes
                fn.argtypes = [ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
            _driver["fn"] = fn
        return _driver["fn"]


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


def _ipc_fns() -> Tuple[Any, Any]:
    """cuIpcOpenMemHandle and cuIpcCloseMemHandle of the driver torch loaded (asked once)."""
    with _driver_mu:
        if "ipc" not in _driver:
            lib = ctypes.CDLL("libcuda.so.1")
            open_fn = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
            open_fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcMemHandle, ctypes.c_uint]
            open_fn.restype = ctypes.c_int
            close_fn = lib.cuIpcCloseMemHandle
            close_fn.argtypes = [ctypes.c_uint64]
            close_fn.restype = ctypes.c_int
            _driver["ipc"] = (open_fn, close_fn)
        return _driver["ipc"]


class OpenedIpc:
    """Another process's device allocation, opened in this one from its 64-byte
    cudaIpcMemHandle_t on torch device `device_index` (cuIpcOpenMemHandle), as a flat uint8
    CUDA array (__cuda_array_interface__) of `nbytes`. torch.as_tensor(self) views it without
    a copy and keeps this object alive; the mapping is closed when the last view is gone."""

    def __init__(self, handle: bytes, device_index: int, nbytes: int) -> None:
        import torch

        self.device_index = device_index
        self.nbytes = nbytes
        self.ptr = 0
        if len(handle) != 64:
            raise ValueError(f"a CUDA IPC handle has 64 bytes; got {len(handle)}")
        open_fn, _ = _ipc_fns()
        ptr = ctypes.c_uint64(0)
        h = _IpcMemHandle.from_buffer_copy(bytes(handle))
        with torch.cuda.device(device_index):
            torch.cuda.synchronize()  # the device's primary context, current on this thread
            err = open_fn(ctypes.byref(ptr), h, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        if err != 0:
            raise RuntimeError(f"cuIpcOpenMemHandle on cuda:{device_index} failed: CUresult {err}")
        self.ptr = ptr.value
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 2, "strides": None,
        }

    def __del__(self) -> None:
        if getattr(self, "ptr", 0):
            try:
                import torch

                _, close_fn = _ipc_fns()
                with torch.cuda.device(self.device_index):
                    close_fn(self.ptr)
            except Exception:  # interpreter shutdown: the process exit closes it anyway
                pass
            self.ptr = 0


def fetch_vmm_descriptor(socket_path: str, token: bytes, timeout: float = 10.0) -> Tuple[int, int]:
    """(fd, chunk bytes) of a weight set in CUDA virtual memory, from the daemon's handle socket
    next to its Unix API socket `socket_path` (AttachWeightsResponse.vmm; wprep.proto says
    the protocol). The caller closes fd. Raises WprepError with the daemon's code."""
    import grpc

    from .._errors import WprepError

    path = socket_path + ".handles"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
            s.sendall(bytes(token))
            header, fds, _flags, _addr = socket.recv_fds(s, 16, 1, socket.MSG_WAITALL)
        except OSError as e:
            raise WprepError(grpc.StatusCode.UNAVAILABLE, f"handle socket {path}: {e}", "AttachWeights") from None
        if len(header) != 16:
            for fd in fds:
                os.close(fd)
            raise WprepError(grpc.StatusCode.UNAVAILABLE, f"handle socket {path}: the reply ended early",
                             "AttachWeights")
        code, count, nbytes = struct.unpack("<IIQ", header)
        if code != 0:
            for fd in fds:
                os.close(fd)
            text = b""
            while len(text) < 4096:
                chunk = s.recv(4096)
                if not chunk:
                    break
                text += chunk
            status = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
            raise WprepError(status, text.decode("utf-8", "replace"), "AttachWeights")
    if count != 1 or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise WprepError(grpc.StatusCode.INTERNAL, f"handle socket {path}: the reply carried {len(fds)} descriptors",
                         "AttachWeights")
    return fds[0], nbytes


class _VmmFns:
    """The driver's calls that map an imported POSIX-fd allocation (asked once)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, p = ctypes.c_uint64, ctypes.POINTER

        def fn(name: str, argtypes: list) -> Any:
            return _vmm.driver_fn(lib, name, argtypes)

        self.import_handle = fn("cuMemImportFromShareableHandle", [p(u64), ctypes.c_void_p, ctypes.c_int])
        self.reserve = fn("cuMemAddressReserve", [p(u64), ctypes.c_size_t, ctypes.c_size_t, u64, ctypes.c_ulonglong])
        self.map = fn("cuMemMap", [u64, ctypes.c_size_t, ctypes.c_size_t, u64, ctypes.c_ulonglong])
        self.set_access = fn("cuMemSetAccess", [u64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t])
        self.unmap = fn("cuMemUnmap", [u64, ctypes.c_size_t])
        self.address_free = fn("cuMemAddressFree", [u64, ctypes.c_size_t])
        self.release = fn("cuMemRelease", [u64])


class _CuMemAccessDesc(ctypes.Structure):
    # CUmemLocation {int type; int id}, then unsigned long long flags.
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_ulonglong)]


_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


def _vmm_fns() -> _VmmFns:
    with _driver_mu:
        if "vmm" not in _driver:
            _driver["vmm"] = _VmmFns()
        return _driver["vmm"]


class OpenedVmm:
    """A weight set's CUDA virtual-memory chunk, mapped in this process from its POSIX
    descriptor on torch device `device_index` (cuMemImportFromShareableHandle, cuMemAddressReserve,
    cuMemMap, cuMemSetAccess), as a flat uint8 CUDA array of `nbytes` (<= chunk_bytes), like
    OpenedIpc. Takes `fd` (closed once imported); unmapped when the last view is gone."""

    def __init__(self, fd: int, chunk_bytes: int, device_index: int, nbytes: int) -> None:
        import torch

        self.device_index = device_index
        self.chunk_bytes = chunk_bytes
        self.ptr = 0
        if nbytes > chunk_bytes:
            os.close(fd)
            raise ValueError(f"the set's {nbytes} bytes exceed its chunk's {chunk_bytes}")
        d = _vmm_fns()
        handle = ctypes.c_uint64(0)
        base = ctypes.c_uint64(0)
        done = []
        try:
            with torch.cuda.device(device_index):
                torch.cuda.synchronize()  # the device's primary context, current on this thread
                r = d.import_handle(ctypes.byref(handle), ctypes.c_void_p(fd), _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
                if r != 0:
                    raise RuntimeError(f"cuMemImportFromShareableHandle on cuda:{device_index} failed: CUresult {r}")
                done.append("import")
                r = d.reserve(ctypes.byref(base), chunk_bytes, 0, 0, 0)
                if r != 0:
                    raise RuntimeError(f"cuMemAddressReserve of {chunk_bytes} bytes failed: CUresult {r}")
                done.append("reserve")
                r = d.map(base.value, chunk_bytes, 0, handle.value, 0)
                if r != 0:
                    raise RuntimeError(f"cuMemMap failed: CUresult {r}")
                done.append("map")
                access = _CuMemAccessDesc(_CU_MEM_LOCATION_TYPE_DEVICE, device_index, _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                r = d.set_access(base.value, chunk_bytes, ctypes.byref(access), 1)
                if r != 0:
                    raise RuntimeError(f"cuMemSetAccess failed: CUresult {r}")
        except BaseException:
            if "map" in done:
                d.unmap(base.value, chunk_bytes)
            if "reserve" in done:
                d.address_free(base.value, chunk_bytes)
            raise
        finally:
            if "import" in done:
                d.release(handle.value)  # the mapping keeps the memory
            os.close(fd)
        self.ptr = base.value
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 2, "strides": None,
        }

    def __del__(self) -> None:
        if getattr(self, "ptr", 0):
            try:
                import torch

                d = _vmm_fns()
                with torch.cuda.device(self.device_index):
                    torch.cuda.synchronize()
                    d.unmap(self.ptr, self.chunk_bytes)
                    d.address_free(self.ptr, self.chunk_bytes)
            except Exception:  # interpreter shutdown: the process exit unmaps it anyway
                pass
            self.ptr = 0


def device_index_of_uuid(uuid: bytes) -> Optional[int]:
    """The torch device index of the GPU with these 16 UUID bytes, or None if this process
    cannot see it."""
    import torch

    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == bytes(uuid):
            return i
    return None


def allocation_of(ptr: int) -> Optional[Tuple[int, int]]:
    """(the driver's unique id of the allocation holding device pointer `ptr`, its start
    address), or None when the driver cannot tell (no driver, not a CUDA allocation)."""
    fn = _pointer_attributes_fn()
    if fn is None or ptr == 0:
        return None
    import ctypes

    attrs = (ctypes.c_int * 2)(_CU_POINTER_ATTRIBUTE_BUFFER_ID, _CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)
    buffer_id, start = ctypes.c_uint64(0), ctypes.c_uint64(0)
    data = (ctypes.c_void_p * 2)(ctypes.addressof(buffer_id), ctypes.addressof(start))
    if fn(2, attrs, data, ptr) != 0 or start.value == 0 or buffer_id.value == 0:
        return None
    return buffer_id.value, start.value


class Exports:
    """Allocations exported once (by the driver's allocation id), for storages in them: thread-safe,
    bounded (the least recently used go first)."""

    CAPACITY = 4096

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._entries: "OrderedDict[Tuple[int, int], Tuple[bytes, bytes]]" = OrderedDict()

    def lookup(self, key: Tuple[int, int]) -> Optional[Tuple[bytes, bytes]]:
        with self._mu:
            e = self._entries.get(key)
            if e is not None:
                self._entries.move_to_end(key)
            return e

    def add(self, key: Tuple[int, int], handle: bytes, uuid: bytes) -> None:
        with self._mu:
            self._entries[key] = (handle, uuid)
            while len(self._entries) > self.CAPACITY:
                self._entries.popitem(last=False)


EXPORTS = Exports()


def export_storage(storage: Any, device_index: int) -> SharedStorage:
    """share_storage(storage), or the export of the allocation it is in when that was made already."""
    ptr = int(storage.data_ptr())
    alloc = allocation_of(ptr)
    if alloc is not None:
        key = (device_index, alloc[0])
        e = EXPORTS.lookup(key)
        if e is not None:
            return SharedStorage(handle=e[0], offset=ptr - alloc[1], device_uuid=e[1], device_index=device_index)
    shared = share_storage(storage, device_index)
    # torch exports the allocation's start (cudaIpcGetMemHandle) with the storage's offset in
    # it; only where that is the driver's view too is the export reused. A VMM export (an
    # expandable segment's chunks) is not kept here: it is no legacy handle, and its own path
    # hands the daemon the same chunks on every call already.
    if alloc is not None and shared.vmm is None and shared.offset == ptr - alloc[1]:
        EXPORTS.add((device_index, alloc[0]), shared.handle, shared.device_uuid)
    return shared


class Registry:
    """Storages registered with the daemon (Client.register): exported once, kept alive.

    Thread-safe. Keyed by (device, storage address); an entry holds the storage, so the
    address cannot be reused by another storage while it is registered.
    """

    def __init__(self) -> None:
        self._mu = threading.Lock()
        # (device, address) -> (storage, its export, its size); written under _mu
        self._entries: Dict[Tuple[int, int], Tuple[Any, SharedStorage, int]] = {}
        # device -> (sorted storage addresses, their entries): locate's index, made on first
        # use after a change (None: to be made). Replaced whole, never changed in place.
        self._index: Optional[Dict[int, Tuple[List[int], List[Tuple[Any, SharedStorage, int]]]]] = None

    def locate(self, device_index: int, ptr: int, nbytes: int) -> Optional[Tuple[SharedStorage, int]]:
        """The export of the registered storage holding bytes [ptr, ptr + nbytes) of the
        device, and the bytes' offset in that export; None when no registered storage holds
        them (or the one that did was resized since). A tensor's data_ptr and size are enough:
        no storage object is made, which is most of what a tensor costs a request."""
        index = self._index
        if index is None:
            with self._mu:
                made: Dict[int, Tuple[List[int], List[Tuple[Any, SharedStorage, int]]]] = {}
                for (dev, addr), e in sorted(self._entries.items()):
                    starts, entries = made.setdefault(dev, ([], []))
                    starts.append(addr)
                    entries.append(e)
                self._index = index = made
        found = index.get(device_index)
        if found is None:
            return None
        starts, entries = found
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0:
            return None
        storage, shared, size = entries[i]
        start = starts[i]
        if ptr + nbytes > start + size or int(storage.data_ptr()) != start or storage.nbytes() != size:
            return None
        return shared, shared.offset + (ptr - start)

    @staticmethod
    def _key(storage: Any, device_index: int) -> Tuple[int, int]:
        return (device_index, int(storage.data_ptr()))

    def lookup(self, storage: Any, device_index: int) -> Optional[SharedStorage]:
        # A dict read is atomic under the GIL, and every call of a loader's layer loop comes
        # here: no lock (writers still take it, so two writers cannot interleave).
        e = self._entries.get(self._key(storage, device_index))
        if e is None or e[2] != storage.nbytes():
            return None
        return e[1]

    def add(self, storage: Any, device_index: int) -> SharedStorage:
        key = self._key(storage, device_index)
        nbytes = storage.nbytes()
        with self._mu:
            e = self._entries.get(key)
        if e is not None and e[2] == nbytes:
            return e[1]
        shared = export_storage(storage, device_index)
        with self._mu:
            self._entries[key] = (storage, shared, nbytes)
            self._index = None
        return shared

    def remove(self, storage: Any, device_index: int) -> Optional[SharedStorage]:
        with self._mu:
            e = self._entries.pop(self._key(storage, device_index), None)
            self._index = None
        return None if e is None else e[1]


# prctl(PR_SET_PTRACER, pid): yama's exception for one process that may ptrace the caller.
_PR_SET_PTRACER = 0x59616D61


def unix_socket_path(target: str) -> Optional[str]:
    """The socket path of a gRPC target "unix:///abs/path" or "unix:path" (None for others)."""
    if target.startswith("unix://"):
        return target[len("unix://"):] or None
    if target.startswith("unix:"):
        return target[len("unix:"):] or None
    return None


def peer_pid(path: str) -> Optional[int]:
    """The pid of the process listening on Unix socket `path`, as this process's PID namespace
    numbers it (SO_PEERCRED; None when it cannot be asked, 0 from another namespace)."""
    creds = struct.Struct("3i")  # struct ucred: pid, uid, gid
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5.0)
            s.connect(path)
            pid, _uid, _gid = creds.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, creds.size))
    except OSError:
        return None
    return pid


def _yama_scope_is_1() -> bool:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


_ptracer_mu = threading.Lock()
_ptracer: Optional[int] = None  # the pid last named with PR_SET_PTRACER here; guarded by _ptracer_mu


def daemon_needing_ptrace(target: str) -> Optional[int]:
    """The pid to name with allow_ptrace for the daemon at `target`, or None when none is
    needed (no yama, a ptrace_scope other than 1) or possible (not a Unix socket, a daemon
    in another PID namespace). Under yama's ptrace_scope 1 (Ubuntu's default) only an
    ancestor may ptrace a process, and pidfd_getfd asks for ptrace rights: a daemon of the
    same user that is not this process's ancestor could not take its descriptors."""
    if not _yama_scope_is_1():
        return None
    path = unix_socket_path(target)
    pid = peer_pid(path) if path else None
    return pid if pid and pid > 0 else None


def allow_ptrace(pid: int) -> bool:
    """Names `pid` this process's one permitted tracer (prctl PR_SET_PTRACER): what sharing
    descriptors with that daemon grants it anyway. Yama keeps one such pid per process, so
    clients of several daemons take turns (the daemons of one process are best given
    CAP_SYS_PTRACE instead). True when `pid` is the tracer now."""
    global _ptracer
    with _ptracer_mu:
        if _ptracer == pid:
            return True
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) != 0:
            return False
        _ptracer = pid
        return True


def allow_daemon_ptrace(target: str) -> Optional[int]:
    """daemon_needing_ptrace, then allow_ptrace: the daemon's pid when it was named."""
    pid = daemon_needing_ptrace(target)
    return pid if pid is not None and allow_ptrace(pid) else None


def check_byte_tensor(t: Any, what: str) -> None:
    if t.element_size() != 1:
        raise TypeError(
            f"{what} must have a one-byte dtype (uint8, or e.g. float8_e8m0fnu for scales); got {t.dtype}"
        )


def view_span(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Bytes from a view's first element to its last, inclusive (0 when empty)."""
    span = 1
    for d, s in zip(shape, strides):
        if d == 0:
            return 0
        span += (d - 1) * s
    return span


def is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Non-overlapping and dense, in some order of the dims (torch's definition)."""
    if strides and min(strides) < 0:
        return False
    dims = sorted((s, d) for d, s in zip(shape, strides) if d > 1)
    need = 1
    for s, d in dims:
        if s != need:
            return False
        need *= d
    return True


def shared_storage(storage: Any, device_index: int, registry: Registry) -> SharedStorage:
    """The registry's export of `storage`, else export_storage's."""
    return registry.lookup(storage, device_index) or export_storage(storage, device_index)


def shared_view(t: Any, registry: Registry) -> SharedStorage:
    return shared_storage(t.untyped_storage(), t.device.index, registry)


@dataclass(frozen=True)
class IpcView:
    """What a CudaIpcBuffer says of a tensor: allocation handle (or VMM chunks), byte offset,
    bytes spanned, GPU, and the view's strides (empty when contiguous)."""

    handle: bytes
    offset: int
    size: int
    device_uuid: bytes
    strides: Tuple[int, ...] = ()
    vmm: Optional[pb.CudaVmmBuffer] = None

    def fill(self, b: pb.CudaIpcBuffer) -> None:
        """Writes the view into `b` (a field of the request: no message of its own to copy)."""
        if self.vmm is not None:
            b.vmm.CopyFrom(self.vmm)
        else:
            b.handle = self.handle
        b.offset = self.offset
        b.size = self.size
        b.device_uuid = self.device_uuid
        if self.strides:
            b.strides.extend(self.strides)


def source_view(t: Any, registry: Registry) -> IpcView:
    """The IpcView of a CUDA tensor view read in place (strides sent unless contiguous)."""
    check_byte_tensor(t, "a CUDA source")
    strides = t.stride()
    if strides and min(strides) < 0:
        raise ValueError(f"a source view with negative strides cannot be read in place: {list(strides)}")
    shared = shared_view(t, registry)
    return IpcView(shared.handle, shared.offset + t.storage_offset(), view_span(t.shape, strides),
                   shared.device_uuid, () if t.is_contiguous() else tuple(strides), shared.vmm)


def destination_view(t: Any, registry: Registry) -> IpcView:
    """The IpcView of a CUDA tensor the daemon writes densely."""
    check_byte_tensor(t, "out")
    if not t.is_contiguous():
        shape, strides = list(t.shape), list(t.stride())
        if not is_dense(shape, strides):
            raise ValueError(
                f"out must be dense (the daemon writes it in memory order); got shape {shape} strides {strides}"
            )
    shared = shared_view(t, registry)
    return IpcView(shared.handle, shared.offset + t.storage_offset(), t.numel(), shared.device_uuid, vmm=shared.vmm)



def output_view(out: Any, shape: Sequence[int], strides: Sequence[int]) -> Any:
    """`out` viewed with the reported storage shape and strides (its memory is the output)."""
    if tuple(out.shape) == tuple(shape) and tuple(out.stride()) == tuple(strides):
        return out
    return out.as_strided(tuple(shape), tuple(strides), out.storage_offset())


def empty_output(like: Any, shape: Sequence[int], strides: Sequence[int], nbytes: int) -> Any:
    """A new output tensor on `like`'s device and of its dtype, viewed as the layout reports it."""
    import torch

    buf = torch.empty(nbytes, dtype=like.dtype, device=like.device)
    return buf.as_strided(tuple(shape), tuple(strides))
