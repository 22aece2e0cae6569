"""Requests from Python values and results from answers, shared by Client and AsyncClient."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _torch
from ._spec import LayoutIdentity, Spec
from ._types import BatchResult, Item, Plan, Result, Shape, Source
from .v1 import wprep_pb2 as pb

PlanKey = Tuple[Spec, Shape]


@dataclass
class Call:
    """A request ready to send, and how its answer becomes the caller's result.

    keep holds what must stay alive until the daemon has answered (the CUDA tensors it reads
    and writes).
    """

    method: str
    request: Any
    finish: Callable[[Any], Any]
    keep: List[Any] = field(default_factory=list)
    # Runs once the call is over, after finish: with True when the daemon answered (its
    # handler is over), False when the call failed without an answer.
    release: Optional[Callable[[bool], None]] = None
    # completion='async': the caller's result, known before the answer (from the Plans), and
    # the batch's (ready, done) words.
    early: Any = None
    words: Optional[Tuple[Any, Any]] = None

    def complete(self, resp: Any) -> Any:
        """finish(resp), then release(True)."""
        try:
            return self.finish(resp)
        finally:
            self._release(True)

    def fail(self) -> None:
        """The call failed without an answer: release(False)."""
        self._release(False)

    def _release(self, answered: bool) -> None:
        if self.release is not None:
            release, self.release = self.release, None
            release(answered)


@functools.lru_cache(maxsize=4096)
def spec_proto(spec: Spec) -> pb.ConversionSpec:
    """spec.to_proto(), made once per Spec (a loader sends the same few again and again).
    The message is shared: copy it (CopyFrom), never change it."""
    return spec.to_proto()


@functools.lru_cache(maxsize=4096)
def item_template(spec: Spec, shape: Shape) -> pb.ConvertItem:
    """A ConvertItem with spec and logical_shape set, made once per (spec, shape): a loader's
    projection shapes recur in every layer, so an item is one CopyFrom plus its buffers.
    Shared: copy it, never change it."""
    return pb.ConvertItem(spec=spec_proto(spec), logical_shape=shape)


def uuid_bytes(device_uuid: Union[None, bytes, str]) -> bytes:
    """16 UUID bytes from bytes or "GPU-xxxxxxxx-..." (as nvidia-smi and Device.uuid_string print it)."""
    if device_uuid is None:
        return b""
    if isinstance(device_uuid, str):
        raw = bytes.fromhex(device_uuid.removeprefix("GPU-").replace("-", ""))
    else:
        raw = bytes(device_uuid)
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes; got {len(raw)}")
    return raw


def shape_of(logical_shape: Sequence[int]) -> Shape:
    shape = tuple(map(int, logical_shape))
    if shape and min(shape) < 0:
        raise ValueError(f"logical_shape has a negative dim: {list(shape)}")
    return shape


def inline_source(source: Source, strides: Optional[Sequence[int]]) -> Tuple[bytes, List[int]]:
    """The bytes to send for a host source, and the view's byte strides ([] when dense)."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source), [int(s) for s in strides or []]
    if isinstance(source, memoryview):
        if not source.c_contiguous:
            raise ValueError("a memoryview source must be C-contiguous (pass a numpy view for strided data)")
        return source.tobytes(), [int(s) for s in strides or []]
    if _torch.is_tensor(source):
        t: Any = source
        _torch.check_byte_tensor(t, "a source tensor")
        import torch

        source = t.detach().view(torch.uint8).numpy()
    if isinstance(source, np.ndarray):
        if strides is not None:
            raise ValueError("strides= is for bytes sources; a numpy array carries its own strides")
        if source.dtype.itemsize != 1:
            raise TypeError(f"a numpy source must have a one-byte dtype (uint8); got {source.dtype}")
        if source.flags.c_contiguous:
            return source.tobytes(), []
        if any(s < 0 for s in source.strides):
            raise ValueError(f"a numpy view with negative strides cannot be sent as a view: {source.strides}")
        span = _torch.view_span(source.shape, source.strides)
        raw = np.lib.stride_tricks.as_strided(source.view(np.uint8), shape=(span,), strides=(1,))
        return raw.tobytes(), [int(s) for s in source.strides]
    raise TypeError(f"a source is bytes, a numpy array or a torch tensor; got {type(source).__name__}")


def plan_request(
    spec: Spec,
    logical_shape: Sequence[int],
    input_strides: Optional[Sequence[int]] = None,
    input_buffer_bytes: Optional[int] = None,
) -> pb.PlanRequest:
    r = pb.PlanRequest(spec=spec.to_proto(), logical_shape=shape_of(logical_shape))
    if input_strides:
        r.input_strides.extend(int(s) for s in input_strides)
    if input_buffer_bytes is not None:
        r.input_buffer_bytes = int(input_buffer_bytes)
    return r


