"""triton_kernels Tensor objects around storage wprep already swizzled, without convert_layout.

What convert_layout(wrap_torch_tensor(x), layout, ...) returns is
    Tensor(Storage(new_data, layout_object), **attrs)
where attrs are the non-storage fields of the wrapped input (dtype, shape, shape_max, ...) and
new_data is the layout's swizzled storage, which wprep computes instead. So the objects are
built the same way: wrap the loader's input view (no copy), take its attrs, and put wprep's
output in a Storage with the layout object that the loaders' default-layout helpers
(make_default_matmul_mxfp4_w_layout / _w_scale_layout) return for this GPU. Two shapes of that
API exist upstream, and both are handled:
- newer: the helpers return a layout instance (a frozen dataclass whose repr is
  "HopperMXValueLayout(mx_axis=-2, mma_version=3)", exactly wprep's LayoutIdentity.layout);
- older: they return (LayoutClass, kwargs), and convert_layout instantiates
  LayoutClass(storage_shape, **kwargs) with the input's storage shape and a non-negative
  mx_axis.
The layout object must be the one wprep's bytes equal; when the helpers pick another one for
this GPU (an older triton_kernels choosing StridedLayout, say), no objects are built and the
reason says so.

Scales whose groups the loader zero-pads before convert_layout (vLLM on sm_90: to a multiple
of 4) make a Tensor whose shape has the padded group count; build() takes it as
scale_groups. layout_align_k() measures what this triton_kernels' own HopperMXScaleLayout
pads the groups to, so the drop-in never gives less than convert_layout would.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Optional, Tuple


class TritonUnavailable(Exception):
    """triton_kernels Tensor objects cannot be built here; the message says why."""


def _layout_fields(identity: str) -> Tuple[str, dict]:
    m = re.fullmatch(r"(\w+)\((.*)\)", identity)
    if not m:
        raise TritonUnavailable(f"cannot read the layout identity {identity!r}")
    fields = {}
    for part in filter(None, (p.strip() for p in m.group(2).split(","))):
        k, _, v = part.partition("=")
        fields[k.strip()] = int(v)
    return m.group(1), fields


def _matches(layout: Any, identity: str, rank: int) -> bool:
    if repr(layout) == identity:
        return True
    name, fields = _layout_fields(identity)
    if type(layout).__name__ != name:
        return False
    for k, v in fields.items():
        have = getattr(layout, k, None)
        if k == "mx_axis" and isinstance(have, int) and have >= 0:
            have -= rank
        if have != v:
            return False
    return True


def _default_layout(make: Any, rank: int, storage_shape: Any, **kwargs: Any) -> Any:
    chosen = make(mx_axis=-2, **kwargs)
    if isinstance(chosen, tuple):  # older API: (LayoutClass, kwargs); mx_axis non-negative
        cls, opts = make(mx_axis=rank - 2, **kwargs)
        return cls(storage_shape, **opts)
    return chosen


@functools.lru_cache(maxsize=None)
def _import() -> Any:
    """triton_kernels' pieces, or why they cannot be had (asked once: a failed import is slow)."""
    try:
        from triton_kernels.tensor import FP4, Storage, Tensor, wrap_torch_tensor
        from triton_kernels.tensor_details import layout as tk_layout
    except Exception as e:  # ImportError, or a triton that fails to initialize
        return f"triton_kernels is not importable: {type(e).__name__}: {e}"
    return FP4, Storage, Tensor, wrap_torch_tensor, tk_layout


def unavailable() -> Optional[str]:
    """Why triton_kernels objects cannot be built here (None: they can be tried)."""
    tk = _import()
    return tk if isinstance(tk, str) else None


