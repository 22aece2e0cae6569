"""quantize_mxfp4: bf16, fp16 or fp32 weights into MXFP4 values and e8m0 scales, by wprepd.

    values, scales = wprep.quantize_mxfp4(w)                          # numpy in, numpy out
    q = wprep.quantize_mxfp4(w_cuda, layout="blackwell_value")        # CUDA tensor, in place
    q.values, q.scales, q.value_identity.conversion

One quantize item (ConvertBatchRequest.items[0].quantize) per call, as docs/LAYOUTS.md,
"Quantization to MXFP4", defines it: groups of 32 along the last axis, canonical values
[..., ceil(Q/2)] (two e2m1 codes a byte, the even element in the low nibble) and e8m0 scales
[..., ceil(Q/32)]. With layout="blackwell_value" a weight stored [..., N, K] goes straight to
the blackwell_value values [..., N, rup(K/2, 128)] and the blackwell_scale scales
[M, rup(ceil(K/32), 8) * rup(N, 128)] (M: the number of [N, K] matrices), the bytes of
quantize, then the blackwell_value swizzle (packing -2) and the blackwell_scale swizzle of the
matmul's logical [..., K, N].

numpy arrays (and CPU torch tensors) travel inline and the daemon's CPU engine quantizes
them; a CUDA tensor is read in place through CUDA IPC and the outputs are written in place
on its GPU, with no device memory of the daemon's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import _torch
from ._errors import WprepError
from ._spec import LayoutIdentity
from .v1 import wprep_pb2 as pb

Shape = Tuple[int, ...]

_GROUP = 32
_LAYOUTS = {None: pb.QUANTIZE_LAYOUT_CANONICAL, "blackwell_value": pb.QUANTIZE_LAYOUT_BLACKWELL,
            "blackwell_shuffled_value": pb.QUANTIZE_LAYOUT_BLACKWELL_SHUFFLED,
            "hopper_value": pb.QUANTIZE_LAYOUT_HOPPER, "trtllm_w13": pb.QUANTIZE_LAYOUT_TRTLLM_W13,
            "trtllm_w2": pb.QUANTIZE_LAYOUT_TRTLLM_W2}
_TRTLLM = ("trtllm_w13", "trtllm_w2")
_ROUNDINGS = {"up": pb.SCALE_ROUNDING_UP, "down": pb.SCALE_ROUNDING_DOWN}


@dataclass
class QuantizedMXFP4:
    """What quantize_mxfp4 returns; unpacks as (values, scales).

    values / scales: uint8 numpy arrays (numpy input), uint8 CPU tensors (CPU tensor input),
    or the CUDA tensors written in place (CUDA input: out=, or tensors allocated on the input's
    GPU). bias: the prepared bias (float32) of a trtllm layout given bias=, else None.
    value_identity / scale_identity: what produced each, e.g. the conversion
    "bfloat16 -> quantize_mxfp4(scale_rounding=up) -> canonical(packing_axis=-1)". engine: "cpu"
    or "cuda:GPU-...". kernel_seconds: the engine's time.
    """

    values: Any
    scales: Any
    value_identity: LayoutIdentity
    scale_identity: LayoutIdentity
    engine: str
    kernel_seconds: float
    bias: Any = None

    def __iter__(self) -> Iterator[Any]:
        yield self.values
        yield self.scales


def _bad(msg: str) -> WprepError:
    return WprepError(grpc.StatusCode.INVALID_ARGUMENT, f"quantize_mxfp4: {msg}")


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _prod(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _trtllm_shapes(shape: Shape, layout: str, align: int) -> Tuple[Shape, Shape, Shape]:
    if len(shape) != 3:
        raise _bad(f"layout={layout!r} takes expert weights [E, R, K] (rank 3); x is {list(shape)}")
    e, r, k = shape
    if k % _GROUP:
        raise _bad(f"layout={layout!r} needs K (the last dim) a multiple of 32; x is {list(shape)}")
    if layout == "trtllm_w13" and r % 2:
        raise _bad(f"layout='trtllm_w13' needs an even R (the gated w1/w3 rows, 2*I); x is {list(shape)}")
    if not isinstance(align, int) or align <= 0 or align % 128:
        raise _bad(f"align must be a positive multiple of 128; got {align!r}")
    rows = 2 * _round_up(r // 2, align) if layout == "trtllm_w13" else _round_up(r, align)
    kp = _round_up(k, align)
    return (e, rows, kp // 2), (e, rows, kp // _GROUP), (e, rows)


def output_shapes(shape: Sequence[int], layout: Optional[str], num_warps: int = 8,
                  align_k: int = 2, align: int = 256, block_k: int = 128, block_n: int = 256) -> Tuple[Shape, Shape]:
    """The (values, scales) shapes of the outputs' memory, row-major; one-byte elements.

    The same arithmetic as the daemon's planner, so that a CUDA caller's outputs can be
    allocated (and out= checked) before the call. For layout="hopper_value" the daemon reports
    each output as the transpose of this shape (upstream's view, stride 1 on dim -2). Raises
    WprepError(INVALID_ARGUMENT) for a shape the layout cannot take.
    """
    shape = tuple(int(d) for d in shape)
    if not shape:
        raise _bad("x has rank 0; groups run along the last axis, so it needs rank >= 1")
    q = shape[-1]
    if layout is None:
        return (*shape[:-1], (q + 1) // 2), (*shape[:-1], (q + _GROUP - 1) // _GROUP)
    if layout in _TRTLLM:
        return _trtllm_shapes(shape, layout, align)[:2]
    if len(shape) < 2:
        raise _bad(f"layout={layout!r} takes a weight stored [..., N, K] (rank >= 2); x is {list(shape)}")
    if q % 2:
        raise _bad(f"layout={layout!r} needs an even K (the last dim); x is {list(shape)}")
    n = shape[-2]
    if layout == "hopper_value":
        # hopper_value(mx_axis=-2): Q is [N, K/2] padded to [rup(N, 256), rup(K/2, 64)], stored
        # as [R/4, 4C]; hopper_scale(mx_axis=-2): S is [N, ceil(K/32)] padded to
        # [rup(N, 32 * num_warps), rup(ceil(K/32), align_k)], stored as [R/32, 32C].
        r, c = _round_up(n, 256), _round_up(q // 2, 64)
        rs, cs = _round_up(n, 32 * num_warps), _round_up((q + _GROUP - 1) // _GROUP, align_k)
        return (*shape[:-2], r // 4, 4 * c), (*shape[:-2], rs // 32, 32 * cs)
    mats = _prod(shape[:-2]) if n else 0
    per_matrix = _round_up((q + _GROUP - 1) // _GROUP, 8) * _round_up(n, 128)
    scales = (mats, per_matrix if mats else 0)
    if layout == "blackwell_shuffled_value":
        # [M, ntk, ntn, tile_n, tile_k]: tiles of block_n rows x block_k/2 bytes, K/2 padded to
        # a multiple of lcm(128, tile_k), N to a multiple of tile_n.
        tile_k = block_k // 2
        kpad = _round_up(q // 2, 128 // math.gcd(128, tile_k) * tile_k)
        return (_prod(shape[:-2]), kpad // tile_k, -(-n // block_n), block_n, tile_k), scales
    return (*shape[:-1], _round_up(q // 2, 128)), scales


def _check_args(layout: Optional[str], scale_rounding: str, completion: str, hopper: Sequence[int]) -> None:
    if completion in ("stream", "async"):
        # The daemon answers a quantize batch once its work is done and refuses fences
        # (UNIMPLEMENTED); say so before anything is exported or sent.
        raise WprepError(grpc.StatusCode.UNIMPLEMENTED,
                         f"quantize_mxfp4: completion={completion!r}: the daemon serves quantize batches with "
                         f"completion='host' only (fences are not served for quantize items)")
    if completion != "host":
        raise _bad(f"completion must be 'host'; got {completion!r}")
    if layout not in _LAYOUTS:
        raise _bad(f"layout must be None (canonical), 'blackwell_value', 'blackwell_shuffled_value', 'hopper_value', "
                   f"'trtllm_w13' or 'trtllm_w2'; got {layout!r}")
    mma_version, num_warps, align_k = hopper[:3]
    block_k, block_n = hopper[5:7]
    if layout != "blackwell_shuffled_value" and (block_k, block_n) != (128, 256):
        raise _bad("block_k and block_n are parameters of layout='blackwell_shuffled_value'")
    if not isinstance(block_k, int) or block_k < 2 or block_k > 4096 or block_k % 2:
        raise _bad(f"block_k must be an even number in [2, 4096]; got {block_k!r}")
    if not isinstance(block_n, int) or block_n < 1 or block_n > 4096:
        raise _bad(f"block_n must be in [1, 4096]; got {block_n!r}")
    if layout not in _TRTLLM and (hopper[3] != 256 or hopper[4] is not None):
        raise _bad("align and bias are parameters of layout='trtllm_w13' and 'trtllm_w2'")
    if layout != "hopper_value" and (mma_version, num_warps, align_k) != (3, 8, 2):
        raise _bad("mma_version, num_warps and align_k are parameters of layout='hopper_value'")
    if mma_version not in (2, 3):
        raise _bad(f"mma_version must be 2 or 3; got {mma_version!r}")
    for name, v, lo, hi in (("num_warps", num_warps, 1, 32), ("align_k", align_k, 2, 64)):
        if not isinstance(v, int) or v < lo or v > hi or v & (v - 1):
            raise _bad(f"{name} must be a power of two in [{lo}, {hi}]; got {v!r}")
    if scale_rounding not in _ROUNDINGS:
        raise _bad(f"scale_rounding must be 'up' or 'down'; got {scale_rounding!r}")


# -- host arrays: inline ------------------------------------------------------------------------


def _numpy_source(a: np.ndarray) -> Tuple[int, bytes]:
    """The dtype enum and little-endian row-major bytes of a host array."""
    dt = a.dtype
    if dt.name == "bfloat16":  # ml_dtypes.bfloat16: its bits, without importing ml_dtypes
        a, dt = np.ascontiguousarray(a).view(np.uint16), np.dtype(np.uint16)
    if dt.kind == "f" and dt.itemsize == 4:
        code = pb.QUANTIZE_DTYPE_FLOAT32
    elif dt.kind == "f" and dt.itemsize == 2:
        code = pb.QUANTIZE_DTYPE_FLOAT16
    elif dt.kind == "u" and dt.itemsize == 2:
        code = pb.QUANTIZE_DTYPE_BFLOAT16  # bfloat16 bit patterns
    else:
        raise _bad(f"x has numpy dtype {dt}; it takes float32, float16 or bfloat16 (ml_dtypes.bfloat16, or its "
                   f"bits as uint16)")
    return code, np.ascontiguousarray(a, dtype=dt.newbyteorder("<")).tobytes()


def _host_array(x: Any) -> Tuple[np.ndarray, bool]:
    """x as a numpy array, and whether it was a (CPU) torch tensor."""
    if _torch.is_tensor(x):
        import torch

        t = x.detach().contiguous()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits
            return t.view(torch.int16).numpy().view(np.uint16), True
        return t.numpy(), True
    if isinstance(x, np.ndarray):
        return x, False
    raise _bad(f"x must be a numpy array or a torch tensor; got {type(x).__name__}")


def _check_host_out(out: Any, shapes: Sequence[Shape], torch_in: bool) -> None:
    """out= of a host call: C-contiguous arrays (tensors) of exactly the outputs' bytes (the
    third, a trtllm bias, of float32)."""
    names = ("values", "scales", "bias")[:len(shapes)]
    if len(out) != len(shapes):
        raise _bad(f"out must be ({', '.join(names)}); got {len(out)} items")
    for j, (name, dst, shape) in enumerate(zip(names, out, shapes)):
        need = _prod(shape) * (4 if j == 2 else 1)
        if torch_in and _torch.is_tensor(dst) and not dst.is_cuda:
            ok, n = dst.is_contiguous(), dst.numel() * dst.element_size()
        elif not torch_in and isinstance(dst, np.ndarray):
            ok, n = dst.flags.c_contiguous and dst.flags.writeable, dst.nbytes
        else:
            what = "a CPU torch tensor" if torch_in else "a numpy array"
            raise _bad(f"out {name}: for x of this kind it must be {what}; got {type(dst).__name__}")
        if not ok or n != need:
            raise _bad(f"out {name}: needs a contiguous, writable buffer of {need} bytes ({list(shape)} "
                       f"{'float32' if j == 2 else 'uint8'}); got {n} bytes")


def _write(dst: Any, data: bytes) -> None:
    if _torch.is_tensor(dst):
        import torch

        if data:
            dst.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return
    dst.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)


def _host_outputs(item: "pb.BatchItemResult", shapes: Sequence[Shape], out: Any, torch_in: bool) -> List[Any]:
    results = []
    for j, t in enumerate(item.outputs):
        if out is not None:
            _write(out[j], t.inline_bytes)
            results.append(out[j])
            continue
        a = np.frombuffer(t.inline_bytes, dtype="<f4" if j == 2 else np.uint8).reshape(shapes[j]).copy()
        if torch_in:
            import torch

            a = torch.from_numpy(a)
        results.append(a)
    return results


# -- CUDA tensors: in place ----------------------------------------------------------------------


def _cuda_dtype(t: Any) -> int:
    import torch

    codes = {torch.bfloat16: pb.QUANTIZE_DTYPE_BFLOAT16, torch.float16: pb.QUANTIZE_DTYPE_FLOAT16,
             torch.float32: pb.QUANTIZE_DTYPE_FLOAT32}
    if t.dtype not in codes:
        raise _bad(f"x has dtype {t.dtype}; it takes torch.bfloat16, torch.float16 or torch.float32")
    return codes[t.dtype]


def _check_bias(x: Any, bias: Any, cuda: bool) -> None:
    if cuda != _torch.is_cuda_tensor(bias):
        raise _bad("bias must be of x's kind: a CUDA tensor on x's GPU for a CUDA x, else a host array or tensor")
    if cuda and bias.device != x.device:
        raise _bad(f"bias is on {bias.device}, x on {x.device}; they must share a GPU")
    if tuple(bias.shape) != tuple(x.shape[:2]):
        raise _bad(f"bias must have shape [E, R] = {list(x.shape[:2])}; got {list(bias.shape)}")


def _cuda_outputs(x: Any, shapes: Sequence[Shape], out: Any, float32_last: bool = False) -> List[Any]:
    """out= checked (dense, on x's GPU, exactly the outputs' elements: one-byte, and a float32
    bias last with `float32_last`), or new tensors."""
    import torch

    kinds = [torch.uint8] * len(shapes)
    if float32_last:
        kinds[-1] = torch.float32
    if out is None:
        return [torch.empty(s, dtype=k, device=x.device) for s, k in zip(shapes, kinds)]
    names = ("values", "scales", "bias")[:len(shapes)]
    if len(out) != len(shapes):
        raise _bad(f"out must be ({', '.join(names)}); got {len(out)} items")
    for name, dst, shape, kind in zip(names, out, shapes, kinds):
        if not _torch.is_cuda_tensor(dst):
            raise _bad(f"out {name}: for a CUDA x it must be a CUDA tensor on {x.device}; got {type(dst).__name__}")
        if dst.device != x.device:
            raise _bad(f"out {name} is on {dst.device}, x on {x.device}; they must share a GPU")
        size, what = (4, "four-byte tensor (float32)") if kind == torch.float32 else (1, "one-byte tensor (uint8)")
        if dst.element_size() != size or not dst.is_contiguous() or dst.numel() != _prod(shape):
            raise _bad(f"out {name}: needs a contiguous {what} of {_prod(shape)} elements "
                       f"({list(shape)}); got {dst.dtype} {list(dst.shape)}")
    return list(out)


def _byte_view(t: Any) -> Any:
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


def _fill_cuda(item: "pb.QuantizeItem", x: Any, outs: Sequence[Any], registry: _torch.Registry) -> None:
    """The source and both destinations as CUDA IPC buffers of x's GPU."""
    _torch.source_view(_byte_view(x), registry).fill(item.source.ipc)
    for dst, t in zip((item.values, item.scales), outs):
        _torch.destination_view(_byte_view(t), registry).fill(dst.ipc)


