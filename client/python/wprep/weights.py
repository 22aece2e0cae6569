"""Resident weight sets (wprep.v1.WeightSets): the daemon loads a checkpoint once, prepares it,
keeps it, and engines attach instead of loading and preparing.

    import wprep, wprep.weights
    c = wprep.Client()
    wprep.weights.load("gptoss", "gpt-oss-20b", client=c,
                       rules="*_blocks=hopper_value:packing_axis=-2;*_scales=hopper_scale")
    with wprep.weights.attach("gptoss", client=c) as w:   # an engine, restarted
        w["model.layers.0.mlp.experts.w2_blocks"]     # numpy view of the daemon's memory
        w.identity("model.layers.0.mlp.experts.w2_blocks").layout
        w.torch_tensors()                             # torch.frombuffer views, no copy

The same calls are Client.load_weights, list_weights, attach_weights and drop_weights.

A set is kept on a GPU (load(..., device="cuda:0")) or in host memory. An attachment holds
the AttachWeights stream open and gives views, not copies: of a host set, numpy arrays over
its file mapped read-only (the mapping goes when the last view of it does, and stays valid
after the set is dropped); of a GPU set, CUDA torch tensors over its allocation, opened
from its CUDA IPC handle (valid while attached: a dropped set's memory is freed). Both are
read-only by contract (numpy arrays are not writeable; torch tensors must not be written).
close() (or the with block) ends the attachment.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import grpc
import numpy as np

from ._errors import WprepError, from_rpc_error
from ._requests import _uuid_string, uuid_bytes
from ._spec import LayoutIdentity, Spec
from .v1 import wprep_pb2 as pb

if TYPE_CHECKING:  # torch is optional; the client module imports this one lazily
    import torch

    from ._client import Client

__all__ = [
    "AttachedWeights",
    "LoadProgress",
    "LoadedWeights",
    "WeightManifest",
    "WeightSetInfo",
    "WeightSets",
    "WeightTensor",
    "attach",
    "Checkpoint",
    "drop",
    "list_sets",
    "load",
    "parse_rules",
    "Slice",
    "wait",
]



class Slice(NamedTuple):
    """Elements [start, start + length) along `axis` of a stored tensor (negative axes count
    from the last): a tensor- or expert-parallel rank's shard, cut before the conversion."""

    axis: int
    start: int
    length: int


class Checkpoint(NamedTuple):
    """A rule's action that reads the tensor as an MXFP4 checkpoint stores it, as
    convert-safetensors does: for a value layout gpt-oss's *_blocks [..., N, K/32, 16], the
    checkpoint order of the logical [..., K, N]; for a scale layout *_scales [..., N, K/32],
    through its transposed view [..., K/32, N]. The text form adds ":checkpoint"."""

    spec: Spec


# A rule's action: a Spec (swizzle the tensor's bytes), Checkpoint(Spec), "verbatim", or the
# CLI's "LAYOUT[:param=value...][:checkpoint][:slice=AXIS/START/LENGTH]".
Action = Union[Spec, Checkpoint, str]
Rules = Union[None, str, Mapping[str, Union[Action, Tuple[Action, Slice]]],
              Sequence[Union[Tuple[str, Action], Tuple[str, Action, Slice]]]]

# numpy has no bfloat16 or float8: those come as unsigned integers of their width (the raw
# bits); torch_tensors() gives the real dtype.
_NP_DTYPES: Dict[str, str] = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1",
    "BOOL": "?", "F8_E4M3": "u1", "F8_E5M2": "u1", "F8_E8M0": "u1",
}
_TORCH_DTYPES: Dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}
# Where an older torch lacks the dtype (float8_e8m0fnu came in 2.7, uint16-64 in 2.3): a
# signed or unsigned integer of the same width.
_TORCH_FALLBACK: Dict[str, str] = {
    "F8_E4M3": "uint8", "F8_E5M2": "uint8", "F8_E8M0": "uint8", "U16": "int16", "U32": "int32", "U64": "int64",
}
# The rule parameters the CLI's --rules takes (client/cli/weights.cc), all ints.
_RULE_PARAMS = ("mx_axis", "mma_version", "num_warps", "align_k", "packing_axis", "block_k", "block_n")


