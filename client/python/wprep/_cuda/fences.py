"""Fences of a batch ordered on the GPU (ConvertBatchRequest.wait_for, signal_when_done).

Two kinds, one per completion mode of the client:
- EventPool: interprocess CUDA events (completion="stream"): one event both ways, recorded on
  the client's stream before the call (the daemon's streams wait for it) and by the daemon
  after the work (the client's stream waits for it after the answer).
- FlagPool: 32-bit words of /dev/shm files mapped and registered with CUDA
  (completion="async"), written and waited for by the client's stream through the CUDA
  driver's stream memory operations (cuStreamWriteValue32, cuStreamWaitValue32), which torch
  does not expose: they are called through ctypes on the driver torch loaded.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from ..v1 import wprep_pb2 as pb


class EventPool:
    """Interprocess CUDA events for batches ordered on the GPU (ConvertBatchRequest.wait_for
    and signal_when_done, one event for both), per device, made once and reused.

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
    (ConvertBatchRequest.wait_for and signal_when_done, as FenceWord.host_word).

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

    def to_proto(self, flag: Flag, ref: pb.FenceWord) -> None:
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
