"""swizzle_mxfp4: the loaders' _swizzle_mxfp4 (vLLM, SGLang) served by wprepd, one round trip.

The loaders' call, for an MoE projection whose weight is the logical FP4 tensor [E, K, N]
(K the reduction axis):
    values [E, N, K/2] uint8, checkpoint order (gpt-oss's *_blocks): the packing -2 storage
        of [E, K, N]; the loaders pass values.transpose(-2, -1), a [E, K/2, N] view, to
        convert_layout(wrap_torch_tensor(..., dtype=FP4), value_layout) with mx_axis -2;
    scales [E, N, K/32] uint8 (e8m0), passed as scales.transpose(-2, -1), [E, K/32, N], to
        convert_layout(wrap_torch_tensor(...), scale_layout) with mx_axis -2.
Here both go to wprepd as one ConvertBatch, read in place through CUDA IPC:
    sm_90:   HopperMXValueLayout(mx_axis=-2, mma_version=3) from packing -2, and
             HopperMXScaleLayout(mx_axis=-2, num_warps) of the [E, K/32, N] view, its K/32
             groups zero-padded to a multiple of 4 first (see pad_scales);
    sm_100+: BlackwellMXValueLayout() from packing -2, and BlackwellMXScaleLayout().
The outputs are torch tensors with the storage shape and strides convert_layout gives.

pad_scales: vLLM's _swizzle_mxfp4 on sm_90 zero-pads the scale groups to a multiple of 4
before convert_layout (vllm#47910, mirroring triton#10800): its matmul reads 4 groups per
128-wide K tile, and the layout's own padding (to 2) leaves the last tile of a K with 90
groups (gpt-oss) reading past the storage. So gpt-oss's w13 scales are [E, 2944, 184], not
[E, 2880, 184]. The drop-in gives that padded form by default (pad_scales=None or True)
and the older unpadded one with pad_scales=False; either way the daemon writes the zero
groups in the same pass (the hopper_scale conversion's align_k), with no copy of the scales
on the client. The scale identity's conversion says which: "scales(align_k=4) -> ...".
When triton_kernels is importable, the alignment its own HopperMXScaleLayout pads to is
measured once on a tiny CPU tensor (_triton.layout_align_k) and never undercut: a version
that pads the groups itself gets that storage in both forms. Blackwell's scale layout pads
K to 8 groups already; pad_scales changes nothing there.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._client import Client
from ._spec import LayoutIdentity, Spec
from ._types import BatchResult, Item

_default: Optional[Client] = None
_default_mu = threading.Lock()


def default_client() -> Client:
    """The process's shared Client of $WPREP_TARGET (else unix:///tmp/wprepd.sock), made on first use."""
    global _default
    with _default_mu:
        if _default is None:
            _default = Client()
        return _default


def set_default_client(client: Optional[Client]) -> None:
    """Makes `client` the one swizzle_mxfp4 uses when given none (None: back to the default)."""
    global _default
    with _default_mu:
        _default = client


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"wprep.swizzle_mxfp4 works on CUDA torch tensors, and torch is not importable: {e}") from e
    return torch


@functools.lru_cache(maxsize=64)
def mxfp4_specs(capability: Tuple[int, int], num_warps: int = 8, align_k: int = 2) -> Tuple[Spec, Spec]:
    """The (values, scales) conversions the loaders' default layouts mean on this compute capability.

    align_k: Hopper only, the multiple the scale groups are zero-padded to (2: the layout's
    own; 4: vLLM's sm_90 call since #47910).
    """
    major, minor = capability
    if major == 9:
        return (
            Spec("hopper_value", mx_axis=-2, mma_version=3, packing_axis=-2),
            Spec("hopper_scale", mx_axis=-2, num_warps=num_warps, align_k=None if align_k == 2 else align_k),
        )
    if major >= 10:
        return Spec("blackwell_value", packing_axis=-2), Spec("blackwell_scale")
    raise ValueError(
        f"swizzle_mxfp4 serves sm_90 (Hopper layouts) and sm_100 or newer (Blackwell layouts); "
        f"this GPU is sm_{major}{minor}"
    )


# The scale groups vLLM's sm_90 call pads to (vllm#47910): what its matmul's 128-wide K tile reads.
LOADER_ALIGN_K = 4


def scale_align_k(pad_scales: Optional[bool]) -> int:
    """The hopper_scale align_k of the drop-in's call: the padded form (the default, None or
    True) or the unpadded one (False), never below what this triton_kernels' layout pads to."""
    from ._triton import layout_align_k

    own = layout_align_k() or 2
    if pad_scales is None or pad_scales:
        return max(LOADER_ALIGN_K, own)
    return own