# -- values -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightTensor:
    """One tensor of a set (wprep.v1.WeightTensor).

    dtype: the safetensors dtype ("BF16", "U8"; converted tensors are "U8"). strides: in
    elements. offset: where it starts in the set's memory. identity: the layout of a
    converted tensor (None for copies). rule: the index of the rule that matched, -1 for none.
    slice: the slice of the stored tensor the set holds (its axis non-negative), None for
    whole tensors.
    """

    name: str
    dtype: str
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    bytes: int
    offset: int
    identity: Optional[LayoutIdentity]
    rule: int
    slice: Optional[Slice] = None

    @classmethod
    def from_proto(cls, p: pb.WeightTensor) -> "WeightTensor":
        return cls(name=p.name, dtype=p.dtype, shape=tuple(p.shape), strides=tuple(p.strides), bytes=p.bytes,
                   offset=p.offset, identity=LayoutIdentity.from_proto(p.identity) if p.HasField("identity") else None,
                   rule=p.rule,
                   slice=Slice(p.slice.axis, p.slice.start, p.slice.length) if p.HasField("slice") else None)


@dataclass(frozen=True)
class WeightManifest:
    """What a set holds (wprep.v1.WeightManifest). tensors is empty in list_sets() unless
    with_tensors. source_checksum: SHA-256 over the safetensors headers' SHA-256s, in shard
    order. device_uuid: the GPU holding the set; b"" for host memory. vmm: a GPU set in CUDA
    virtual memory (load(vmm=True))."""

    name: str
    path: str
    tensors: Tuple[WeightTensor, ...]
    total_bytes: int
    source_checksum: bytes
    device_uuid: bytes
    vmm: bool = False

    @classmethod
    def from_proto(cls, p: pb.WeightManifest) -> "WeightManifest":
        return cls(name=p.name, path=p.path, tensors=tuple(WeightTensor.from_proto(t) for t in p.tensors),
                   total_bytes=p.total_bytes, source_checksum=p.source_checksum, device_uuid=p.device_uuid,
                   vmm=p.vmm)

    def tensor(self, name: str) -> WeightTensor:
        """The entry named `name`; KeyError if the set has none."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"weight set {self.name!r} has no tensor {name!r}")


@dataclass(frozen=True)
class LoadProgress:
    """One progress message of a load: tensors and bytes done out of the totals."""

    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class LoadedWeights:
    """A finished load: the set's manifest and the seconds the daemon took."""

    manifest: WeightManifest
    load_seconds: float


@dataclass(frozen=True)
class WeightSetInfo:
    """One resident set and its open attachments."""

    manifest: WeightManifest
    attachments: int


@dataclass(frozen=True)
class WeightSets:
    """The daemon's sets, its --weights-budget (0: unlimited) and the bytes the sets hold."""

    sets: Tuple[WeightSetInfo, ...]
    budget_bytes: int
    resident_bytes: int

    def get(self, name: str) -> Optional[WeightSetInfo]:
        """The set named `name`, or None."""
        for s in self.sets:
            if s.manifest.name == name:
                return s
        return None


# -- rules --------------------------------------------------------------------------------------


def _slice_from_text(text: str, where: str) -> Tuple[str, Optional[Slice]]:
    """`text` without its ":slice=AXIS/START/LENGTH" field, and that slice (None without one)."""
    fields = text.split(":")
    for i, f in enumerate(fields[1:], 1):
        if f.startswith("slice="):
            parts = f[len("slice="):].split("/")
            try:
                if len(parts) != 3:
                    raise ValueError
                sl = Slice(*(int(x) for x in parts))
            except ValueError:
                raise ValueError(f"{where}: {f!r}: want slice=AXIS/START/LENGTH") from None
            return ":".join(fields[:i] + fields[i + 1:]), sl
    return text, None


