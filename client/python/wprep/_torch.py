"""CUDA tensors as wprep.v1.CudaIpcBuffer: torch's IPC handles, offsets, strides and GPU UUIDs.

torch is imported only when a torch tensor is handed in; the rest of the package needs no torch.

How a tensor becomes a buffer the daemon can open:
- `tensor.untyped_storage()._share_cuda_()` returns an 8-tuple (torch/csrc/StorageSharing.cpp):
  (device index, handle, storage bytes, storage offset in its allocation, ref-counter file,
  ref-counter offset, event handle, event sync required). For memory of torch's caching
  allocator (cudaMalloc segments) the handle is 66 bytes: a version byte (1 or 2), the kind
  b"c" (SHAREABLE_CUDA_MALLOC), then the cudaIpcMemHandle_t of the segment's base; older
  torch returned the 64 bytes alone. Memory of expandable segments is kind b"e", a handle
  the CUDA IPC API cannot open: refused with ExpandableSegmentsError.
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
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .v1 import wprep_pb2 as pb


class ExpandableSegmentsError(ValueError):
    """The tensor's memory comes from torch's expandable segments, which CUDA IPC cannot share."""


_EXPANDABLE_HELP = (
    "the tensor's memory comes from torch's expandable segments (PYTORCH_CUDA_ALLOC_CONF="
    "expandable_segments:True), which cudaIpcGetMemHandle cannot export, so wprepd cannot map it. "
    "Allocate the tensors wprep reads and writes with expandable segments off, e.g. "
    "torch.cuda.memory._set_allocator_settings('expandable_segments:False') around their "
    "allocation, or send host copies (numpy arrays) instead"
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

    handle: bytes  # the 64-byte cudaIpcMemHandle_t of the allocation (segment) base
    offset: int  # byte offset of the storage's first byte from the allocation's start
    device_uuid: bytes
    device_index: int


def _release_ref_counter(ref_handle: Any, ref_offset: Any) -> None:
    import torch

    release = getattr(torch.UntypedStorage, "_release_ipc_counter_cuda", None)
    if release is not None:
        release(ref_handle, ref_offset)


def _expandable_segments_configured() -> bool:
    conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", ""))
    return "expandable_segments:true" in conf.lower().replace(" ", "")


def share_storage(storage: Any, device_index: int) -> SharedStorage:
    """Exports `storage` (a CUDA torch.UntypedStorage) through _share_cuda_."""
    try:
        info = storage._share_cuda_()
    except RuntimeError as e:
        if "expandable" in str(e).lower() or _expandable_segments_configured():
            raise ExpandableSegmentsError(f"{_EXPANDABLE_HELP} (torch: {e})") from e
        raise RuntimeError(f"torch could not export a CUDA IPC handle for this tensor: {e}") from e
    if not isinstance(info, tuple) or len(info) != 8:
        raise RuntimeError(f"torch's _share_cuda_ returned {type(info).__name__} of {len(info)} items, not 8")
    _device, handle, _nbytes, offset, ref_handle, ref_offset, _event, _event_sync = info
    try:
        if handle is None:
            raise ValueError("the tensor has no memory (an empty storage)")
        mem = decode_handle(handle)
    finally:
        if ref_handle is not None:
            _release_ref_counter(ref_handle, ref_offset)
    return SharedStorage(handle=mem, offset=int(offset), device_uuid=device_uuid(device_index), device_index=device_index)


class Registry:
    """Storages registered with the daemon (Client.register): exported once, kept alive.

    Thread-safe. Keyed by (device, storage address); an entry holds the storage, so the
    address cannot be reused by another storage while it is registered.
    """

    def __init__(self) -> None:
        self._mu = threading.Lock()
        # (device, address) -> (storage, its export, its size); written under _mu
        self._entries: Dict[Tuple[int, int], Tuple[Any, SharedStorage, int]] = {}

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
        shared = share_storage(storage, device_index)
        with self._mu:
            self._entries[key] = (storage, shared, nbytes)
        return shared

    def remove(self, storage: Any, device_index: int) -> Optional[SharedStorage]:
        with self._mu:
            e = self._entries.pop(self._key(storage, device_index), None)
        return None if e is None else e[1]


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


def shared_view(t: Any, registry: Registry) -> SharedStorage:
    storage = t.untyped_storage()
    index = t.device.index
    return registry.lookup(storage, index) or share_storage(storage, index)


@dataclass(frozen=True)
class IpcView:
    """What a CudaIpcBuffer says of a tensor: allocation handle, byte offset, bytes spanned,
    GPU, and the view's strides (empty when contiguous)."""

    handle: bytes
    offset: int
    size: int
    device_uuid: bytes
    strides: Tuple[int, ...] = ()

    def fill(self, b: pb.CudaIpcBuffer) -> None:
        """Writes the view into `b` (a field of the request: no message of its own to copy)."""
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
                   shared.device_uuid, () if t.is_contiguous() else tuple(strides))


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
    return IpcView(shared.handle, shared.offset + t.storage_offset(), t.numel(), shared.device_uuid)



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