@dataclass
class SwizzledMXFP4:
    """One projection's weights in the matmul's layouts.

    values / scales: the swizzled storage, shaped and strided as triton_kernels' convert_layout
    returns it (its Tensor.storage.data). value_identity / scale_identity: the upstream layout
    objects the bytes equal. kernel_seconds: the daemon's engine time for both.
    triton_values / triton_scales: triton_kernels.tensor.Tensor objects for matmul_ogs, when
    triton_kernels is importable and its default layouts for this GPU are these (else None,
    and triton_error says why).
    """

    values: Any
    scales: Any
    value_identity: LayoutIdentity
    scale_identity: LayoutIdentity
    kernel_seconds: float
    triton_values: Any = None
    triton_scales: Any = None
    triton_error: Optional[str] = None

    def as_triton(self) -> Tuple[Any, Any, Any]:
        """(values Tensor, InFlexData(), scales Tensor): what the loaders' _swizzle_mxfp4 returns."""
        if self.triton_values is None:
            raise RuntimeError(f"no triton_kernels Tensor objects: {self.triton_error}")
        from ._triton import in_flex_data

        return self.triton_values, in_flex_data(), self.triton_scales


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    """torch.cuda.get_device_capability(index), asked once per device."""
    return tuple(_import_torch().cuda.get_device_capability(index))


def _check_pair(i: int, values: Any, scales: Any) -> None:
    from . import _torch

    what = f"pair {i}" if i >= 0 else "swizzle_mxfp4"
    for name, t in (("values", values), ("scales", scales)):
        if not _torch.is_cuda_tensor(t):
            raise TypeError(f"{what}: {name} must be a CUDA torch tensor; got {type(t).__name__}")
        _torch.check_byte_tensor(t, f"{what}: {name}")
    if values.device != scales.device:
        raise ValueError(f"{what}: values on {values.device}, scales on {scales.device}")
    if values.ndim < 2 or scales.ndim != values.ndim:
        raise ValueError(f"{what}: values [..., N, K/2] and scales [..., N, K/32] of one rank; got "
                         f"{list(values.shape)} and {list(scales.shape)}")
    k = 2 * values.shape[-1]
    if tuple(scales.shape[:-1]) != tuple(values.shape[:-1]) or scales.shape[-1] != (k + 31) // 32:
        raise ValueError(
            f"{what}: values {list(values.shape)} are [..., N, K/2] with K={k}, so scales must be "
            f"{[*values.shape[:-1], (k + 31) // 32]}; got {list(scales.shape)}"
        )


# Each projection's values and scales go into one allocation of this alignment (bytes): the
# scales start on a boundary the daemon's wide stores keep.
_PAIR_ALIGN = 512


@dataclass(frozen=True)
class _PairTemplate:
    """What every projection of one shape needs, planned once: the two conversions' logical
    shapes and where their outputs lie in the projection's one allocation."""

    value_shape: Tuple[int, ...]
    scale_shape: Tuple[int, ...]
    value_out: Tuple[Tuple[int, ...], Tuple[int, ...]]  # storage shape, strides
    scale_out: Tuple[Tuple[int, ...], Tuple[int, ...]]
    scale_offset: int
    nbytes: int


_templates: "weakref.WeakKeyDictionary[Client, Dict[Any, _PairTemplate]]" = weakref.WeakKeyDictionary()
_templates_mu = threading.Lock()