def needs_plan(spec: Spec, logical_shape: Sequence[int], source: Source, out: Any,
               completion: str = "host") -> Optional[PlanKey]:
    """The plan an output allocated by the client needs (a CUDA source without `out`), or, with
    completion='async', that a CUDA item's result is made of before the answer."""
    if (out is None or completion == "async") and _torch.is_cuda_tensor(source):
        return (spec, shape_of(logical_shape))
    return None


class _Side:
    """One conversion's source and destination, resolved: inline bytes or CUDA IPC buffers."""

    def __init__(
        self,
        spec: Spec,
        logical_shape: Sequence[int],
        source: Source,
        out: Any,
        strides: Optional[Sequence[int]],
        plans: Dict[PlanKey, Plan],
        registry: _torch.Registry,
        what: str,
    ) -> None:
        self.shape = shape_of(logical_shape)
        self.source_ipc: Optional[_torch.IpcView] = None
        self.source_bytes = b""
        self.source_strides: List[int] = []
        self.out: Any = None
        self.dest_ipc: Optional[_torch.IpcView] = None
        self.devices: List[int] = []
        if out is not None and not _torch.is_cuda_tensor(out):
            raise TypeError(f"{what}: out must be a CUDA torch tensor; got {type(out).__name__}")
        if _torch.is_cuda_tensor(source):
            if strides is not None:
                raise ValueError(f"{what}: strides= is for bytes sources; a CUDA tensor carries its own strides")
            t: Any = source
            device = t.device
            self.devices.append(device.index)
            if t.numel() == 0:
                self.source_bytes = b""  # nothing to read: an empty input is sent inline
            else:
                self.source_ipc = _torch.source_view(t, registry)
            if out is None:
                p = plans[(spec, self.shape)]
                out = _torch.empty_output(t, p.output_shape, p.output_strides, p.output_bytes)
            elif out.device != device:
                raise ValueError(f"{what}: out is on {out.device}, the source on {device}; they must share a GPU")
        else:
            self.source_bytes, self.source_strides = inline_source(source, strides)
        if out is not None:
            self.out = out
            self.devices.append(out.device.index)
            if out.numel() > 0:
                self.dest_ipc = _torch.destination_view(out, registry)

    def result(self, shape: Shape, strides: Shape, nbytes: int, identity: pb.LayoutIdentity, engine: str,
               kernel_seconds: float, inline: bytes) -> Result:
        tensor = None if self.out is None else _torch.output_view(self.out, shape, strides)
        return Result(
            shape=shape,
            strides=strides,
            nbytes=nbytes,
            identity=LayoutIdentity.from_proto(identity),
            engine=engine,
            kernel_seconds=kernel_seconds,
            data=inline if self.out is None else None,
            tensor=tensor,
        )

    def planned(self, plan: Plan, engine: str) -> Result:
        """The result the answer will describe, from the plan (completion='async')."""
        return Result(shape=plan.output_shape, strides=plan.output_strides, nbytes=plan.output_bytes,
                      identity=plan.identity, engine=engine, kernel_seconds=0.0,
                      tensor=_torch.output_view(self.out, plan.output_shape, plan.output_strides))

    def keep(self) -> List[Any]:
        return [x for x in (self.out,) if x is not None]


def convert_call(
    spec: Spec,
    logical_shape: Sequence[int],
    source: Source,
    out: Any,
    strides: Optional[Sequence[int]],
    device_uuid: Union[None, bytes, str],
    plans: Dict[PlanKey, Plan],
    registry: _torch.Registry,
    stream: Any,
) -> Call:
    side = _Side(spec, logical_shape, source, out, strides, plans, registry, "convert")
    r = pb.ConvertRequest(logical_shape=side.shape, device_uuid=uuid_bytes(device_uuid))
    r.spec.CopyFrom(spec_proto(spec))
    if side.source_ipc is not None:
        side.source_ipc.fill(r.source_ipc)
    else:
        r.source_bytes = side.source_bytes
        r.source_strides.extend(side.source_strides)
    if side.dest_ipc is not None:
        side.dest_ipc.fill(r.destination_ipc)
    if side.devices:
        _torch.synchronize(side.devices, stream)

    def finish(resp: pb.ConvertResponse) -> Result:
        return side.result(tuple(resp.output_shape), tuple(resp.output_strides), resp.output_bytes, resp.identity,
                           resp.engine, 0.0, resp.output_bytes_inline)

    return Call("Convert", r, finish, keep=[source, *side.keep()])


COMPLETIONS = ("host", "stream", "async")