def _action_from_text(text: str, where: str) -> Action:
    fields = text.split(":")
    if fields[0] == "verbatim" and len(fields) == 1:
        return "verbatim"
    if "checkpoint" in fields[1:]:
        fields.remove("checkpoint")
        spec = _action_from_text(":".join(fields), where)
        if not isinstance(spec, Spec):
            raise ValueError(f"{where}: checkpoint is for a layout")
        return Checkpoint(spec)
    kw: Dict[str, int] = {}
    for f in fields[1:]:
        key, eq, value = f.partition("=")
        if not eq:
            raise ValueError(f"{where}: {f!r} is not param=value")
        if key not in _RULE_PARAMS:
            raise ValueError(f"{where}: unknown param {key!r} (one of {', '.join(_RULE_PARAMS)})")
        try:
            kw[key] = int(value)
        except ValueError:
            raise ValueError(f"{where}: {key} must be an int; got {value!r}") from None
    try:
        return Spec(fields[0], **kw)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def parse_rules(rules: Rules) -> List[pb.WeightRule]:
    """The wprep.v1.WeightRule list of `rules`, in order (the first match wins):

    - a string in the CLI's --rules syntax, "PATTERN=LAYOUT[:param=value...]" separated by
      ';' ("*_blocks=hopper_value:checkpoint;*_scales=hopper_scale:checkpoint;lm_head*=verbatim"),
      each optionally with ":slice=AXIS/START/LENGTH";
    - a mapping (in its order) of pattern -> action or (action, Slice), or a sequence of
      (pattern, action) pairs or (pattern, action, Slice) triples, where an action is a Spec
      (a swizzle of the tensor's bytes as its dense input), Checkpoint(Spec) (of an MXFP4
      checkpoint's *_blocks / *_scales as stored), "verbatim", or "LAYOUT[:param=value...]".

    A Slice keeps only that slice of each matched tensor (a rank's shard), cut from the
    stored tensor before its conversion. ValueError for a rule the client can tell is bad;
    the daemon checks the rest.
    """
    if rules is None:
        return []
    triples: List[Tuple[Any, Any, Optional[Slice]]] = []
    if isinstance(rules, str):
        for part in (p.strip() for p in rules.split(";")):
            if not part:
                continue
            eq = part.rfind("=", 0, part.find(":") if ":" in part else len(part))
            if eq <= 0:
                raise ValueError(f"rules {part!r}: want PATTERN=LAYOUT[:param=value...]")
            text, sl = _slice_from_text(part[eq + 1:], f"rules {part!r}")
            triples.append((part[:eq], _action_from_text(text, f"rules {part!r}"), sl))
    else:
        items = list(rules.items()) if isinstance(rules, Mapping) else [tuple(r) for r in rules]  # type: ignore[misc]
        for i, item in enumerate(items):
            if isinstance(rules, Mapping) and isinstance(item[1], tuple) and not isinstance(item[1], Slice):
                item = (item[0],) + tuple(item[1])
            if len(item) not in (2, 3):
                raise TypeError(f"rules[{i}]: want (pattern, action) or (pattern, action, Slice); got {item!r}")
            sl = item[2] if len(item) == 3 else None
            if sl is not None and not isinstance(sl, Slice):
                if not (isinstance(sl, tuple) and len(sl) == 3 and all(isinstance(x, int) for x in sl)):
                    raise TypeError(f"rules[{i}]: a slice is a wprep.weights.Slice(axis, start, length); got {sl!r}")
                sl = Slice(*sl)
            triples.append((item[0], item[1], sl))
    out = []
    for i, (pattern, action, sl) in enumerate(triples):
        if not isinstance(pattern, str):
            raise TypeError(f"rules[{i}]: the pattern must be a str; got {pattern!r}")
        if isinstance(action, str):
            action = _action_from_text(action, f"rules[{i}] ({pattern!r})")
        if isinstance(action, str):  # "verbatim"
            rule = pb.WeightRule(pattern=pattern, verbatim=True)
        elif isinstance(action, Spec):
            rule = pb.WeightRule(pattern=pattern, convert=action.to_proto())
        elif isinstance(action, Checkpoint) and isinstance(action.spec, Spec):
            rule = pb.WeightRule(pattern=pattern, convert=action.spec.to_proto(), checkpoint=True)
        else:
            raise TypeError(f"rules[{i}] ({pattern!r}): an action is a Spec, Checkpoint(Spec), 'verbatim' or "
                            f"'LAYOUT[:param=value...]'; got {action!r}")
        if sl is not None:
            rule.slice.CopyFrom(pb.WeightSlice(axis=sl.axis, start=sl.start, length=sl.length))
        out.append(rule)
    return out