def _pair_template(client: Client, specs: Tuple[Spec, Spec], values: Any, scales: Any) -> _PairTemplate:
    """The template of this projection shape for `client` (a layer's shapes recur in every layer)."""
    *lead, n, k_half = values.shape
    key = (specs, tuple(values.shape), tuple(scales.shape))
    with _templates_mu:
        hit = _templates.get(client, {}).get(key)
    if hit is not None:
        return hit
    value_shape = (*lead, 2 * k_half, n)
    scale_shape = (*lead, scales.shape[-1], n)
    plans = client._plans_for([(specs[0], value_shape), (specs[1], scale_shape)], None)
    pv, ps = plans[(specs[0], value_shape)], plans[(specs[1], scale_shape)]
    offset = -(-pv.output_bytes // _PAIR_ALIGN) * _PAIR_ALIGN
    t = _PairTemplate(value_shape, scale_shape, (pv.output_shape, pv.output_strides),
                      (ps.output_shape, ps.output_strides), offset, offset + ps.output_bytes)
    with _templates_mu:
        _templates.setdefault(client, {})[key] = t
    return t


def _pair_outputs(t: _PairTemplate, values: Any, scales: Any) -> Tuple[Any, Any]:
    """A projection's two outputs in one new allocation on its device (one CUDA IPC export for
    both): views as the layouts report them, of the inputs' dtypes."""
    import torch

    buf = torch.empty(t.nbytes, dtype=torch.uint8, device=values.device)
    outs = []
    for (shape, strides), offset, like in ((t.value_out, 0, values), (t.scale_out, t.scale_offset, scales)):
        o = buf.as_strided(shape, strides, offset)
        outs.append(o if like.dtype == torch.uint8 else o.view(like.dtype))
    return outs[0], outs[1]


def _items(values: Any, scales: Any, specs: Tuple[Spec, Spec], out: Optional[Sequence[Any]]) -> List[Item]:
    *lead, n, k_half = values.shape
    scales_view = scales.transpose(-2, -1)  # [..., K/32, N], stride 1 on dim -2 for a dense checkpoint
    vo, so = (None, None) if out is None else out
    return [
        Item(specs[0], [*lead, 2 * k_half, n], values, out=vo),
        Item(specs[1], list(scales_view.shape), scales_view, out=so),
    ]


def _padded_groups(scales: Any, specs: Tuple[Spec, Spec]) -> Optional[int]:
    """The K/32 groups of the scale tensor the loader hands convert_layout after padding it
    itself (the Tensor object's shape), or None when it pads nothing."""
    groups = scales.shape[-1]
    align = specs[1].align_k
    if align is None or specs[1].layout.value != "hopper_scale":  # type: ignore[union-attr]
        return None
    from ._triton import layout_align_k

    if (layout_align_k() or 2) >= align:
        return None  # the layout pads this far itself: the loader's tensor is unpadded
    return -(-groups // LOADER_ALIGN_K) * LOADER_ALIGN_K


def _result(values: Any, scales: Any, r: BatchResult, i: int, num_warps: int, triton: Optional[bool],
            scale_groups: Optional[int] = None) -> SwizzledMXFP4:
    v, s = r[2 * i], r[2 * i + 1]
    out = SwizzledMXFP4(v.tensor, s.tensor, v.identity, s.identity, v.kernel_seconds + s.kernel_seconds)
    if triton is False:
        out.triton_error = "not asked for (triton=False)"
        return out
    from ._triton import TritonUnavailable, build, unavailable

    reason = unavailable()
    if reason is not None and not triton:  # known already: no objects, no exception per call
        out.triton_error = reason
        return out
    try:
        out.triton_values, out.triton_scales = build(
            values, scales, v.tensor, s.tensor, v.identity.layout, s.identity.layout, num_warps,
            scale_groups=scale_groups,
        )
    except TritonUnavailable as e:
        if triton:
            raise RuntimeError(str(e)) from e
        out.triton_error = str(e)
    return out


def swizzle_mxfp4_batch(
    pairs: Sequence[Tuple[Any, Any]],
    num_warps: int = 8,
    *,
    client: Optional[Client] = None,
    out: Optional[Sequence[Tuple[Any, Any]]] = None,
    stream: Any = None,
    triton: Optional[bool] = None,
    completion: str = "auto",
    pad_scales: Optional[bool] = None,
) -> List[SwizzledMXFP4]:
    """swizzle_mxfp4 for several projections (a layer's w13 and w2, a whole model) in one ConvertBatch.

    pairs: (values, scales) per projection, all on one GPU. out: per pair, preallocated
    (values_out, scales_out) (see empty_swizzled_mxfp4, with the same pad_scales), or None to
    allocate: then each projection's values and scales are views of one new allocation (one
    CUDA IPC export for both), whose memory is freed once neither is referenced. triton: True to require triton_kernels Tensor objects, False to skip them, None
    (default) for "when available". completion, pad_scales: see swizzle_mxfp4. Raises
    WprepError with the daemon's status on a bad request.
    """
    _import_torch()  # without torch, its clear error first
    if not pairs:
        return []
    for i, (v, s) in enumerate(pairs):
        _check_pair(i if len(pairs) > 1 else -1, v, s)
    device = pairs[0][0].device
    if any(v.device != device for v, _ in pairs):
        raise ValueError("swizzle_mxfp4_batch: every pair must be on one GPU")
    if out is not None and len(out) != len(pairs):
        raise ValueError(f"out has {len(out)} entries for {len(pairs)} pairs")
    specs = mxfp4_specs(_capability(device.index), num_warps, scale_align_k(pad_scales))
    c = client or default_client()
    items: List[Item] = []
    for i, (v, s) in enumerate(pairs):
        if out is None and hasattr(c, "_plans_for"):  # planned once per shape; one allocation
            o: Optional[Sequence[Any]] = _pair_outputs(_pair_template(c, specs, v, s), v, s)
        else:
            o = out[i]
        items += _items(v, s, specs, o)
    r = c.convert_batch(items, stream=stream, completion=completion)
    return [_result(v, s, r, i, num_warps, triton, _padded_groups(s, specs)) for i, (v, s) in enumerate(pairs)]


def swizzle_mxfp4(
    values: Any,
    scales: Any,
    num_warps: int = 8,
    *,
    client: Optional[Client] = None,
    out: Optional[Tuple[Any, Any]] = None,
    stream: Any = None,
    triton: Optional[bool] = None,
    completion: str = "auto",
    pad_scales: Optional[bool] = None,
) -> SwizzledMXFP4:
    """The loaders' _swizzle_mxfp4(values, scales, num_warps), done by wprepd in one round trip.

    values: [..., N, K/2] uint8, checkpoint order; scales: [..., N, K/32] uint8 (e8m0); on one
    CUDA device. num_warps: the Hopper scale layout's (the matmul's warps). Returns the
    swizzled values and scales (torch tensors as convert_layout lays them out), their layout
    identities and, with triton_kernels, the Tensor objects matmul_ogs takes
    (SwizzledMXFP4.as_triton()). The inputs are read in place and left unchanged.

    completion: every mode is ordered like the torch operations convert_layout runs on
    `stream` (default: the current stream): the daemon reads the inputs after the work
    queued there before the call, and the outputs are ready for work queued there after it.
    "auto" (default) returns once the request is sent, before the daemon's answer ("async")
    wherever this process and the daemon can share host words, else once the daemon has
    queued the work ("stream"); the client's first auto call waits for its answer either
    way, and decides. With "async" a refused call raises on the client's next call or in
    wprep.wait_async() (call it once the loader is done; an error nothing raised is written
    to stderr at exit), and its outputs are undefined (Client.convert_batch says more).
    "stream" always waits for the daemon to queue the work and raises its errors itself.
    None of them makes the host wait for the GPU, and kernel_seconds is 0. "host"
    synchronizes `stream` before the call and returns once the work is done, with the
    engine's time in kernel_seconds.

    pad_scales: on sm_90, None (default) or True gives the scales as the newest vLLM's call
    does, their K/32 groups zero-padded to a multiple of 4 before the Hopper layout (gpt-oss's
    w13: [E, 2944, 184]); False gives the layout of the unpadded groups ([E, 2880, 184]), as
    older loaders have it. scale_identity.conversion names the form ("scales(align_k=4) ->
    ..."). No effect on Blackwell. The module docstring says more.
    """
    return swizzle_mxfp4_batch([(values, scales)], num_warps, client=client,
                               out=None if out is None else [out], stream=stream, triton=triton,
                               completion=completion, pad_scales=pad_scales)[0]


def wait_async(client: Optional[Client] = None, timeout: Optional[float] = None) -> None:
    """Waits for the answers of every completion="async" call of `client` (default: the default
    client) and raises the first error among them: call it once a loader's async calls are made."""
    (client or default_client()).wait_async(timeout)


def empty_swizzled_mxfp4(values: Any, scales: Any, num_warps: int = 8, *,
                         client: Optional[Client] = None, pad_scales: Optional[bool] = None) -> Tuple[Any, Any]:
    """Uninitialized (values_out, scales_out) for swizzle_mxfp4(..., out=...), sized by the daemon's Plan.

    For pools a loader allocates (and registers with Client.register) ahead of the calls;
    pad_scales as the calls will pass it.
    """
    from . import _torch

    _import_torch()  # without torch, its clear error first
    _check_pair(-1, values, scales)
    c = client or default_client()
    outs = []
    specs = mxfp4_specs(_capability(values.device.index), num_warps, scale_align_k(pad_scales))
    for it in _items(values, scales, specs, None):
        p = c.plan(it.spec, it.logical_shape)
        outs.append(_torch.empty_output(it.source, p.output_shape, p.output_strides, p.output_bytes))
    return outs[0], outs[1]
