"""The torch drop-in's glue: what the client's calls need of torch, CUDA IPC and fences.

The work lives in the _cuda subpackage: _cuda.ipc exports tensors as CUDA IPC buffers, and
_cuda.fences holds the events and words a batch is ordered with on the GPU. Here: the host
synchronization of completion="host", the fields of the other completion modes (one to one
onto ConvertBatchRequest's fences), and the handles of RegisterIpcHandles. torch is
imported only when a torch tensor is handed in; the rest of the package needs no torch.

completion= and the request's fences:
- "host": none; the client's host synchronizes `stream` before the call (synchronize).
- "stream": one interprocess event both ways: wait_for.event (recorded on `stream` before
  the call) and signal_when_done[0].event (recorded by the daemon after the work), answered
  once queued (ANSWER_WHEN_QUEUED).
- "async": words of shared host memory both ways: wait_for.word (written by `stream`) and
  signal_when_done[0].word (written by the daemon's GPU, waited for by `stream`), answered
  once queued.
"""

from __future__ import annotations

from typing import Any, Iterable, List

from ._cuda.fences import EventPool, Flag, FlagPool, StreamMemOpsError, reached
from ._cuda.ipc import (
    ExpandableSegmentsError,
    IpcView,
    Registry,
    SharedStorage,
    check_byte_tensor,
    decode_handle,
    destination_view,
    device_uuid,
    empty_output,
    is_cuda_tensor,
    is_dense,
    is_tensor,
    output_view,
    share_storage,
    shared_storage,
    source_view,
    view_span,
)
from .v1 import wprep_pb2 as pb

__all__ = [
    "EventPool",
    "ExpandableSegmentsError",
    "Flag",
    "FlagPool",
    "IpcView",
    "Registry",
    "SharedStorage",
    "StreamMemOpsError",
    "check_byte_tensor",
    "decode_handle",
    "destination_view",
    "device_uuid",
    "empty_output",
    "event_fences",
    "handle_refs",
    "is_cuda_tensor",
    "is_dense",
    "is_tensor",
    "output_view",
    "reached",
    "share_storage",
    "shared_storage",
    "source_view",
    "synchronize",
    "view_span",
    "word_fences",
]


def event_fences(r: pb.ConvertBatchRequest, handle: bytes, uuid: bytes) -> None:
    """completion="stream": the one event `handle` of GPU `uuid` both ways, answered once queued."""
    r.wait_for.event.handle = handle
    r.wait_for.event.device_uuid = uuid
    r.signal_when_done.add().event.CopyFrom(r.wait_for.event)
    r.answer_when = pb.ANSWER_WHEN_QUEUED


def word_fences(r: pb.ConvertBatchRequest, flags: FlagPool, ready: Flag, done: Flag) -> None:
    """completion="async": `ready` waited for, `done` written after the work, answered once queued."""
    flags.to_proto(ready, r.wait_for.word)
    flags.to_proto(done, r.signal_when_done.add().word)
    r.answer_when = pb.ANSWER_WHEN_QUEUED


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
    """One IpcHandleRef per distinct allocation among `tensors` (registering them first if
    asked): its legacy handle, or, for CUDA virtual memory, its chunks (IpcHandleRef.vmm)."""
    refs: List[pb.IpcHandleRef] = []
    seen = set()
    for t in tensors:
        if not is_cuda_tensor(t):
            raise TypeError(f"expected a CUDA torch tensor; got {type(t).__name__}")
        storage, index = t.untyped_storage(), t.device.index
        shared = registry.add(storage, index) if register else (registry.remove(storage, index) or share_storage(storage, index))
        key = (shared.vmm.SerializeToString() if shared.vmm is not None else shared.handle, shared.device_uuid)
        if key in seen:
            continue
        seen.add(key)
        ref = pb.IpcHandleRef(device_uuid=shared.device_uuid)
        if shared.vmm is not None:
            ref.vmm.CopyFrom(shared.vmm)
        else:
            ref.handle = shared.handle
        refs.append(ref)
    return refs
