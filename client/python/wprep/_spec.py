"""Conversions as Python values: the layout, the direction and the layout's parameters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any, Optional, Union, cast

from .v1 import wprep_pb2 as pb


class Layout(str, enum.Enum):
    """A layout family (docs/LAYOUTS.md); the value is its name in the CLI and the docs."""

    HOPPER_VALUE = "hopper_value"
    BLACKWELL_SHUFFLED_VALUE = "blackwell_shuffled_value"
    BLACKWELL_VALUE = "blackwell_value"
    HOPPER_SCALE = "hopper_scale"
    BLACKWELL_SCALE = "blackwell_scale"


class Direction(str, enum.Enum):
    """What a conversion does: canonical to layout, layout to canonical, or one tiling to another."""

    SWIZZLE = "swizzle"
    UNSWIZZLE = "unswizzle"
    RETILE = "retile"


_LAYOUT_TO_PROTO = {
    Layout.HOPPER_VALUE: pb.LAYOUT_HOPPER_VALUE,
    Layout.BLACKWELL_SHUFFLED_VALUE: pb.LAYOUT_BLACKWELL_SHUFFLED_VALUE,
    Layout.BLACKWELL_VALUE: pb.LAYOUT_BLACKWELL_VALUE,
    Layout.HOPPER_SCALE: pb.LAYOUT_HOPPER_SCALE,
    Layout.BLACKWELL_SCALE: pb.LAYOUT_BLACKWELL_SCALE,
}
_DIRECTION_TO_PROTO = {
    Direction.SWIZZLE: pb.DIRECTION_SWIZZLE,
    Direction.UNSWIZZLE: pb.DIRECTION_UNSWIZZLE,
    Direction.RETILE: pb.DIRECTION_RETILE,
}

# The layouts each parameter belongs to. The daemon validates the values; the client only
# refuses a parameter the layout would silently ignore.
_PARAM_LAYOUTS = {
    "mx_axis": (Layout.HOPPER_VALUE, Layout.HOPPER_SCALE),
    "mma_version": (Layout.HOPPER_VALUE,),
    "num_warps": (Layout.HOPPER_SCALE,),
    "align_k": (Layout.HOPPER_SCALE,),
    "block_k": (Layout.BLACKWELL_SHUFFLED_VALUE,),
    "block_n": (Layout.BLACKWELL_SHUFFLED_VALUE,),
    "to_block_k": (Layout.BLACKWELL_SHUFFLED_VALUE,),
    "to_block_n": (Layout.BLACKWELL_SHUFFLED_VALUE,),
}


def _enum(kind: Any, value: object, what: str) -> Any:
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        names = ", ".join(m.value for m in kind)  # type: ignore[attr-defined]
        raise ValueError(f"{what} must be one of {names}; got {value!r}") from None


@dataclass(frozen=True)
class Spec:
    """One conversion (wprep.v1.ConversionSpec). Unset parameters take the daemon's defaults.

    layout, direction: a Layout / Direction or its name ("hopper_value", "swizzle").
    mx_axis: hopper_value and hopper_scale, -1 or -2 (default -2).
    mma_version: hopper_value, 2 or 3 (default 3).
    num_warps: hopper_scale, a power of two (default 8).
    align_k: hopper_scale, a power of two in [2, 64] (default 2): the scale groups along the
      mx axis are zero-padded to a multiple of it before the layout (4: vLLM's sm_90 call).
    block_k, block_n: blackwell_shuffled_value tiling in FP4 values (defaults 128, 256); for
      a retile, the input's tiling.
    to_block_k, to_block_n: a retile's output tiling.
    packing_axis: value layouts, how the canonical side packs: -1 (default) or -2
      (checkpoint order, what gpt-oss's *_blocks hold).
    """

    layout: Union[Layout, str]
    direction: Union[Direction, str] = Direction.SWIZZLE
    mx_axis: Optional[int] = None
    mma_version: Optional[int] = None
    num_warps: Optional[int] = None
    block_k: Optional[int] = None
    block_n: Optional[int] = None
    to_block_k: Optional[int] = None
    to_block_n: Optional[int] = None
    packing_axis: Optional[int] = None
    align_k: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", _enum(Layout, self.layout, "layout"))
        object.__setattr__(self, "direction", _enum(Direction, self.direction, "direction"))
        layout = cast(Layout, self.layout)
        for name, layouts in _PARAM_LAYOUTS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int; got {value!r}")
            if layout not in layouts:
                allowed = ", ".join(x.value for x in layouts)
                raise ValueError(f"{name} applies to {allowed}, not to {layout.value}")
        if (self.to_block_k is not None or self.to_block_n is not None) and self.direction != Direction.RETILE:
            raise ValueError("to_block_k and to_block_n apply to a retile only")

    def to_proto(self) -> pb.ConversionSpec:
        """The wprep.v1.ConversionSpec of this conversion."""
        s = pb.ConversionSpec(
            layout=_LAYOUT_TO_PROTO[cast(Layout, self.layout)],
            direction=_DIRECTION_TO_PROTO[cast(Direction, self.direction)],
        )
        if self.layout == Layout.HOPPER_VALUE:
            if self.mx_axis is not None:
                s.hopper.mx_axis = self.mx_axis
            if self.mma_version is not None:
                s.hopper.mma_version = self.mma_version
        if self.layout == Layout.HOPPER_SCALE:
            if self.mx_axis is not None:
                s.hopper_scale.mx_axis = self.mx_axis
            if self.num_warps is not None:
                s.hopper_scale.num_warps = self.num_warps
            if self.align_k is not None:
                s.hopper_scale.align_k = self.align_k
        if self.block_k is not None:
            s.blackwell.block_k = self.block_k
        if self.block_n is not None:
            s.blackwell.block_n = self.block_n
        if self.to_block_k is not None:
            s.blackwell_to.block_k = self.to_block_k
        if self.to_block_n is not None:
            s.blackwell_to.block_n = self.to_block_n
        if self.packing_axis is not None:
            s.packing_axis = self.packing_axis
        return s

    def __repr__(self) -> str:
        parts = [repr(cast(Layout, self.layout).value), repr(cast(Direction, self.direction).value)]
        for f in fields(self)[2:]:
            v = getattr(self, f.name)
            if v is not None:
                parts.append(f"{f.name}={v}")
        return f"Spec({', '.join(parts)})"


@dataclass(frozen=True)
class LayoutIdentity:
    """The upstream triton_kernels object whose bytes a conversion's layout side equals.

    layout: Python's repr of the object, e.g. "HopperMXValueLayout(mx_axis=-2, mma_version=3)".
    conversion: both sides, e.g. "canonical(packing_axis=-2) -> HopperMXValueLayout(...)".
    contract_version: the version of docs/LAYOUTS.md the bytes follow.
    """

    layout: str
    conversion: str
    contract_version: int

    @classmethod
    def from_proto(cls, p: pb.LayoutIdentity) -> "LayoutIdentity":
        return cls(layout=p.layout, conversion=p.conversion, contract_version=p.contract_version)