def batch_call(
    items: Sequence[Item],
    device_uuid: Union[None, bytes, str],
    plans: Dict[PlanKey, Plan],
    registry: _torch.Registry,
    stream: Any,
    completion: str = "host",
    events: Optional[_torch.EventPool] = None,
    flags: Optional[_torch.FlagPool] = None,
) -> Call:
    sides: List[_Side] = []
    r = pb.ConvertBatchRequest(device_uuid=uuid_bytes(device_uuid))
    devices: List[int] = []
    for i, it in enumerate(items):
        if not isinstance(it, Item):
            raise TypeError(f"items[{i}] must be a wprep.Item; got {type(it).__name__}")
        side = _Side(it.spec, it.logical_shape, it.source, it.out, it.strides, plans, registry, f"items[{i}]")
        sides.append(side)
        devices += side.devices
        ci = r.items.add().convert
        ci.CopyFrom(item_template(it.spec, side.shape))
        if side.source_ipc is not None:
            side.source_ipc.fill(ci.source.ipc)
        else:
            ci.source.inline_bytes = side.source_bytes
            ci.source.inline_strides.extend(side.source_strides)
        if side.dest_ipc is not None:
            side.dest_ipc.fill(ci.destination.ipc)
    if completion not in COMPLETIONS:
        raise ValueError(f"completion must be one of {COMPLETIONS}; got {completion!r}")
    event = None
    early: Optional[BatchResult] = None
    words: Optional[Tuple[Any, Any]] = None
    if completion == "async":
        index = _early_answer_device(sides, completion)
        assert flags is not None
        engine = "cuda:" + _uuid_string(_torch.device_uuid(index))
        early = BatchResult([side.planned(plans[(it.spec, side.shape)], engine) for it, side in zip(items, sides)])
        import torch

        on = stream if stream is not None else torch.cuda.current_stream(index)
        # Words both ways, no event: `on` writes the ready word after the work queued on it so
        # far (the daemon's streams wait for it), then waits for the done word, which the
        # daemon's GPU writes after the batch. The client sends the batch on its ordered
        # ConvertBatches stream, so no later batch's wait is queued ahead of this one's work.
        ready = flags.take(index)
        try:
            done = flags.take(index)
        except BaseException:
            flags.finish(ready, reusable=True)
            raise
        words = (ready, done)
        try:
            _torch.word_fences(r, flags, ready, done)
            flags.enqueue_write(ready, on, index)
            flags.enqueue_wait(done, on, index)
        except BaseException:
            flags.release(done)
            flags.finish(ready, reusable=False)
            flags.finish(done, reusable=False)
            raise
    elif completion == "stream":
        index = _early_answer_device(sides)
        assert events is not None
        event = events.take(index)
        # One event both ways: recorded here after the work queued so far on `stream` (the
        # daemon's streams wait for it on the GPU, so the host waits for nothing), then
        # recorded by the daemon after its own work, which `stream` waits for after the answer.
        import torch

        event[0].record(stream if stream is not None else torch.cuda.current_stream(index))
        _torch.event_fences(r, event[1], _torch.device_uuid(index))
    elif devices:
        _torch.synchronize(devices, stream)

    def finish(resp: pb.ConvertBatchResponse) -> BatchResult:
        if len(resp.items) != len(sides):
            raise RuntimeError(f"ConvertBatch answered {len(resp.items)} items for {len(sides)}")
        if early is not None:
            for i, (res, item) in enumerate(zip(early, resp.items)):
                t = item.outputs[0]
                if (tuple(t.shape), tuple(t.strides), t.bytes) != (res.shape, res.strides, res.nbytes):
                    raise RuntimeError(f"items[{i}]: the daemon wrote {list(t.shape)} strides {list(t.strides)}, "
                                       f"not the planned {list(res.shape)} strides {list(res.strides)}")
            return early
        if event is not None:
            import torch

            # The outputs' readers come after the daemon's work, as after a kernel on `stream`.
            (stream if stream is not None else torch.cuda.current_stream(index)).wait_event(event[0])
        out = []
        for side, item in zip(sides, resp.items):
            t = item.outputs[0]
            out.append(side.result(tuple(t.shape), tuple(t.strides), t.bytes, t.identity, item.engine,
                                   item.kernel_seconds, t.inline_bytes if side.out is None else b""))
        return BatchResult(out, resp.peak_extra_device_bytes)

    keep: List[Any] = [it.source for it in items]
    for s in sides:
        keep += s.keep()
    def release(answered: bool) -> None:
        # Without an answer the daemon's handler may still record the event: never reuse it.
        (events.give if answered else events.retire)(index, event)  # type: ignore[union-attr]

    return Call("ConvertBatch", r, finish, keep=keep, release=None if event is None else release, early=early,
                words=words)


def _uuid_string(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _early_answer_device(sides: Sequence["_Side"], completion: str = "stream") -> int:
    """The one CUDA device of a batch whose every source and output is a CUDA tensor."""
    index: Optional[int] = None
    for i, side in enumerate(sides):
        if side.source_ipc is None or side.dest_ipc is None:
            raise ValueError(
                f"items[{i}]: completion='{completion}' needs a CUDA tensor source and output (out=... or "
                f"allocated on the source's device); use completion='host' for host data"
            )
        for d in side.devices:
            if index is None:
                index = d
            elif d != index:
                raise ValueError(f"items[{i}]: completion='{completion}' orders one GPU's work; the batch spans "
                                 f"cuda:{index} and cuda:{d}: send one batch per GPU")
    if index is None:
        raise ValueError(f"completion='{completion}' needs CUDA tensors")
    return index
