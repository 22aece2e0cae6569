"""A reference for the Hopper scale layout's align_k cases of tests/data/golden_scales.

The vectors of golden_scales were made by triton_kernels' torch paths (hopper_scale.py,
HopperMXScaleLayoutTransformation.swizzle_data / unswizzle_data). Their reshapes and
permutes are repeated here in numpy, independently of wprep's code, and test_scale_padding.py
checks that this reproduces every upstream-made Hopper case byte for byte. align_k then adds
one step in front, the one vLLM's _swizzle_mxfp4 takes on sm_90: the scale groups along the
mx axis are zero-padded to a multiple of align_k, and the padded tensor goes through the
upstream layout as it is.

    python3 client/python/tests/scale_reference.py   rewrites the align_k cases of
    tests/data/golden_scales (manifest entries and output files; the other cases stay).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's wprep (golden's Spec)
import golden  # noqa: E402


def _dense(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    out, s = [], 1
    for d in reversed(shape):
        out.append(s)
        s *= max(d, 1)
    return tuple(reversed(out))


def pad_groups(x: np.ndarray, mx_axis: int, align_k: int) -> np.ndarray:
    """x [..., M, K] with zero groups appended along the mx axis to a multiple of align_k."""
    axis = x.ndim + mx_axis
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -x.shape[axis] % align_k)
    return np.pad(x, pad)


def hopper_swizzle(x: np.ndarray, mx_axis: int, num_warps: int) -> np.ndarray:
    """Upstream's swizzle_data of x [..., M, K]: the storage view as upstream returns it."""
    s = np.swapaxes(x, -1, -2) if mx_axis == -2 else x  # columns along the mx axis
    *batch, m, k = s.shape
    align_m = 32 * num_warps
    s = np.pad(s, [(0, 0)] * len(batch) + [(0, -m % align_m), (0, -k % 2)])
    *batch, m, k = s.shape
    b = len(batch)
    s = s.reshape(*batch, m // align_m, 2, num_warps, 2, 8, k // 2, 2)
    s = s.transpose(*range(b), *(b + p for p in (0, 2, 5, 1, 4, 6, 3)))
    o = np.ascontiguousarray(s).reshape(*batch, m // 32, k * 32)
    return np.swapaxes(o, -1, -2) if mx_axis == -2 else o


def hopper_unswizzle(storage: np.ndarray, logical_shape: Tuple[int, ...], mx_axis: int,
                     num_warps: int) -> np.ndarray:
    """Upstream's unswizzle_data: the scale tensor [..., M, K] (a view) from its storage view."""
    o = np.swapaxes(storage, -1, -2) if mx_axis == -2 else storage
    *batch, m, k = o.shape
    b = len(batch)
    o = np.ascontiguousarray(o).reshape(*batch, m // num_warps, num_warps, k // 64, 2, 8, 2, 2)
    o = o.transpose(*range(b), *(b + p for p in (0, 3, 1, 6, 4, 2, 5)))
    s = np.ascontiguousarray(o).reshape(*batch, m * 32, k // 32)
    x = np.swapaxes(s, -1, -2) if mx_axis == -2 else s
    return x[..., : logical_shape[-2], : logical_shape[-1]]


def memory_bytes(view: np.ndarray) -> Tuple[bytes, Tuple[int, ...]]:
    """(bytes in memory order, strides) as the vectors store an output view: the view's own
    memory where it is dense (possibly permuted), else its row-major copy (torch's clone())."""
    strides = tuple(view.strides)
    if golden._torch_dense(view.shape, strides) and view.base is not None:
        order = sorted(range(view.ndim), key=lambda d: -strides[d])
        return np.ascontiguousarray(view.transpose(order)).tobytes(), strides
    return np.ascontiguousarray(view).tobytes(), strides


def swizzle_reference(x: np.ndarray, mx_axis: int, num_warps: int, align_k: int = 2) -> np.ndarray:
    """What a Hopper scale swizzle with align_k must write: upstream's layout of the padded x."""
    return hopper_swizzle(pad_groups(x, mx_axis, align_k), mx_axis, num_warps)


# (name suffix, logical shape, mx_axis, num_warps, align_k, direction, transposed checkpoint view)
PADDED = [
    # gpt-oss's w13 and w2 scales as loaders pass them: the [E, 90, N] view of [E, N, 90].
    ("gptoss_w13_2x90x5760_mx2_w8_a4", (2, 90, 5760), -2, 8, 4, "swizzle", True),
    ("gptoss_w13_2x90x5760_mx2_w4_a4", (2, 90, 5760), -2, 4, 4, "swizzle", True),
    ("gptoss_w2_2x90x2880_mx2_w8_a4", (2, 90, 2880), -2, 8, 4, "swizzle", True),
    ("gptoss_w2_2x90x2880_mx2_w8_a4", (2, 90, 2880), -2, 8, 4, "unswizzle", False),
    ("3x90x100_mx2_w4_a4", (3, 90, 100), -2, 4, 4, "swizzle", False),
    ("3x90x100_mx2_w4_a4", (3, 90, 100), -2, 4, 4, "unswizzle", False),
    ("3x100x90_mx1_w8_a4", (3, 100, 90), -1, 8, 4, "swizzle", False),
    ("3x100x90_mx1_w8_a4", (3, 100, 90), -1, 8, 4, "unswizzle", False),
    ("130x3_mx1_w4_a4", (130, 3), -1, 4, 4, "swizzle", False),
    ("130x3_mx2_w4_a4", (130, 3), -2, 4, 4, "swizzle", False),
    ("5x45x70_mx2_w2_a8", (5, 45, 70), -2, 2, 8, "swizzle", False),
    ("5x45x70_mx2_w2_a8", (5, 45, 70), -2, 2, 8, "unswizzle", False),
    # DeepSeek-V3-like 64 groups: a multiple of 4, so align_k 4 changes nothing.
    ("1x64x512_mx2_w8_a4", (1, 64, 512), -2, 8, 4, "swizzle", True),
]
ERRORS = [
    ("hopper_scale_swizzle_64x8_mx2_w8_a3", 3, "align_k must be a power of two in [2, 64]"),
    ("hopper_scale_swizzle_64x8_mx2_w8_a128", 128, "align_k must be a power of two in [2, 64]"),
    ("hopper_scale_unswizzle_64x8_mx1_w8_a1", 1, "align_k must be a power of two in [2, 64]"),
]
SEED = 7100
SOURCE = ("numpy port of triton_kernels hopper_scale.py (14dd7a19) torch path (checked against this "
          "manifest's upstream-made cases), applied to the scale tensor zero-padded along the mx "
          "axis to a multiple of align_k")


def padded_cases() -> List[Tuple[dict, Optional[bytes]]]:
    """(manifest entry, output file bytes or None) for every align_k case, errors included."""
    out: List[Tuple[dict, Optional[bytes]]] = []
    for i, (suffix, shape, mx, nw, ak, direction, transposed) in enumerate(PADDED):
        seed = SEED + i
        case = {"name": f"hopper_scale_{direction}_{suffix}", "layout": "hopper_scale", "direction": direction,
                "params": {"mx_axis": mx, "num_warps": nw, "align_k": ak}, "logical_shape": list(shape),
                "source": SOURCE, "input_splitmix64_seed": seed}
        if direction == "swizzle":
            n = int(np.prod(shape))
            data = golden.splitmix64_bytes(seed, n)
            if transposed:  # the checkpoint [..., K, M] in memory, viewed as [..., M, K]
                mem = np.frombuffer(data, np.uint8).reshape(*shape[:-2], shape[-1], shape[-2])
                x = np.swapaxes(mem, -1, -2)
            else:
                x = np.frombuffer(data, np.uint8).reshape(shape)
            view = swizzle_reference(x, mx, nw, ak)
            in_shape, in_strides = list(x.shape), list(x.strides)
        else:
            padded_shape = list(hopper_swizzle(pad_groups(np.zeros(shape, np.uint8), mx, ak), mx, nw).shape)
            n = int(np.prod(padded_shape))
            data = golden.splitmix64_bytes(seed, n)
            o = np.frombuffer(data, np.uint8)
            if mx == -2:  # memory is O [..., R/32, 32C], reported as its transpose
                mem = o.reshape(*padded_shape[:-2], padded_shape[-1], padded_shape[-2])
                storage = np.swapaxes(mem, -1, -2)
            else:
                storage = o.reshape(padded_shape)
            view = hopper_unswizzle(storage, shape, mx, nw)
            in_shape, in_strides = list(storage.shape), list(storage.strides)
        out_bytes, out_strides = memory_bytes(view)
        case.update({"input_shape": in_shape, "input_strides": in_strides, "input_bytes": n,
                     "input_sha256": golden.sha256(data), "output_shape": list(view.shape),
                     "output_strides": list(out_strides), "output_bytes": len(out_bytes),
                     "output_sha256": golden.sha256(out_bytes)})
        stored = None
        if len(out_bytes) <= 98304:
            case["output"] = f"cases/{case['name']}.out.bin"
            stored = out_bytes
        out.append((case, stored))
    for name, ak, why in ERRORS:
        direction = "unswizzle" if "unswizzle" in name else "swizzle"
        mx = -1 if "_mx1_" in name else -2
        out.append(({"name": name, "layout": "hopper_scale", "direction": direction,
                     "params": {"mx_axis": mx, "num_warps": 8, "align_k": ak}, "logical_shape": [64, 8],
                     "error": "invalid_argument", "why": why}, None))
    return out


def write(data_dir: Path) -> None:
    """Replaces the align_k cases of data_dir/golden_scales with freshly computed ones."""
    d = data_dir / "golden_scales"
    manifest = json.loads((d / "manifest.json").read_text())
    keep = [c for c in manifest["cases"] if "align_k" not in c.get("params", {})]
    for c in manifest["cases"]:
        if "align_k" in c.get("params", {}) and "output" in c:
            (d / c["output"]).unlink(missing_ok=True)
    added = padded_cases()
    for case, stored in added:
        if stored is not None:
            (d / case["output"]).write_bytes(stored)
    manifest["cases"] = keep + [c for c, _ in added]
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    write(golden.data_dir())
