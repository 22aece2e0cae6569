"""trtllm-gen MoE weight preparation (FlashInfer's Blackwell fused MoE) through wprepd.

    import wprep.trtllm as tg
    w13 = tg.prepare_w13(values, scales, bias)                  # mxfp4, align 256
    w13.values, w13.scales, w13.bias, w13.identity.description
    w13, w2 = tg.prepare_layer((v13, s13, b13), (v2, s2, b2))   # one round trip
    tg.prepare_w13(values, scales, format="nvfp4", gated=True, align_h=256, align_i=64,
                   out=(param_values, param_scales))            # in place, addresses kept
    tg.run_op("row_shuffle", x, epilogue_tile_m=128)            # a single step

Inputs are in checkpoint order, as the contract (TRTLLM_GEN.md) says: numpy arrays
(uint8, float32; bfloat16 as uint16 bit patterns) or torch tensors (uint8, float32,
bfloat16 and the fp8 dtypes, as their bytes). numpy arrays and CPU tensors travel inline
and the daemon's CPU engine prepares them. When every input is a contiguous CUDA tensor and
`out=` gives every output as a contiguous CUDA tensor on the same GPU, the daemon reads and
writes them in place through CUDA IPC on that GPU (no copies, no device memory of its own);
the client synchronizes the inputs' current stream first, and the outputs are complete when
the call returns. CUDA tensors without `out=` are copied through the host.

`out=`: the outputs in the op's order (values, scales, bias, whichever the format has),
existing numpy arrays or tensors of exactly the output's bytes, written in place: their
addresses (ndarray.ctypes.data, tensor.data_ptr()) do not change. Without `out=` the
results are new numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import _torch
from ._errors import WprepError
from .v1 import wprep_pb2 as pb

CONTRACT_VERSION = 1

_NP_DTYPE = {pb.MOE_DTYPE_UINT8: np.uint8, pb.MOE_DTYPE_FLOAT32: np.float32, pb.MOE_DTYPE_BFLOAT16: np.uint16}
_PARAMS = ("format", "gated", "align", "align_h", "align_i", "block_k", "axis", "epilogue_tile_m", "num_elts_per_sf")


@dataclass(frozen=True)
class MoeIdentity:
    """What produced an output: the format ("" for a single step), op, params as used and
    the contract version. The results of one call that have the same identity share one
    object: treat it, params included, as read-only."""

    format: str
    op: str
    params: Dict[str, Any]
    contract_version: int
    description: str


@dataclass
class MoeResult:
    """The outputs of one op, by name (values/scales/bias, or y), in the op's order."""

    outputs: Dict[str, Any]
    identity: MoeIdentity
    engine: str = ""
    shapes: Dict[str, Tuple[int, ...]] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        outputs = self.__dict__.get("outputs", {})
        if name in ("values", "scales", "bias", "y"):
            return outputs.get(name)
        raise AttributeError(name)


def _bad(msg: str) -> WprepError:
    return WprepError(grpc.StatusCode.INVALID_ARGUMENT, msg)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _as_input(m: "pb.MoeInput", name: str, x: Any) -> "pb.MoeInput":
    """Fills `m` (a field of the request: the bytes are not copied again) with numpy array or
    torch tensor `x` as a MoeInput of its dense bytes."""
    m.name = name
    if _is_torch(x):
        import torch

        t = x.detach()
        if t.dtype == torch.float32:
            m.dtype = pb.MOE_DTYPE_FLOAT32
        elif t.dtype == torch.bfloat16:
            m.dtype = pb.MOE_DTYPE_BFLOAT16
        elif t.element_size() == 1:  # uint8, int8, the fp8 dtypes: their bytes
            m.dtype = pb.MOE_DTYPE_UINT8
        else:
            raise _bad(f"{name}: dtype {t.dtype} is not one the contract takes (uint8/fp8, float32, bfloat16)")
        m.shape.extend(t.shape)
        flat = t.contiguous().reshape(-1)
        if flat.is_cuda:
            flat = flat.cpu()
        m.source.inline_bytes = flat.view(torch.uint8).numpy().tobytes()
        return m
    a = np.asarray(x)
    if a.dtype == np.uint8 or a.dtype == np.int8:
        m.dtype = pb.MOE_DTYPE_UINT8
    elif a.dtype == np.float32:
        m.dtype = pb.MOE_DTYPE_FLOAT32
    elif a.dtype == np.uint16:
        m.dtype = pb.MOE_DTYPE_BFLOAT16  # bfloat16 bit patterns
    else:
        raise _bad(f"{name}: numpy dtype {a.dtype} is not uint8, float32 or uint16 (bfloat16 bits)")
    m.shape.extend(a.shape)
    m.source.inline_bytes = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
    return m