# -- progress -----------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


class _Bar:
    """A one-line bar on a terminal (stderr), redrawn in place."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._drawn = False

    def __call__(self, p: LoadProgress) -> None:
        frac = p.bytes_done / p.bytes_total if p.bytes_total else 1.0
        filled = int(30 * frac)
        self._stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {p.tensors_done}/{p.tensors_total} tensors "
                           f"{_gib(p.bytes_done)} of {_gib(p.bytes_total)}")
        self._stream.flush()
        self._drawn = True

    def finish(self) -> None:
        if self._drawn:
            self._stream.write("\n")
            self._stream.flush()


# A load's progress argument: a callable, "auto", "bar", "none", True, False or None.
Progress = Union[None, bool, str, Callable[[LoadProgress], Any]]


def _progress_sink(progress: Progress) -> Tuple[Optional[Callable[[LoadProgress], Any]], Optional[_Bar]]:
    if callable(progress):
        return progress, None
    if progress in (None, False, "none"):
        return None, None
    if progress in (True, "bar") or (progress == "auto" and sys.stderr is not None and sys.stderr.isatty()):
        bar = _Bar(sys.stderr)
        return bar, bar
    if progress == "auto":
        return None, None
    raise ValueError(f"progress must be a callable, 'auto', 'bar', 'none', True, False or None; got {progress!r}")


# -- calls --------------------------------------------------------------------------------------


def _client(client: Optional["Client"]) -> "Client":
    if client is not None:
        return client
    from ._mxfp4 import default_client
    return default_client()


def load(
    name: str,
    path: str,
    *,
    rules: Rules = None,
    client: Optional["Client"] = None,
    device: Union[None, int, str, "torch.device"] = None,
    device_uuid: Union[None, bytes, str] = None,
    vmm: bool = False,
    progress: Progress = "auto",
    timeout: Optional[float] = None,
) -> LoadedWeights:
    """Has the daemon load `path` (relative to its --weights-root: a .safetensors file, or a
    directory with model.safetensors.index.json or model.safetensors), prepare the tensors
    `rules` name (parse_rules), copy the rest, and keep the set as `name` (LoadWeights).

    progress: a callable given each LoadProgress; "auto" (default) a bar on stderr when it is
    a terminal; "bar" or True always; None, False or "none" nothing. device: the GPU to keep
    the set on, as torch names it ("cuda:1", 1, a torch.device; needs torch), or device_uuid:
    the same by UUID (16 bytes or "GPU-..."); neither: host memory, the CPU engine's. vmm:
    keep a GPU set in CUDA virtual memory (cuMemCreate) rather than cudaMalloc memory;
    attach() then maps it from a file descriptor the daemon passes over its Unix socket
    instead of a legacy IPC handle (what crosses containers that share only the socket's
    directory).
    timeout: seconds for the whole load (default: the Client's). client: the daemon's Client
    (default: wprep.default_client()).

    Raises WprepError: INVALID_ARGUMENT for a bad name, rule or checkpoint (naming the file
    and the tensor), PERMISSION_DENIED for a path outside --weights-root, NOT_FOUND for a
    missing file, ALREADY_EXISTS for a taken name, RESOURCE_EXHAUSTED past --weights-budget.
    """
    c = _client(client)
    if device is not None:
        if device_uuid is not None:
            raise ValueError("give device or device_uuid, not both")
        import torch

        from ._cuda import ipc

        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if d.type != "cuda":
            raise ValueError(f"device {device!r}: a weight set is kept on a CUDA device or, without one, on the host")
        device_uuid = ipc.device_uuid(torch.cuda.current_device() if d.index is None else d.index)
    req = pb.LoadWeightsRequest(name=name, path=path, rules=parse_rules(rules), device_uuid=uuid_bytes(device_uuid),
                                vmm=vmm)
    sink, bar = _progress_sink(progress)
    last = None
    try:
        for msg in c._weights.LoadWeights(req, timeout=c._timeout(timeout)):
            if msg.HasField("manifest"):
                last = msg
            if sink is not None:
                sink(LoadProgress(msg.tensors_done, msg.tensors_total, msg.bytes_done, msg.bytes_total))
    except grpc.RpcError as e:
        raise from_rpc_error(e, "LoadWeights") from None
    finally:
        if bar is not None:
            bar.finish()
    if last is None:
        raise WprepError(grpc.StatusCode.INTERNAL, f"LoadWeights of {name!r} ended without a manifest", "LoadWeights")
    return LoadedWeights(WeightManifest.from_proto(last.manifest), last.load_seconds)


def list_sets(*, with_tensors: bool = False, client: Optional["Client"] = None,
              timeout: Optional[float] = None) -> WeightSets:
    """The resident sets and their attachment counts (ListWeights); each manifest's tensors only
    with `with_tensors`."""
    c = _client(client)
    resp = c._unary_weights("ListWeights", pb.ListWeightsRequest(with_tensors=with_tensors), timeout)
    return WeightSets(
        sets=tuple(WeightSetInfo(WeightManifest.from_proto(s.manifest), s.attachments) for s in resp.sets),
        budget_bytes=resp.budget_bytes, resident_bytes=resp.resident_bytes)


def wait(name: str, *, timeout: float = 600.0, poll: float = 0.1, client: Optional["Client"] = None) -> WeightSetInfo:
    """Waits until set `name` is resident (a daemon's --preload, or another process's load, is
    still making it) and returns its entry of list_sets. TimeoutError after `timeout` s."""
    c = _client(client)
    deadline = time.monotonic() + timeout
    while True:
        info = list_sets(client=c).get(name)
        if info is not None:
            return info
        if time.monotonic() >= deadline:
            raise TimeoutError(f"weight set {name!r} is not resident after {timeout} s")
        time.sleep(poll)


def drop(name: str, *, force: bool = False, client: Optional["Client"] = None, timeout: Optional[float] = None) -> int:
    """Frees set `name` and returns the bytes freed (DropWeights). WprepError NOT_FOUND for an
    unknown set, FAILED_PRECONDITION while attached unless `force` (the attachments then end:
    their views stay readable, their `alive` turns False)."""
    c = _client(client)
    resp = c._unary_weights("DropWeights", pb.DropWeightsRequest(name=name, force=force), timeout)
    return int(resp.freed_bytes)


def attach(name: str, *, client: Optional["Client"] = None) -> "AttachedWeights":
    """Attaches to set `name` (AttachWeights) and maps its memory: see AttachedWeights.
    WprepError NOT_FOUND for an unknown set."""
    c = _client(client)
    call = c._weights.AttachWeights(pb.AttachWeightsRequest(name=name))
    try:
        first = next(call)
    except grpc.RpcError as e:
        raise from_rpc_error(e, "AttachWeights") from None
    except StopIteration:
        raise WprepError(grpc.StatusCode.INTERNAL, f"AttachWeights of {name!r} ended without its message",
                         "AttachWeights") from None
    try:
        return AttachedWeights(c, call, first)
    except BaseException:
        call.cancel()
        raise


class AttachedWeights(Mapping[str, Any]):
    """An open attachment to a set: a read-only mapping of tensor name -> zero-copy view of the
    set's memory with the manifest's dtype, shape and strides. A host set's views are numpy
    arrays over the set's file, mapped read-only; a GPU set's are CUDA torch tensors on
    `device`, over the set's allocation opened from its CUDA IPC handle, or for a set in CUDA
    virtual memory mapped from the descriptor fetched over the daemon's handle socket (needs
    torch; a VMM set attaches over a Unix-socket Client only).

    manifest, attachment_id, shm_path / ipc_handle: what the daemon sent. identity(name): the
    layout identity of a converted tensor (None for a copy). torch_tensors(): the views as
    torch tensors (for a host set torch.frombuffer over the mapping, no copy). alive: False
    once the attachment has ended (close(), a forced drop, the daemon stopping).

    The bytes are read-only by contract. close() (or leaving the with block) detaches. A host
    set's views stay valid after it (the mapping goes with the last of them). A GPU set's
    memory is freed when the set is dropped, which the daemon allows once no attachment holds
    it: do not use a GPU set's views after close().
    """

    def __init__(self, client: "Client", call: Any, first: pb.AttachWeightsResponse) -> None:
        self._client = client
        self._call = call
        self._closed = False
        self.attachment_id: int = first.attachment_id
        self.manifest = WeightManifest.from_proto(first.manifest)
        self.shm_path: str = first.shm_path
        self.ipc_handle: bytes = first.ipc_handle
        self.device: Optional["torch.device"] = None
        self._by_name = {t.name: t for t in self.manifest.tensors}
        self._buffer: Union[mmap.mmap, bytes] = b""
        self._flat: Optional["torch.Tensor"] = None
        self.vmm_token: bytes = first.vmm.token
        if self.ipc_handle or self.vmm_token:
            self._arrays: Dict[str, Any] = self._open_on_gpu()
            return
        if not self.shm_path:
            raise WprepError(grpc.StatusCode.INTERNAL,
                             f"AttachWeights of {self.manifest.name!r} gave neither a file nor an IPC handle",
                             "AttachWeights")
        self._buffer = _map_read_only(self.shm_path, self.manifest.total_bytes)
        self._arrays = {t.name: _numpy_view(self._buffer, t) for t in self.manifest.tensors}

    def _open_on_gpu(self) -> Dict[str, "torch.Tensor"]:
        """A GPU set: its allocation opened from the IPC handle, every tensor a torch view."""
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"weight set {self.manifest.name!r} is on a GPU; attaching to it needs torch: {e}") from e
        from ._cuda import ipc

        index = ipc.device_index_of_uuid(self.manifest.device_uuid)
        if index is None:
            raise WprepError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"weight set {self.manifest.name!r} is on GPU {_uuid_string(self.manifest.device_uuid)}, "
                             f"which this process does not see (CUDA_VISIBLE_DEVICES?)", "AttachWeights")
        self.device = torch.device("cuda", index)
        opened: Any
        if self.vmm_token:
            socket_path = ipc.unix_socket_path(self._client.target)
            if socket_path is None:
                raise WprepError(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"weight set {self.manifest.name!r} is in CUDA virtual memory: attach over the "
                                 f"daemon's Unix socket, not {self._client.target}", "AttachWeights")
            fd, chunk_bytes = ipc.fetch_vmm_descriptor(socket_path, self.vmm_token)
            opened = ipc.OpenedVmm(fd, chunk_bytes, index, max(self.manifest.total_bytes, 1))
        else:
            opened = ipc.OpenedIpc(self.ipc_handle, index, max(self.manifest.total_bytes, 1))
        self._flat = torch.as_tensor(opened, device=self.device)
        return {t.name: _torch_view(torch, self._flat, t) for t in self.manifest.tensors}

    # Mapping
    def __getitem__(self, name: str) -> np.ndarray:
        self._check_open()
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def entry(self, name: str) -> WeightTensor:
        """The manifest entry of tensor `name`."""
        return self._by_name[name]

    def raw(self, name: str) -> Any:
        """Tensor `name`'s bytes in memory order, as a flat uint8 view: numpy for a host set, a
        CUDA torch tensor for a GPU set (what a layout's strides address)."""
        self._check_open()
        t = self._by_name[name]
        if self.device is not None:
            return self._flat[t.offset:t.offset + t.bytes]
        return np.frombuffer(self._buffer, dtype=np.uint8, count=t.bytes, offset=t.offset) if t.bytes else \
            np.empty(0, np.uint8)

    def identity(self, name: str) -> Optional[LayoutIdentity]:
        """The layout identity of tensor `name`: set for a converted tensor, None for a copy."""
        return self._by_name[name].identity

    def numpy(self) -> Dict[str, np.ndarray]:
        """Every tensor as a numpy view (BF16 and FP8 as unsigned integers of their width).
        Host sets only: a GPU set's tensors are CUDA tensors (torch_tensors())."""
        self._check_open()
        if self.device is not None:
            raise TypeError(f"weight set {self.manifest.name!r} is on {self.device}: use torch_tensors()")
        return dict(self._arrays)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the attachment to weight set {self.manifest.name!r} is closed")

    def torch_tensors(self) -> Dict[str, "torch.Tensor"]:
        """Every tensor as a torch tensor viewing the set's memory (no copy), with its real dtype
        (bfloat16, float8_*): CPU tensors over the mapping of a host set, CUDA tensors on
        `device` for a GPU set. Read-only by contract: torch cannot mark them so."""
        self._check_open()
        if self.device is not None:
            return dict(self._arrays)
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"torch_tensors() needs torch, which is not importable: {e}") from e
        if not len(self._buffer):
            flat = torch.empty(0, dtype=torch.uint8)
        else:
            with warnings.catch_warnings():
                # The mapping is read-only; torch warns that it cannot say so on the tensor.
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(self._buffer, dtype=torch.uint8)
        return {t.name: _torch_view(torch, flat, t) for t in self.manifest.tensors}

    @property
    def alive(self) -> bool:
        """True while the attachment lasts (its stream is open)."""
        return not self._closed and not self._call.done()

    def close(self, timeout: Optional[float] = None) -> None:
        """Detaches: DetachWeights, then waits (up to `timeout`, default the Client's) for the
        daemon to end the stream, so that ListWeights no longer counts the attachment when this
        returns. Idempotent. The views stay valid."""
        if self._closed:
            return
        self._closed = True
        ended = threading.Event()
        self._call.add_done_callback(lambda _: ended.set())
        try:
            if not self._call.done():
                self._client._unary_weights("DetachWeights",
                                            pb.DetachWeightsRequest(attachment_id=self.attachment_id), timeout)
                # The daemon forgets the attachment once the stream's handler returns.
                ended.wait(self._client._timeout(timeout))
        except WprepError as e:
            # Already ended (a forced drop) or no daemon: the attachment is gone either way.
            if e.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                raise
        finally:
            self._call.cancel()
            # Never mmap.close(): numpy keeps a reference to the mapping, not a buffer export,
            # so closing would unmap memory live views still read. Dropping ours unmaps it
            # once the last view is gone.
            self._arrays = {}
            self._buffer = b""
            self._flat = None

    def __enter__(self) -> "AttachedWeights":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._call.cancel()

    def __repr__(self) -> str:
        state = "attached" if self.alive else "closed"
        return (f"AttachedWeights({self.manifest.name!r}, {len(self.manifest.tensors)} tensors, "
                f"{self.manifest.total_bytes} bytes, {state})")