class EventPool:
    """Interprocess CUDA events for batches ordered on the GPU (ConvertBatchRequest.ready_event
    and completion_event, one event for both), per device, made once and reused.

    An event is taken for one call and given back once the daemon has answered. The daemon
    may record a client's event until its handler ends, which can be after a call failed on
    the client's side (a deadline, a cancel): such an event is retired, kept but never
    reused, so that a late record can neither reach another call's wait nor an event that is
    gone. The oldest retired events are let go beyond RETIRED_KEPT, long after any handler
    could still record them.
    """

    RETIRED_KEPT = 1024

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._free: Dict[int, List[Tuple[Any, bytes]]] = {}
        self._retired: List[Tuple[Any, bytes]] = []

    def take(self, device_index: int) -> Tuple[Any, bytes]:
        """(torch.cuda.Event, its 64-byte cudaIpcEventHandle_t) on the device."""
        with self._mu:
            free = self._free.get(device_index)
            if free:
                return free.pop()
        import torch

        with torch.cuda.device(device_index):
            ev = torch.cuda.Event(enable_timing=False, interprocess=True)
            handle = bytes(ev.ipc_handle())
        return ev, handle

    def give(self, device_index: int, event: Tuple[Any, bytes]) -> None:
        with self._mu:
            self._free.setdefault(device_index, []).append(event)

    def retire(self, device_index: int, event: Tuple[Any, bytes]) -> None:
        with self._mu:
            self._retired.append(event)
            del self._retired[:-self.RETIRED_KEPT]


class StreamMemOpsError(RuntimeError):
    """The driver refused a stream memory operation that completion='async' needs."""


_CU_STREAM_WAIT_VALUE_GEQ = 0
_CU_STREAM_WRITE_VALUE_DEFAULT = 0  # a memory fence first: the writes queued before it are visible
_libcuda: Dict[str, Any] = {}
_libcuda_mu = threading.Lock()


def _driver_fn(name: str, argtypes: List[Any]) -> Any:
    """A function of the CUDA driver torch loaded (its _v2 form where there is one)."""
    with _libcuda_mu:
        fn = _libcuda.get(name)
        if fn is None:
            import ctypes

            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise StreamMemOpsError(f"completion='async' calls the CUDA driver, and libcuda.so.1 did not load: {e}")
            fn = getattr(lib, name + "_v2", None) or getattr(lib, name, None)
            if fn is None:
                raise StreamMemOpsError(f"this CUDA driver has no {name}; use completion='stream'")
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            _libcuda[name] = fn
        return fn


def reached(word: int, value: int) -> bool:
    """cuStreamWaitValue32's "greater or equal", wrapping: (int32)(word - value) >= 0."""
    return ((word - value) & 0xFFFFFFFF) < (1 << 31)