# torch dtype -> MoeDType, filled as dtypes are first seen (a dtype the contract refuses is
# never stored: it raises every time).
_TORCH_DTYPES: Dict[Any, int] = {}


def _dtype_of_tensor(name: str, t: Any) -> int:
    code = _TORCH_DTYPES.get(t.dtype)
    if code is not None:
        return code
    import torch

    if t.dtype == torch.float32:
        code = pb.MOE_DTYPE_FLOAT32
    elif t.dtype == torch.bfloat16:
        code = pb.MOE_DTYPE_BFLOAT16
    elif t.element_size() == 1:
        code = pb.MOE_DTYPE_UINT8
    else:
        raise _bad(f"{name}: dtype {t.dtype} is not one the contract takes (uint8/fp8, float32, bfloat16)")
    _TORCH_DTYPES[t.dtype] = code
    return code


def _ipc_eligible(inputs: Sequence[Tuple[str, Any]], out: Optional[Sequence[Any]]) -> Optional[int]:
    """The one GPU of every input and every out= when all are CUDA tensors (the in-place IPC
    path), else None."""
    given = [x for _, x in inputs if x is not None]
    if out is None or not given:
        return None
    device = None
    for x in given + list(out):
        if not _torch.is_cuda_tensor(x):
            return None
        index = x.device.index
        if device is None:
            device = index
        elif index != device:
            return None
    return device


def _locate(name: str, t: Any, device: int, registry: Any) -> Tuple[Any, int, int]:
    """Where the bytes of contiguous CUDA tensor `t` are: (its storage's export, the
    registry's or made now; the byte offset in that export; the bytes). No view of the tensor
    is made: a contiguous tensor's bytes are numel * element_size from storage_offset *
    element_size, as a flat uint8 view of it would say."""
    if not t.is_contiguous():
        raise _bad(f"{name}: a CUDA tensor read or written in place must be contiguous")
    size = t.element_size()
    nbytes = t.numel() * size
    hit = registry.locate(device, int(t.data_ptr()), nbytes)  # registered: no storage object made
    if hit is not None:
        return hit[0], hit[1], nbytes
    shared = _torch.shared_storage(t.untyped_storage(), device, registry)
    return shared, shared.offset + t.storage_offset() * size, nbytes


def _write_ipc(b: "pb.CudaIpcBuffer", where: Tuple[Any, int, int]) -> None:
    shared, offset, size = where
    if shared.vmm is not None:
        b.vmm.CopyFrom(shared.vmm)
    else:
        b.handle = shared.handle
    b.offset = offset
    b.size = size
    b.device_uuid = shared.device_uuid


# Validated params, as (name, type, value) tuples without the unset ones (the type keeps
# True and 1 apart): checked once each.
_VALID_PARAMS: Dict[Tuple[Any, ...], bool] = {}
# (op, params key, ((input name, dtype, shape), ...), output names) -> a MoeItem with all but
# the IPC buffers: a model's layers repeat a few shapes, so an item is one CopyFrom and its
# buffers. Shared: copied, never changed. Bounded: cleared when full.
_TEMPLATES: Dict[Tuple[Any, ...], "pb.MoeItem"] = {}
_TEMPLATES_MAX = 1024


def _params_key(params: Dict[str, Any]) -> Tuple[Any, ...]:
    """The params' key, after checking them as _item does (unknown names; values the
    message refuses raise protobuf's error)."""
    key = tuple((k, type(v), v) for k, v in params.items() if v is not None)
    try:
        if key in _VALID_PARAMS:
            return key
    except TypeError:  # an unhashable value: protobuf's own error below
        pass
    _item(pb.MoeItem(), "", [], params)
    if len(_VALID_PARAMS) >= _TEMPLATES_MAX:
        _VALID_PARAMS.clear()
    _VALID_PARAMS[key] = True
    return key