# -- the call --------------------------------------------------------------------------------------


def _transposed(shape: Shape) -> Shape:
    return (*shape[:-2], shape[-1], shape[-2])


def _check_answer(item: "pb.BatchItemResult", shapes: Sequence[Shape]) -> None:
    """`shapes`: as the daemon reports them."""
    got = [(t.name, tuple(t.shape)) for t in item.outputs]
    if got != list(zip(("values", "scales", "bias"), shapes)):
        raise RuntimeError(f"the daemon answered outputs {got}, not values {list(shapes[0])} and scales "
                           f"{list(shapes[1])}: is it a different version?")


def quantize_mxfp4(x: Any, *, layout: Optional[str] = None, scale_rounding: str = "up",
                   mma_version: int = 3, num_warps: int = 8, align_k: int = 2, align: int = 256,
                   bias: Any = None, block_k: int = 128, block_n: int = 256,
                   out: Optional[Sequence[Any]] = None, client: Any = None, timeout: Optional[float] = None,
                   stream: Any = None, completion: str = "host") -> QuantizedMXFP4:
    """Quantizes `x` [..., Q] to MXFP4 (docs/LAYOUTS.md, "Quantization to MXFP4") in one round trip.

    x: a numpy array of float32, float16 or bfloat16 (ml_dtypes.bfloat16, or its bit patterns
    as uint16), sent inline and quantized by the daemon's CPU engine; a CPU torch tensor of
    torch.float32, float16 or bfloat16, the same way; or a contiguous CUDA tensor of those
    dtypes, read in place through CUDA IPC and quantized on its GPU.

    layout: None for canonical values [..., ceil(Q/2)] and scales [..., ceil(Q/32)];
    "blackwell_value" for a weight stored [..., N, K] (even K): blackwell_value values
    [..., N, rup(K/2, 128)] and blackwell_scale scales [M, rup(ceil(K/32), 8) * rup(N, 128)]
    (M matrices), fused in one pass; "blackwell_shuffled_value" the same with
    blackwell_shuffled_value(block_k, block_n) values [M, ntk, ntn, block_n, block_k/2] (tiles
    of block_n rows x block_k/2 bytes; defaults 128 and 256) and the same blackwell_scale
    scales; "hopper_value" for a weight stored [..., N, K] (even K):
    hopper_value(mx_axis=-2, mma_version) values of the matmul's logical [..., K, N] and
    hopper_scale(mx_axis=-2, num_warps, align_k) scales of its [..., ceil(K/32), N], fused in
    one pass, returned as upstream's layouts report them: the transposed views
    [..., 4*rup(K/2, 64), rup(N, 256)/4] and [..., 32*rup(ceil(K/32), align_k),
    rup(N, 32*num_warps)/32] (stride 1 on dim -2) of row-major memory; out= takes that memory
    (output_shapes). scale_rounding: "up" (default) or "down". mma_version (2 or 3), num_warps
    and align_k: hopper_value's and hopper_scale's parameters (defaults 3, 8, 2).

    layout "trtllm_w13" / "trtllm_w2": expert weights [E, R, K] (K a multiple of 32; w13's R
    even, the gated w1/w3 rows) straight to the bytes of FlashInfer's trtllm-gen MXFP4
    prepare_w13 / prepare_w2 (docs/TRTLLM_GEN.md) with `align` (a multiple of 128, default
    256): values [E, rows, rup(K, align)/2], scales [E, rows, rup(K, align)/32]. bias: the
    experts' bias [E, R] (float32 or bfloat16, of x's kind: host or CUDA on x's GPU), prepared
    into [E, rows] float32 as the result's .bias; out= then takes (values, scales, bias).

    out: (values, scales) to write in place, of exactly the outputs' bytes: C-contiguous numpy
    arrays (or CPU tensors) for host x, contiguous one-byte CUDA tensors on x's GPU for a CUDA
    x; their addresses are kept. Without out=: new uint8 numpy arrays (CPU tensors), or new
    uint8 CUDA tensors on x's GPU.

    client: default wprep.default_client(). timeout: seconds (default: the client's).
    stream / completion: for a CUDA x the client synchronizes `stream` (default: the current
    stream of x's GPU) before sending, and the outputs are written when the call returns
    (completion="host"). The daemon answers quantize batches once their work is done and
    serves no fences for them, so "host" is the only completion taken: "stream" and "async"
    raise WprepError(UNIMPLEMENTED) before anything is sent.

    Raises WprepError(INVALID_ARGUMENT) for a bad dtype, shape, layout, rounding or out=
    (before anything is sent) and with the daemon's message for what the daemon refuses
    ("items[0].quantize..."), ExpandableSegmentsError for CUDA memory that cannot be shared.
    """
    _check_args(layout, scale_rounding, completion, (mma_version, num_warps, align_k, align, bias, block_k, block_n))
    if client is None:
        from ._mxfp4 import default_client

        client = default_client()
    req = pb.ConvertBatchRequest()
    item = req.items.add().quantize
    item.layout = _LAYOUTS[layout]
    item.scale_rounding = _ROUNDINGS[scale_rounding]
    hopper = layout == "hopper_value"
    if hopper:
        item.hopper.mma_version = mma_version
        item.hopper_scale.num_warps = num_warps
        item.hopper_scale.align_k = align_k
    if layout == "blackwell_shuffled_value":
        item.blackwell.block_k = block_k
        item.blackwell.block_n = block_n
    trtllm = layout in _TRTLLM
    if trtllm:
        item.align = align
    cuda = _torch.is_cuda_tensor(x)
    bias_shape = _trtllm_shapes(tuple(int(d) for d in x.shape), layout, align)[2] if trtllm else None
    if bias is not None:
        _check_bias(x, bias, cuda)
    torch_in = False
    if cuda:
        item.dtype = _cuda_dtype(x)
        shapes = output_shapes(x.shape, layout, num_warps, align_k, align, block_k, block_n)
        if bias is not None:
            shapes = (*shapes, bias_shape)
        if not x.is_contiguous():
            raise _bad(f"a CUDA x is read in place and must be contiguous (row-major); got strides {list(x.stride())}"
                       "; pass x.contiguous()")
        outs = _cuda_outputs(x, shapes, out, float32_last=bias is not None)
        item.shape.extend(x.shape)
        if x.numel() == 0:  # no memory to share: nothing to read or write, checked by the daemon
            item.source.inline_bytes = b""
        else:
            _fill_cuda(item, x, outs, client._registry)
            if bias is not None:
                bias = bias.contiguous()  # kept alive (by this name) until the daemon has answered
                item.bias_dtype = _cuda_dtype(bias)
                _torch.source_view(_byte_view(bias), client._registry).fill(item.bias.ipc)
                _torch.destination_view(_byte_view(outs[2]), client._registry).fill(item.bias_out.ipc)
            _torch.synchronize([x.device.index], stream)  # the producer's writes land before the daemon reads
    else:
        a, torch_in = _host_array(x)
        item.dtype, item.source.inline_bytes = _numpy_source(a)
        shapes = output_shapes(a.shape, layout, num_warps, align_k, align, block_k, block_n)
        if bias is not None:
            b, _ = _host_array(bias)
            item.bias_dtype, item.bias.inline_bytes = _numpy_source(b)
            shapes = (*shapes, bias_shape)
        item.shape.extend(a.shape)
        if out is not None:
            _check_host_out(out, shapes, torch_in)
    resp = client._unary("ConvertBatch", req, timeout)
    r = resp.items[0]
    _check_answer(r, tuple(_transposed(s) for s in shapes) if hopper else shapes)
    results = outs if cuda else _host_outputs(r, shapes, out, torch_in)
    prepared_bias = results[2] if bias is not None else None
    if hopper:  # upstream's views of the row-major memory
        results = [t.transpose(-1, -2) if _torch.is_tensor(t) else t.swapaxes(-1, -2) for t in results]
    return QuantizedMXFP4(results[0], results[1], LayoutIdentity.from_proto(r.outputs[0].identity),
                          LayoutIdentity.from_proto(r.outputs[1].identity), r.engine, r.kernel_seconds, prepared_bias)