@dataclass
class Flag:
    """One 32-bit word of a FlagPool page, and the value of its current (or last) use."""

    page: "_Page"
    index: int  # the word's index in its page
    value: int = 0
    in_use: bool = False  # taken, and its call not over yet
    retired: bool = False  # never reused: a daemon that did not answer may still use it

    @property
    def offset(self) -> int:
        return 4 * self.index

    def read(self) -> int:
        import ctypes

        return int(ctypes.c_uint32.from_address(self.page.addr + self.offset).value)

    def write(self, value: int) -> None:
        import ctypes

        ctypes.c_uint32.from_address(self.page.addr + self.offset).value = value


@dataclass
class _Page:
    name: str  # the file's name in the pool's directory
    path: str
    mapping: Any  # the mmap
    addr: int  # its address in this process
    device_ptr: Dict[int, int]  # device index -> its address on the GPU
    unlinked: bool = False


class FlagPool:
    """Words of shared host memory that order completion='async' batches on the GPU, both ways
    (ConvertBatchRequest.ready_flag and completion_flag, as SharedHostWord).

    The words are pages of files in /dev/shm that the client maps and registers with CUDA
    (cudaHostRegister, portable and mapped) and the daemon maps too. A batch takes two words
    with fresh values: the caller's stream writes the ready word after the work queued before
    the call (cuStreamWriteValue32), the daemon's streams wait for it before the batch, the
    daemon writes the done word after the batch, and the caller's stream waits for that
    (cuStreamWaitValue32, "greater or equal", wrapping). When the daemon refuses a batch, or
    the stream breaks before its answer, the client's CPU writes the done word, which releases
    the caller's stream with no GPU queue in between. A word is reused only once its call is
    over and it holds its value (every write of it has landed, so no late write can pass a
    later wait early); a word of a call that got no answer is never reused. close() releases
    every word still waited for and unlinks the files; the mappings stay until the process
    exits, since a stream may still reach a wait on them.
    """

    WORDS = 1024  # a page's words: 4096 bytes
    MODE = 0o660

    def __init__(self, directory: str = "/dev/shm") -> None:
        self.directory = directory
        self._mu = threading.Lock()
        self._pages: List[_Page] = []  # guarded by _mu
        self._words: List[Flag] = []  # guarded by _mu
        self._scan = 0  # where take() looks first

    def take(self, device_index: int) -> Flag:
        """A free word with its next value set (never 0), its page mapped on the device."""
        with self._mu:
            n = len(self._words)
            for k in range(n):
                f = self._words[(self._scan + k) % n]
                if not f.in_use and not f.retired and reached(f.read(), f.value):
                    self._scan = (self._scan + k + 1) % n
                    break
            else:
                page = self._new_page()
                words = [Flag(page, i) for i in range(self.WORDS)]
                self._scan = len(self._words) + 1
                self._words.extend(words)
                f = words[0]
            f.value = (f.value + 1) & 0xFFFFFFFF or 1
            f.in_use = True
            page = f.page
        if device_index not in page.device_ptr:
            page.device_ptr[device_index] = self._device_ptr(page, device_index)
        return f

    def to_proto(self, flag: Flag, ref: pb.IpcFlagRef) -> None:
        ref.host_word.name = flag.page.name
        ref.host_word.offset = flag.offset
        ref.value = flag.value

    def enqueue_write(self, flag: Flag, stream: Any, device_index: int) -> None:
        """`stream` writes flag.value to the word once the work queued on it so far is done."""
        import ctypes

        fn = _driver_fn("cuStreamWriteValue32", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint])
        self._check(fn(stream.cuda_stream, flag.page.device_ptr[device_index] + flag.offset, flag.value,
                       _CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32", device_index)

    def enqueue_wait(self, flag: Flag, stream: Any, device_index: int) -> None:
        """Work queued on `stream` from now on waits until the word reaches flag.value."""
        import ctypes

        fn = _driver_fn("cuStreamWaitValue32", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint])
        self._check(fn(stream.cuda_stream, flag.page.device_ptr[device_index] + flag.offset, flag.value,
                       _CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32", device_index)

    @staticmethod
    def _check(r: int, what: str, device_index: int) -> None:
        if r != 0:
            raise StreamMemOpsError(
                f"{what} failed with CUresult {r} on cuda:{device_index}: this GPU or driver does not take "
                f"stream memory operations on host memory; use completion='stream'"
            )

    def release(self, flag: Flag) -> None:
        """The CPU writes the word's value now (a stream waiting for it goes on)."""
        if not reached(flag.read(), flag.value):
            flag.write(flag.value)

    def finish(self, flag: Flag, reusable: bool) -> None:
        """The word's call is over; `reusable` False retires it for good."""
        with self._mu:
            flag.in_use = False
            flag.retired = flag.retired or not reusable

    def release_all(self) -> None:
        """Writes the value of every word whose call is not over."""
        with self._mu:
            for f in self._words:
                if f.in_use:
                    self.release(f)

    def close(self) -> None:
        """release_all(), and the files unlinked (their mappings stay, see the class)."""
        self.release_all()
        with self._mu:
            for p in self._pages:
                if not p.unlinked:
                    p.unlinked = True
                    _unlink_quietly(p.path)

    def _new_page(self) -> _Page:
        import ctypes
        import mmap
        import secrets
        import weakref

        import torch

        name = f"wprep-{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(self.directory, name)
        size = 4 * self.WORDS
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StreamMemOpsError(f"completion='async' keeps its words in {self.directory}, and {path} "
                                    f"cannot be made: {e}; use completion='stream'") from None
        try:
            # The daemon opens it for writing: the same user, root, or the file's group.
            os.fchmod(fd, self.MODE)
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        err = torch.cuda.cudart().cudaHostRegister(addr, size, 3)  # portable | mapped
        if int(err) != 0:
            _unlink_quietly(path)
            raise StreamMemOpsError(f"cudaHostRegister of {path} failed (cudaError {int(err)}); use completion='stream'")
        page = _Page(name, path, m, addr, {})
        self._pages.append(page)
        weakref.finalize(self, _unlink_quietly, path)
        return page

    @staticmethod
    def _device_ptr(page: _Page, device_index: int) -> int:
        import ctypes

        import torch

        fn = _driver_fn("cuMemHostGetDevicePointer", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint])
        out = ctypes.c_uint64()
        with torch.cuda.device(device_index):
            torch.cuda.init()
            r = fn(ctypes.byref(out), ctypes.c_void_p(page.addr), 0)
        if r != 0:
            raise StreamMemOpsError(f"cuMemHostGetDevicePointer failed with CUresult {r} on cuda:{device_index}; "
                                    f"use completion='stream'")
        return int(out.value)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def synchronize(devices: Iterable[int], stream: Any = None) -> None:
    """Waits until the work queued so far on `stream` (default: each device's current stream) is done.

    The ordering contract: the producer's writes to every source (and earlier reads of every
    destination) must be complete before the daemon, another process, touches the memory.
    """
    import torch

    if stream is not None:
        stream.synchronize()
        return
    for d in sorted(set(devices)):
        torch.cuda.current_stream(d).synchronize()


def handle_refs(tensors: Iterable[Any], registry: Registry, register: bool) -> List[pb.IpcHandleRef]:
    """One IpcHandleRef per distinct allocation among `tensors` (registering them first if asked)."""
    refs: List[pb.IpcHandleRef] = []
    seen = set()
    for t in tensors:
        if not is_cuda_tensor(t):
            raise TypeError(f"expected a CUDA torch tensor; got {type(t).__name__}")
        storage, index = t.untyped_storage(), t.device.index
        shared = registry.add(storage, index) if register else (registry.remove(storage, index) or share_storage(storage, index))
        key = (shared.handle, shared.device_uuid)
        if key not in seen:
            seen.add(key)
            refs.append(pb.IpcHandleRef(handle=shared.handle, device_uuid=shared.device_uuid))
    return refs