def _template(op: str, pkey: Tuple[Any, ...], sig: Tuple[Tuple[str, int, Tuple[int, ...]], ...],
              out_names: Tuple[str, ...]) -> "pb.MoeItem":
    key = (op, pkey, sig, out_names)
    t = _TEMPLATES.get(key)
    if t is None:
        t = pb.MoeItem(op=op)
        for k, _, v in pkey:
            setattr(t.params, k, v)
        for name, dtype, shape in sig:
            t.inputs.add(name=name, dtype=dtype, shape=shape)
        for name in out_names:
            t.outputs.add(name=name)
        if len(_TEMPLATES) >= _TEMPLATES_MAX:
            _TEMPLATES.clear()
        _TEMPLATES[key] = t
    return t


def _ipc_item(op: str, inputs: Sequence[Tuple[str, Any]], params: Dict[str, Any], out: Sequence[Any],
              registry: Any, into: Optional["pb.MoeItem"] = None, device: Optional[int] = None) -> "pb.MoeItem":
    """A MoE item whose operands are the tensors themselves, by CUDA IPC, written into `into`
    (a new MoeItem when None). The outputs are named as the op names them: y for a single
    step, else those of the given inputs. `device`: the tensors' one GPU, when known.
    Checks, in order: the params, then each input (dtype, contiguity, export), then the
    number of outputs, then each output."""
    pkey = _params_key(params)
    given = [(name, x) for name, x in inputs if x is not None]
    if device is None and given:
        device = given[0][1].device.index
    sig = []
    where = []
    for name, x in given:
        sig.append((name, _dtype_of_tensor(name, x), tuple(x.shape)))
        where.append(_locate(name, x, device, registry))
    names = [name for name, _ in given]
    out_names = ("y",) if names == ["x"] else tuple(names)
    if len(out) != len(out_names):
        raise _bad(f"out has {len(out)} tensors; {op} with these inputs writes {len(out_names)} ({', '.join(out_names)})")
    out_where = [_locate(f"out {name}", t, device, registry) for name, t in zip(out_names, out)]
    item = pb.MoeItem() if into is None else into
    item.CopyFrom(_template(op, pkey, tuple(sig), out_names))
    for m, w in zip(item.inputs, where):
        _write_ipc(m.source.ipc, w)
    for o, w in zip(item.outputs, out_where):
        _write_ipc(o.destination.ipc, w)
    return item


def _item(item: "pb.MoeItem", op: str, inputs: Sequence[Tuple[str, Any]], params: Dict[str, Any]) -> "pb.MoeItem":
    """Fills `item` (a field of the request, or a new message) with an inline MoE item."""
    item.op = op
    for k, v in params.items():
        if v is None:
            continue
        if k not in _PARAMS:
            raise _bad(f"unknown param {k!r}; the params are {', '.join(_PARAMS)}")
        setattr(item.params, k, v)
    for name, x in inputs:
        if x is not None:
            _as_input(item.inputs.add(), name, x)
    return item


def _params_dict(p: "pb.MoeParams") -> Dict[str, Any]:
    return {k: getattr(p, k) for k in _PARAMS if p.HasField(k)}


def _write_out(name: str, data: bytes, dst: Any) -> None:
    """Copies `data` into the existing array or tensor `dst` in place."""
    if _is_torch(dst):
        import torch

        if not dst.is_contiguous() or dst.numel() * dst.element_size() != len(data):
            raise _bad(f"out {name}: needs a contiguous tensor of {len(data)} bytes, got {tuple(dst.shape)} "
                       f"{dst.dtype}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        dst.view(-1).view(torch.uint8).copy_(src)
        return
    if not isinstance(dst, np.ndarray) or not dst.flags.c_contiguous or dst.nbytes != len(data):
        raise _bad(f"out {name}: needs a C-contiguous numpy array of {len(data)} bytes")
    dst.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)


