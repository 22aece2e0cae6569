"""The Hopper scale layout with its groups zero-padded (align_k): what vLLM's _swizzle_mxfp4 gives
on sm_90, checked against a reference that wprep's code has no part in.

scale_reference.py repeats triton_kernels' torch path in numpy; it must first reproduce every
upstream-made Hopper vector of golden_scales, and only then makes the align_k vectors (the
layout of the scale tensor with zero groups appended). test_golden.py runs all of them through
a daemon; here the vectors are recomputed, and the daemon's padded form is held to the
contract on gpt-oss's shapes: the plain layout of the zero-padded tensor.
"""

import grpc
import numpy as np
import pytest

import golden
import scale_reference as ref
from wprep import Spec, WprepError

SCALES = [c for c in golden.load("golden_scales") if not c.error and c.spec.layout.value == "hopper_scale"]
UPSTREAM = [c for c in SCALES if c.spec.align_k is None]
PADDED = [c for c in SCALES if c.spec.align_k is not None]


def _reference(c):
    flat = np.frombuffer(golden.golden_input(c), np.uint8)
    view = np.lib.stride_tricks.as_strided(flat, c.input_shape, c.input_strides)
    mx, nw, ak = c.spec.mx_axis, c.spec.num_warps, c.spec.align_k or 2
    if c.spec.direction.value == "swizzle":
        return ref.swizzle_reference(view, mx, nw, ak)
    return ref.hopper_unswizzle(view, c.logical_shape, mx, nw)


def _assert_is_the_vector(c, out):
    data, strides = ref.memory_bytes(out)
    assert tuple(out.shape) == c.output_shape, c.name
    assert strides == c.output_strides, c.name
    assert golden.matches(c, data), c.name


def test_the_sets_have_upstream_and_padded_cases_on_gpt_oss_shapes():
    assert len(UPSTREAM) == 40 and len(PADDED) >= 12
    gptoss = [c for c in PADDED if c.logical_shape[-2:] in ((90, 5760), (90, 2880))]
    assert {c.spec.direction.value for c in gptoss} == {"swizzle", "unswizzle"}
    assert any(c.output_shape == (2, 2944, 184) for c in gptoss)  # w13: 92 groups, not 90
    errors = [c for c in golden.load("golden_scales") if c.error and c.spec.align_k is not None]
    assert len(errors) == 3


@pytest.mark.parametrize("c", UPSTREAM, ids=lambda c: c.name)
def test_the_reference_reproduces_upstreams_vectors(c):
    # The numpy port is only trusted for padded inputs because it gives upstream's bytes,
    # shapes and strides for every case upstream's own code made.
    _assert_is_the_vector(c, _reference(c))


@pytest.mark.parametrize("c", PADDED, ids=lambda c: c.name)
def test_the_padded_vectors_are_the_layout_of_zero_padded_scales(c):
    _assert_is_the_vector(c, _reference(c))


def test_padding_only_appends_zero_groups():
    # Unpadded groups keep their bytes where the layout puts them; the appended ones are 0.
    x = np.frombuffer(golden.splitmix64_bytes(99, 90 * 300), np.uint8).reshape(300, 90).T  # [90, 300] view
    plain = np.ascontiguousarray(ref.swizzle_reference(x, -2, 8, 2).T)  # O [R/32, 32*90]
    padded = np.ascontiguousarray(ref.swizzle_reference(x, -2, 8, 4).T)  # O [R/32, 32*92]
    assert padded.shape == (plain.shape[0], 32 * 92)
    # Group pairs (2 k0 + d) sit in 64-byte blocks: blocks 0..44 hold groups 0..89 alike.
    assert np.array_equal(padded[:, : 64 * 45], plain)
    assert not padded[:, 64 * 45:].any()


def _gpt_oss_view(e, n, seed):
    """A checkpoint's [E, N, 90] scales and the [E, 90, N] view loaders pass."""
    ckpt = np.frombuffer(golden.splitmix64_bytes(seed, e * n * 90), np.uint8).reshape(e, n, 90)
    return ckpt, np.swapaxes(ckpt, -1, -2)


@pytest.mark.parametrize("n", [5760, 2880])
def test_the_daemons_padded_form_is_the_plain_layout_of_the_zero_padded_tensor(client, n):
    ckpt, view = _gpt_oss_view(2, n, 31 + n)
    padded = client.convert(Spec("hopper_scale", mx_axis=-2, num_warps=8, align_k=4), view.shape, view)
    # The loader's own step: zero groups appended to the checkpoint, then the plain layout.
    by_hand = np.swapaxes(np.pad(ckpt, ((0, 0), (0, 0), (0, 2))), -1, -2)
    plain = client.convert(Spec("hopper_scale", mx_axis=-2, num_warps=8), by_hand.shape, by_hand)
    assert padded.data == plain.data and padded.shape == plain.shape == (2, 2944, (n + 255) // 256 * 256 // 32)
    assert padded.strides == plain.strides
    assert padded.identity.layout == plain.identity.layout == "HopperMXScaleLayout(mx_axis=-2, num_warps=8)"
    assert padded.identity.conversion == "scales(align_k=4) -> HopperMXScaleLayout(mx_axis=-2, num_warps=8)"
    assert plain.identity.conversion == "scales -> HopperMXScaleLayout(mx_axis=-2, num_warps=8)"
    # and the reference agrees
    data, _ = ref.memory_bytes(ref.swizzle_reference(view, -2, 8, 4))
    assert padded.data == data
    # Unswizzled, the padded storage gives back the 90 groups.
    back = client.convert(Spec("hopper_scale", "unswizzle", mx_axis=-2, num_warps=8, align_k=4), view.shape,
                          padded.numpy())
    assert np.array_equal(back.numpy(), view)


@pytest.mark.parametrize("align_k", [0, 1, 3, 128])
def test_a_bad_align_k_is_invalid_argument_naming_it(client, align_k):
    with pytest.raises(WprepError) as e:
        client.plan(Spec("hopper_scale", mx_axis=-2, num_warps=8, align_k=align_k), (90, 2880))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"align_k must be a power of two in [2, 64], got {align_k}" in e.value.details


def test_align_k_belongs_to_hopper_scale_only():
    with pytest.raises(ValueError, match="align_k applies to hopper_scale"):
        Spec("blackwell_scale", align_k=4)
    assert Spec("hopper_scale", align_k=4).to_proto().hopper_scale.align_k == 4
    assert not Spec("hopper_scale").to_proto().hopper_scale.HasField("align_k")