@functools.lru_cache(maxsize=None)
def layout_align_k() -> Optional[int]:
    """The multiple this triton_kernels' HopperMXScaleLayout pads the scale groups to by itself
    (2 upstream so far), or None when it cannot be told (no triton_kernels, an unknown API).

    Measured, not looked up by version: the layout swizzles a zero [1, 32, 2] scale tensor on
    the CPU (two groups along the mx axis, one warp), and its storage is 32 bytes a group.
    Both API shapes are tried: a layout instance with make_transformation(shape), and the
    older LayoutClass(shape, mx_axis, num_warps) with swizzle_data on the instance.
    """
    tk = _import()
    if isinstance(tk, str):
        return None
    try:
        import torch

        cls = getattr(tk[4], "HopperMXScaleLayout")
        shape = [1, 32, 2]
        try:
            layout = cls(mx_axis=2, num_warps=1)
            make = layout.make_transformation
            try:
                transform = make(shape)
            except TypeError:  # versions that also take is_fp4
                transform = make(shape, False)
        except TypeError:
            transform = cls(shape, mx_axis=2, num_warps=1)
        out = transform.swizzle_data(torch.zeros(shape, dtype=torch.uint8))
        groups = int(out.shape[-1]) // 32
    except Exception:  # noqa: BLE001  (any other API: cannot be told)
        return None
    return groups if groups >= 2 and groups & (groups - 1) == 0 else None


def build(
    values_in: Any,
    scales_in: Any,
    values_out: Any,
    scales_out: Any,
    value_identity: str,
    scale_identity: str,
    num_warps: int,
    scale_groups: Optional[int] = None,
) -> Tuple[Any, Any]:
    """(values Tensor, scales Tensor) as convert_layout would return them for the loaders' call.

    values_in / scales_in: the checkpoint tensors [..., N, K/2] and [..., N, K/32] (as the
    loader passes them to _swizzle_mxfp4); *_out: wprep's outputs. scale_groups: the group
    count of the scale tensor the loader padded before convert_layout (None: not padded).
    Raises TritonUnavailable.
    """
    tk = _import()
    if isinstance(tk, str):
        raise TritonUnavailable(tk)
    FP4, Storage, Tensor, wrap_torch_tensor, tk_layout = tk
    make_values = getattr(tk_layout, "make_default_matmul_mxfp4_w_layout", None)
    make_scales = getattr(tk_layout, "make_default_matmul_mxfp4_w_scale_layout", None)
    if make_values is None or make_scales is None:
        raise TritonUnavailable("this triton_kernels has no make_default_matmul_mxfp4_w_layout")

    # The loaders' inputs to convert_layout: transposed views with the reduction axis on -2.
    v_src = wrap_torch_tensor(values_in.transpose(-2, -1), dtype=FP4)
    s_src = wrap_torch_tensor(scales_in.transpose(-2, -1))
    rank = values_in.ndim
    # (the older API's layouts keep the storage shape: the torch.Size convert_layout passes)
    v_layout = _default_layout(make_values, rank, v_src.storage.data.shape)
    s_layout = _default_layout(make_scales, rank, s_src.storage.data.shape, num_warps=num_warps)
    for have, want in ((v_layout, value_identity), (s_layout, scale_identity)):
        if not _matches(have, want, rank):
            raise TritonUnavailable(
                f"triton_kernels' default layout for this GPU is {have!r}, wprep's bytes are {want}"
            )

    def wrap(src: Any, data: Any, layout: Any, groups: Optional[int] = None) -> Any:
        attrs = {f.name: getattr(src, f.name) for f in dataclasses.fields(src) if f.name != "storage"}
        if groups is not None:  # the loader's padded [..., groups, N], dim -2 the mx axis
            for name in ("shape", "shape_max"):
                if isinstance(attrs.get(name), list) and len(attrs[name]) == rank:
                    attrs[name] = [*attrs[name][:-2], groups, attrs[name][-1]]
        return Tensor(Storage(data, layout), **attrs)

    return wrap(v_src, values_out, v_layout), wrap(s_src, scales_out, s_layout, scale_groups)


def in_flex_data() -> Optional[Any]:
    """triton_kernels.numerics.InFlexData(), the second item of the loaders' _swizzle_mxfp4 result."""
    try:
        from triton_kernels.numerics import InFlexData
    except Exception:  # noqa: BLE001
        return None
    return InFlexData()