def _result(item: "pb.BatchItemResult", out: Optional[Sequence[Any]]) -> MoeResult:
    outs: Dict[str, Any] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    if out is not None and len(out) != len(item.outputs):
        names = ", ".join(t.name for t in item.outputs)
        raise _bad(f"out has {len(out)} tensors; this op writes {len(item.outputs)} ({names})")
    for j, t in enumerate(item.outputs):
        shapes[t.name] = tuple(t.shape)
        if out is not None:
            _write_out(t.name, t.inline_bytes, out[j])
            outs[t.name] = out[j]
        else:
            outs[t.name] = np.frombuffer(t.inline_bytes, dtype=_NP_DTYPE[t.dtype]).reshape(tuple(t.shape)).copy()
    ident = item.outputs[0].moe_identity if len(item.outputs) else pb.MoeIdentity()
    return MoeResult(
        outs,
        MoeIdentity(ident.format, ident.op, _params_dict(ident.params), ident.contract_version, ident.description),
        item.engine,
        shapes,
    )


def _call(specs: List[Tuple[str, List[Tuple[str, Any]], Dict[str, Any]]], outs: List[Optional[Sequence[Any]]],
          client: Any, timeout: Optional[float]) -> List[MoeResult]:
    """One ConvertBatch of the items `specs` (op, named inputs, params), out= per item."""
    if client is None:
        from ._mxfp4 import default_client

        client = default_client()
    req = pb.ConvertBatchRequest()
    in_place = []
    devices = set()
    for (op, inputs, params), out in zip(specs, outs):
        device = _ipc_eligible(inputs, out)
        in_place.append(device is not None)
        if device is not None:
            _ipc_item(op, inputs, params, out, client._registry, req.items.add().moe, device)  # type: ignore[arg-type]
            devices.add(device)
        else:
            _item(req.items.add().moe, op, inputs, params)
    if devices:
        _torch.synchronize(devices)  # the producers' writes land before the daemon reads
    resp = client._unary("ConvertBatch", req, timeout)
    # Every inline out= is checked against its output's size before any is written.
    for item, out, ipc in zip(resp.items, outs, in_place):
        if out is None or ipc:
            continue
        if len(out) != len(item.outputs):
            names = ", ".join(t.name for t in item.outputs)
            raise _bad(f"out has {len(out)} tensors; this op writes {len(item.outputs)} ({names})")
        for t, dst in zip(item.outputs, out):
            n = dst.numel() * dst.element_size() if _is_torch(dst) else getattr(dst, "nbytes", -1)
            if n != len(t.inline_bytes):
                raise _bad(f"out {t.name}: needs {len(t.inline_bytes)} bytes, got {n}")
    results = []
    identities: Dict[bytes, MoeIdentity] = {}  # a batch's items share a few identities
    for item, out, ipc in zip(resp.items, outs, in_place):
        if ipc:  # written in place already
            outputs = item.outputs
            results.append(MoeResult({t.name: dst for t, dst in zip(outputs, out)},
                                     _identity(outputs[0].moe_identity, identities), item.engine,
                                     {t.name: tuple(t.shape) for t in outputs}))
        else:
            results.append(_result(item, out))
    return results


def _identity(ident: "pb.MoeIdentity", seen: Dict[bytes, MoeIdentity]) -> MoeIdentity:
    """The MoeIdentity of `ident`, made once per distinct identity of a call."""
    key = ident.SerializeToString()
    got = seen.get(key)
    if got is None:
        got = seen[key] = MoeIdentity(ident.format, ident.op, _params_dict(ident.params), ident.contract_version,
                                      ident.description)
    return got


def _prepare_spec(op: str, values: Any, scales: Any, bias: Any,
                  params: Dict[str, Any]) -> Tuple[str, List[Tuple[str, Any]], Dict[str, Any]]:
    return op, [("values", values), ("scales", scales), ("bias", bias)], params


def prepare_w13(values: Any, scales: Any = None, bias: Any = None, *, format: Optional[str] = None,
                gated: Optional[bool] = None, align: Optional[int] = None, align_h: Optional[int] = None,
                align_i: Optional[int] = None, out: Optional[Sequence[Any]] = None, client: Any = None,
                timeout: Optional[float] = None) -> MoeResult:
    """w13 (gate and up projections) of every expert into the trtllm-gen layout: the
    contract's prepare_w13 for `format` (mxfp4 when None: align; nvfp4: gated, align_h,
    align_i; mxfp8, fp8_block: gated; fp8, bf16: gated, align_i). Raises WprepError
    (INVALID_ARGUMENT naming the operand) on bad input."""
    params = dict(format=format, gated=gated, align=align, align_h=align_h, align_i=align_i)
    return _call([_prepare_spec("prepare_w13", values, scales, bias, params)], [out], client, timeout)[0]