def _map_read_only(path: str, total_bytes: int) -> Union[mmap.mmap, bytes]:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size < total_bytes:
            raise WprepError(grpc.StatusCode.DATA_LOSS,
                             f"{path} holds {size} bytes, the manifest {total_bytes}", "AttachWeights")
        if size == 0:
            return b""  # mmap refuses empty files; a set of empty tensors needs no memory
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def _numpy_view(buffer: Union[mmap.mmap, bytes], t: WeightTensor) -> np.ndarray:
    if t.dtype not in _NP_DTYPES:
        raise WprepError(grpc.StatusCode.UNIMPLEMENTED, f"tensor {t.name!r}: unknown dtype {t.dtype}", "AttachWeights")
    dtype = np.dtype(_NP_DTYPES[t.dtype])
    strides = tuple(s * dtype.itemsize for s in t.strides)
    if any(d == 0 for d in t.shape) or not len(buffer):
        return np.empty(t.shape, dtype=dtype)
    a = np.ndarray(t.shape, dtype=dtype, buffer=buffer, offset=t.offset, strides=strides)
    a.flags.writeable = False
    return a


def _torch_view(torch: Any, flat: "torch.Tensor", t: WeightTensor) -> "torch.Tensor":
    dtype = getattr(torch, _TORCH_DTYPES.get(t.dtype, ""), None)
    if dtype is None and t.dtype in _TORCH_FALLBACK:
        dtype = getattr(torch, _TORCH_FALLBACK[t.dtype])  # the raw bits, as numpy gives them
    if dtype is None:
        raise TypeError(f"tensor {t.name!r}: this torch has no dtype for {t.dtype}")
    if any(d == 0 for d in t.shape):
        return torch.empty(t.shape, dtype=dtype, device=flat.device)
    return flat[t.offset:t.offset + t.bytes].view(dtype).as_strided(t.shape, t.strides)