def prepare_w2(values: Any, scales: Any = None, bias: Any = None, *, format: Optional[str] = None,
               align: Optional[int] = None, align_h: Optional[int] = None, align_i: Optional[int] = None,
               out: Optional[Sequence[Any]] = None, client: Any = None,
               timeout: Optional[float] = None) -> MoeResult:
    """w2 (down projection) of every expert into the trtllm-gen layout (prepare_w2)."""
    params = dict(format=format, align=align, align_h=align_h, align_i=align_i)
    return _call([_prepare_spec("prepare_w2", values, scales, bias, params)], [out], client, timeout)[0]


def prepare_layer(w13: Sequence[Any], w2: Sequence[Any], *, format: Optional[str] = None,
                  gated: Optional[bool] = None, align: Optional[int] = None, align_h: Optional[int] = None,
                  align_i: Optional[int] = None, out13: Optional[Sequence[Any]] = None,
                  out2: Optional[Sequence[Any]] = None, client: Any = None,
                  timeout: Optional[float] = None) -> Tuple[MoeResult, MoeResult]:
    """w13 and w2 of one layer in one ConvertBatch: `w13` and `w2` are (values, scales,
    bias) tuples (shorter where the format has fewer tensors). Both are validated before
    either runs."""
    return prepare_layers([(w13, w2)], format=format, gated=gated, align=align, align_h=align_h, align_i=align_i,
                          out=None if out13 is None and out2 is None else [(out13, out2)], client=client,
                          timeout=timeout)[0]


def prepare_layers(layers: Sequence[Tuple[Sequence[Any], Sequence[Any]]], *, format: Optional[str] = None,
                   gated: Optional[bool] = None, align: Optional[int] = None, align_h: Optional[int] = None,
                   align_i: Optional[int] = None,
                   out: Optional[Sequence[Tuple[Optional[Sequence[Any]], Optional[Sequence[Any]]]]] = None,
                   client: Any = None, timeout: Optional[float] = None) -> List[Tuple[MoeResult, MoeResult]]:
    """Many layers' w13 and w2 in one ConvertBatch: `layers` is a sequence of (w13, w2), each
    as prepare_layer takes it; `out`, when given, one (out13, out2) per layer. Every item is
    validated before any runs; the daemon queues the CUDA IPC items of one GPU on one stream
    and waits once, so a whole model costs one round trip and one synchronization."""
    def pad(t: Sequence[Any]) -> List[Any]:
        return list(t) + [None] * (3 - len(t))

    if out is not None and len(out) != len(layers):
        raise _bad(f"out has {len(out)} entries; give one (out13, out2) per layer ({len(layers)})")
    p13 = dict(format=format, gated=gated, align=align, align_h=align_h, align_i=align_i)
    p2 = dict(format=format, align=align, align_h=align_h, align_i=align_i)
    specs: List[Tuple[str, List[Tuple[str, Any]], Dict[str, Any]]] = []
    outs: List[Optional[Sequence[Any]]] = []
    for k, (w13, w2) in enumerate(layers):
        v13, s13, b13 = pad(w13)
        v2, s2, b2 = pad(w2)
        specs += [_prepare_spec("prepare_w13", v13, s13, b13, p13), _prepare_spec("prepare_w2", v2, s2, b2, p2)]
        o13, o2 = (None, None) if out is None else out[k]
        outs += [o13, o2]
    r = _call(specs, outs, client, timeout)
    return [(r[2 * k], r[2 * k + 1]) for k in range(len(layers))]


def run_op(op: str, x: Any, *, out: Any = None, client: Any = None, timeout: Optional[float] = None,
           **params: Any) -> MoeResult:
    """One single step of the contract (swap_pairs, gated_act_reorder, row_shuffle,
    swap_halves, block_layout, bias_shuffle, scale_row_shuffle, block_scale_interleave,
    shuffle_sf_a) on input `x`; its output is `y` (written into `out` when given)."""
    return _call([(op, [("x", x)], params)], [None if out is None else [out]], client, timeout)[0]
