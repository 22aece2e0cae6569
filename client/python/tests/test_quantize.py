"""wprep.quantize_mxfp4 against a real wprepd on the CPU engine (numpy, inline bytes): every
case of tests/data/golden_quant byte for byte, the fused Blackwell layout equal to quantize
then the two swizzles (the daemon's convert) and to the CLI's in-process engine
(`wprep quantize --local`), float16 and float32 inputs, out= in place, and the errors. The
CUDA request (IPC offsets and sizes, outputs allocated or given, the stream synchronized, the
errors before any export) against a stand-in for torch; and, with torch and a GPU (skipped
otherwise), CUDA tensors quantized in place through IPC on a GPU daemon, bytes equal to the
CPU engine's."""

import json
import os
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest

import wprep
from wprep import Spec, WprepError
from wprep._quantize import output_shapes
from wprep.v1 import wprep_pb2 as pb

from conftest import torch_cuda
from golden import data_dir, sha256

MANIFEST = json.loads((data_dir() / "golden_quant" / "manifest.json").read_text())
CASES = MANIFEST["cases"]


def _read(case, key, dtype=np.uint8):
    return np.fromfile(data_dir() / "golden_quant" / case[key], dtype=dtype)


def _input(case):
    """The case's input as bfloat16 bit patterns (uint16), shaped."""
    assert case["input_dtype"] == "bfloat16"
    return _read(case, "input", np.dtype("<u2")).reshape(case["input_shape"])


def _rounding(case):
    return case["params"]["scale_rounding"]


def _expected(case):
    v, s = _read(case, "values"), _read(case, "scales")
    assert sha256(v.tobytes()) == case["values_sha256"] and sha256(s.tobytes()) == case["scales_sha256"]
    return v.reshape(case["values_shape"]), s.reshape(case["scales_shape"])


def test_every_reference_case_is_there():
    assert len(CASES) == 40
    assert {c["op"] for c in CASES} == {"quantize_mxfp4"}
    assert {_rounding(c) for c in CASES} == {"up", "down"}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_reference_case_byte_for_byte(client, case):
    q = wprep.quantize_mxfp4(_input(case), scale_rounding=_rounding(case), client=client)
    want_v, want_s = _expected(case)
    for got, want in ((q.values, want_v), (q.scales, want_s)):
        assert got.dtype == np.uint8 and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    assert q.engine == "cpu"
    assert q.value_identity.conversion == (f"bfloat16 -> quantize_mxfp4(scale_rounding={_rounding(case)}) -> "
                                           "canonical(packing_axis=-1)")
    assert q.scale_identity.layout == "scales" and q.value_identity.contract_version == 1
    values, scales = q  # unpacks as (values, scales)
    assert values is q.values and scales is q.scales


@pytest.mark.parametrize("case", CASES[::5], ids=[c["name"] for c in CASES[::5]])
def test_float32_of_the_same_values_quantizes_the_same(client, case):
    # Every bfloat16 is a float32 (its bits, shifted up 16): the same numbers, the same bytes.
    x = (_input(case).astype(np.uint32) << 16).view(np.float32)
    q = wprep.quantize_mxfp4(x, scale_rounding=_rounding(case), client=client)
    want_v, want_s = _expected(case)
    assert q.values.tobytes() == want_v.tobytes() and q.scales.tobytes() == want_s.tobytes()
    assert q.value_identity.conversion.startswith("float32 -> ")
    # Big-endian arrays are sent little-endian.
    q = wprep.quantize_mxfp4(x.astype(">f4"), scale_rounding=_rounding(case), client=client)
    assert q.values.tobytes() == want_v.tobytes() and q.scales.tobytes() == want_s.tobytes()


def test_ml_dtypes_bfloat16_is_taken_as_is(client):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    case = CASES[0]
    q = wprep.quantize_mxfp4(_input(case).view(ml_dtypes.bfloat16), scale_rounding=_rounding(case), client=client)
    want_v, want_s = _expected(case)
    assert q.values.tobytes() == want_v.tobytes() and q.scales.tobytes() == want_s.tobytes()


def test_out_is_written_in_place_and_keeps_addresses(client):
    case = CASES[16]  # [2, 64, 1024]
    out = (np.full(case["values_shape"], 0xEE, np.uint8), np.full(case["scales_shape"], 0xEE, np.uint8))
    addresses = [a.ctypes.data for a in out]
    q = wprep.quantize_mxfp4(_input(case), scale_rounding=_rounding(case), out=out, client=client)
    want_v, want_s = _expected(case)
    assert q.values is out[0] and q.scales is out[1]
    assert [a.ctypes.data for a in out] == addresses
    assert out[0].tobytes() == want_v.tobytes() and out[1].tobytes() == want_s.tobytes()
    # Any shape of the right bytes will do: a flat buffer of a loader's pool.
    flat = (np.zeros(want_v.size, np.uint8), np.zeros(want_s.size, np.uint8))
    wprep.quantize_mxfp4(_input(case), scale_rounding=_rounding(case), out=flat, client=client)
    assert flat[0].tobytes() == want_v.tobytes() and flat[1].tobytes() == want_s.tobytes()


# -- the fused Blackwell layout ---------------------------------------------------------------


def _blackwell_by_convert(client, x, rounding):
    """quantize, then blackwell_value (packing -2 of the logical [..., K, N]) and
    blackwell_scale of the transposed scales [..., K/32, N]: what the fused layout must equal."""
    q = wprep.quantize_mxfp4(x, scale_rounding=rounding, client=client)
    *lead, n, k = x.shape
    v = client.convert(Spec("blackwell_value", packing_axis=-2), [*lead, k, n], q.values)
    s = client.convert(Spec("blackwell_scale"), [*lead, (k + 31) // 32, n], q.scales.swapaxes(-2, -1))
    return v.data, s.data


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_blackwell_equals_quantize_then_the_swizzles(client, case):
    x = _input(case)
    q = wprep.quantize_mxfp4(x, layout="blackwell_value", scale_rounding=_rounding(case), client=client)
    want_v, want_s = _blackwell_by_convert(client, x, _rounding(case))
    assert q.values.tobytes() == want_v and q.scales.tobytes() == want_s
    *lead, n, k = x.shape
    def rup(a, m):
        return (a + m - 1) // m * m

    assert q.values.shape == (*lead, n, rup(k // 2, 128))
    assert q.scales.shape == (int(np.prod(lead, dtype=np.int64)), rup((k + 31) // 32, 8) * rup(n, 128))
    assert q.value_identity.layout == "BlackwellMXValueLayout()"
    assert q.scale_identity.layout == "BlackwellMXScaleLayout()"
    assert q.value_identity.conversion.startswith(f"bfloat16 -> quantize_mxfp4(scale_rounding={_rounding(case)})")


SHUFFLED_BLOCKS = [(128, 256), (64, 32), (34, 7)]


@pytest.mark.parametrize("block", SHUFFLED_BLOCKS, ids=[f"{k}x{n}" for k, n in SHUFFLED_BLOCKS])
@pytest.mark.parametrize("case", CASES[::2], ids=[c["name"] for c in CASES[::2]])
def test_blackwell_shuffled_equals_quantize_then_the_swizzles(client, case, block):
    x = _input(case)
    block_k, block_n = block
    q = wprep.quantize_mxfp4(x, layout="blackwell_shuffled_value", block_k=block_k, block_n=block_n,
                             scale_rounding=_rounding(case), client=client)
    c = wprep.quantize_mxfp4(x, scale_rounding=_rounding(case), client=client)
    *lead, n, k = x.shape
    v = client.convert(Spec("blackwell_shuffled_value", block_k=block_k, block_n=block_n, packing_axis=-2),
                       [*lead, k, n], c.values)
    _, want_s = _blackwell_by_convert(client, x, _rounding(case))
    assert q.values.tobytes() == v.data and q.scales.tobytes() == want_s
    assert q.values.shape == tuple(v.shape)  # the swizzle's own report: [M, ntk, ntn, block_n, block_k/2]
    assert q.value_identity.layout == f"BlackwellMX4ValueShuffledLayout(block_k={block_k}, block_n={block_n})"
    assert q.scale_identity.layout == "BlackwellMXScaleLayout()"


# -- the fused Hopper layout -------------------------------------------------------------------

HOPPER_PARAMS = [(3, 8, 2), (2, 4, 4), (3, 1, 64), (2, 16, 2)]


def _hopper_by_convert(client, x, rounding, mma_version, num_warps, align_k):
    """quantize, then hopper_value (mx_axis -2, from packing -2 of the logical [..., K, N]) and
    hopper_scale (mx_axis -2) of the transposed scales [..., ceil(K/32), N]."""
    q = wprep.quantize_mxfp4(x, scale_rounding=rounding, client=client)
    *lead, n, k = x.shape
    v = client.convert(Spec("hopper_value", mx_axis=-2, mma_version=mma_version, packing_axis=-2), [*lead, k, n],
                       q.values)
    s = client.convert(Spec("hopper_scale", mx_axis=-2, num_warps=num_warps, align_k=align_k),
                       [*lead, (k + 31) // 32, n], q.scales.swapaxes(-2, -1))
    return v, s


def _memory(a):
    """The bytes of a Hopper output's row-major memory (it is returned as the transposed view)."""
    return np.ascontiguousarray(a.swapaxes(-1, -2)).tobytes()


@pytest.mark.parametrize("params", HOPPER_PARAMS, ids=[f"mma{m}-w{w}-a{a}" for m, w, a in HOPPER_PARAMS])
@pytest.mark.parametrize("case", CASES[::2], ids=[c["name"] for c in CASES[::2]])
def test_hopper_equals_quantize_then_the_swizzles(client, case, params):
    x = _input(case)
    if x.ndim < 2 or x.shape[-1] % 2:
        pytest.skip("the fused layouts take a weight [..., N, K] with an even K")
    mma_version, num_warps, align_k = params
    q = wprep.quantize_mxfp4(x, layout="hopper_value", scale_rounding=_rounding(case), mma_version=mma_version,
                             num_warps=num_warps, align_k=align_k, client=client)
    v, s = _hopper_by_convert(client, x, _rounding(case), *params)
    assert _memory(q.values) == v.data and _memory(q.scales) == s.data
    # Shapes and strides as the swizzles report them: the transposed views of row-major memory.
    assert q.values.shape == tuple(v.shape) and q.scales.shape == tuple(s.shape)
    assert q.values.strides == tuple(v.strides) and q.scales.strides == tuple(s.strides)
    assert q.value_identity.layout == f"HopperMXValueLayout(mx_axis=-2, mma_version={mma_version})"
    assert q.scale_identity.layout == f"HopperMXScaleLayout(mx_axis=-2, num_warps={num_warps})"
    assert q.value_identity.conversion.startswith("bfloat16 -> quantize_mxfp4(scale_rounding=")


BAD_LAYOUT_PARAMS = [
    ("hopper_value", {"mma_version": 4}, "mma_version"),
    ("hopper_value", {"num_warps": 3}, "num_warps"),
    ("hopper_value", {"align_k": 128}, "align_k"),
    (None, {"num_warps": 4}, "hopper_value"),
    ("blackwell_shuffled_value", {"block_k": 3}, "block_k"),
    ("blackwell_shuffled_value", {"block_n": 0}, "block_n"),
    ("blackwell_value", {"block_k": 64}, "blackwell_shuffled_value"),
]


@pytest.mark.parametrize("layout,params,word", BAD_LAYOUT_PARAMS)
def test_layout_parameters_are_checked_before_sending(client, layout, params, word):
    x = np.zeros((4, 64), np.float32)
    assert word in _invalid(lambda: wprep.quantize_mxfp4(x, layout=layout, client=client, **params))


def test_the_daemon_refuses_a_hopper_item_with_mx_axis_minus_1(client):
    req = pb.ConvertBatchRequest()
    item = req.items.add().quantize
    item.dtype = pb.QUANTIZE_DTYPE_FLOAT32
    item.shape.extend([4, 64])
    item.layout = pb.QUANTIZE_LAYOUT_HOPPER
    item.hopper.mx_axis = -1
    item.source.inline_bytes = bytes(4 * 64 * 4)
    with pytest.raises(WprepError) as e:
        client._unary("ConvertBatch", req, None)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].quantize.hopper.mx_axis must be -2" in e.value.details


# -- the trtllm-gen MXFP4 preparation ------------------------------------------------------------

TRTLLM_CASES = [("trtllm_w13", (2, 70, 96), 128, "float32"), ("trtllm_w2", (3, 130, 64), 256, "bfloat16"),
                ("trtllm_w13", (1, 8, 2880), 256, None), ("trtllm_w2", (2, 33, 320), 128, "float32")]


def _bias(rng, shape, dtype):
    b = rng.standard_normal(shape[:2]).astype(np.float32)
    return (b.view(np.uint32) >> 16).astype("<u2") if dtype == "bfloat16" else b


@pytest.mark.parametrize("layout,shape,align,bias_dtype", TRTLLM_CASES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_trtllm_equals_quantize_then_prepare(client, layout, shape, align, bias_dtype, dtype):
    import wprep.trtllm as trtllm

    rng = np.random.default_rng(sum(shape) + align)
    x = _random(rng, shape, dtype)
    bias = _bias(rng, shape, bias_dtype) if bias_dtype else None
    q = wprep.quantize_mxfp4(x, layout=layout, align=align, bias=bias, client=client)
    canon = wprep.quantize_mxfp4(x, client=client)
    prepare = trtllm.prepare_w13 if layout == "trtllm_w13" else trtllm.prepare_w2
    if bias_dtype == "bfloat16":  # the MoE item takes bf16 bits as ml_dtypes; float32 widening is exact
        bias_in = (bias.astype(np.uint32) << 16).view(np.float32)
    else:
        bias_in = bias
    want = prepare(canon.values, canon.scales, bias_in, align=align, client=client)
    assert q.values.tobytes() == want.values.tobytes() and q.scales.tobytes() == want.scales.tobytes()
    assert q.values.shape == want.values.shape and q.scales.shape == want.scales.shape
    if bias is None:
        assert q.bias is None
    else:
        assert q.bias.dtype == np.float32 and q.bias.tobytes() == want.bias.tobytes()
    op = "prepare_w13" if layout == "trtllm_w13" else "prepare_w2"
    assert q.value_identity.layout == f"trtllm_gen:{op} format=mxfp4 align={align} contract=1"
    assert (q.values.shape, q.scales.shape) == output_shapes(shape, layout, align=align)


def test_trtllm_arguments_are_checked_before_sending(client):
    x = np.zeros((2, 6, 64), np.float32)
    assert "rank 3" in _invalid(lambda: wprep.quantize_mxfp4(np.zeros((6, 64), np.float32), layout="trtllm_w2",
                                                             client=client))
    assert "multiple of 32" in _invalid(lambda: wprep.quantize_mxfp4(np.zeros((2, 6, 48), np.float32),
                                                                     layout="trtllm_w2", client=client))
    assert "even R" in _invalid(lambda: wprep.quantize_mxfp4(np.zeros((2, 7, 64), np.float32), layout="trtllm_w13",
                                                             client=client))
    assert "align" in _invalid(lambda: wprep.quantize_mxfp4(x, layout="trtllm_w2", align=100, client=client))
    assert "align and bias" in _invalid(lambda: wprep.quantize_mxfp4(x, bias=np.zeros((2, 6), np.float32),
                                                                     client=client))
    assert "[E, R]" in _invalid(lambda: wprep.quantize_mxfp4(x, layout="trtllm_w2", bias=np.zeros((2, 5), np.float32),
                                                             client=client))
    assert "bias_dtype" in _invalid(lambda: wprep.quantize_mxfp4(x, layout="trtllm_w2",
                                                                 bias=np.zeros((2, 6), np.float16), client=client))


def _cli():
    """The wprep CLI: $WPREP_CLI, else the one built next to $WPREPD (build/client/cli/wprep)."""
    from conftest import wprepd_path

    path = os.environ.get("WPREP_CLI") or str(Path(wprepd_path()).resolve().parents[1] / "client" / "cli" / "wprep")
    if not os.access(path, os.X_OK):
        pytest.skip(f"no wprep CLI at {path} (set $WPREP_CLI); the daemon's Blackwell bytes are still checked "
                    "against quantize then the swizzles")
    return path


_DTYPES = {"bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2"), "float32": np.dtype("<f4")}


def _random(rng, shape, dtype):
    """Normal values over a wide range of magnitudes, with zero groups, infinities and NaN."""
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-12, 12, shape)).astype(np.float32)
    flat = x.reshape(-1)
    if flat.size >= 64:
        flat[:32] = 0
        flat[40], flat[41], flat[42] = np.inf, -np.inf, np.nan
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype("<u2")
    return x.astype(_DTYPES[dtype])


CLI_CASES = [
    ("bfloat16", "up", None, (3, 70, 96)),
    ("bfloat16", "down", "blackwell_value", (2, 130, 200)),
    ("float16", "up", "blackwell_value", (5, 66)),
    ("float16", "down", None, (4, 33)),
    ("float32", "up", None, (2, 3, 95)),
    ("float32", "down", "blackwell_value", (1, 257, 64)),
    ("float32", "up", "blackwell_value", (2, 2, 7, 34)),
    ("bfloat16", "up", "hopper_value", (2, 300, 200)),
    ("float16", "down", "hopper_value", (3, 70, 96)),
    ("float32", "up", "hopper_value", (1, 257, 64)),
    ("bfloat16", "down", "blackwell_shuffled_value", (2, 300, 200)),
    ("float16", "up", "blackwell_shuffled_value", (2, 2, 7, 34)),
]


@pytest.mark.parametrize("dtype,rounding,layout,shape", CLI_CASES)
def test_equals_the_clis_local_engine(client, tmp_path, dtype, rounding, layout, shape):
    cli = _cli()
    x = _random(np.random.default_rng(sum(shape)), shape, dtype)
    x.tofile(tmp_path / "in")
    cmd = [cli, "quantize", "--local", "--dtype", dtype, "--shape", ",".join(map(str, shape)),
           "--scale-rounding", rounding, "--input", str(tmp_path / "in"),
           "--values-output", str(tmp_path / "v"), "--scales-output", str(tmp_path / "s")]
    if layout:
        cmd += ["--layout", layout]
    subprocess.run(cmd, check=True, capture_output=True)
    q = wprep.quantize_mxfp4(x, layout=layout, scale_rounding=rounding, client=client)
    if layout == "hopper_value":  # returned as the transposed views of the memory the CLI writes
        q.values, q.scales = q.values.swapaxes(-1, -2), q.scales.swapaxes(-1, -2)
    assert q.values.tobytes() == (tmp_path / "v").read_bytes()
    assert q.scales.tobytes() == (tmp_path / "s").read_bytes()
    assert (q.values.shape, q.scales.shape) == output_shapes(shape, layout)


@pytest.mark.parametrize("layout", [None, "blackwell_value", "blackwell_shuffled_value", "hopper_value"])
def test_the_clients_output_shapes_are_the_daemons(client, layout):
    # A CUDA caller's outputs are allocated from output_shapes before the call: it must give
    # what the daemon answers, ragged and empty shapes included (the call checks the answer too).
    rng = np.random.default_rng(7)
    shapes = [(1, 2), (3, 0), (0, 64), (2, 0, 64), (4, 34), (129, 66), (2, 1, 9, 258)]
    if layout is None:
        shapes += [(0,), (1,), (31,), (33,), (2, 3, 65)]
    for shape in shapes:
        q = wprep.quantize_mxfp4(rng.standard_normal(shape).astype(np.float16), layout=layout, client=client)
        if layout == "hopper_value":  # the transposed views of the memory output_shapes gives
            q.values, q.scales = q.values.swapaxes(-1, -2), q.scales.swapaxes(-1, -2)
        assert (q.values.shape, q.scales.shape) == output_shapes(shape, layout), shape


# -- errors -----------------------------------------------------------------------------------


def _invalid(fn):
    with pytest.raises(WprepError) as e:
        fn()
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
    return e.value.details


@pytest.mark.parametrize("dtype", [np.float64, np.int16, np.uint8, np.int32, np.complex64])
def test_other_dtypes_are_refused(client, dtype):
    assert "dtype" in _invalid(lambda: wprep.quantize_mxfp4(np.zeros((2, 32), dtype), client=client))


def test_bad_shapes_are_refused(client):
    assert "rank" in _invalid(lambda: wprep.quantize_mxfp4(np.ones((), np.float32), client=client))
    details = _invalid(lambda: wprep.quantize_mxfp4(np.zeros(64, np.float32), layout="blackwell_value",
                                                    client=client))
    assert "rank >= 2" in details
    details = _invalid(lambda: wprep.quantize_mxfp4(np.zeros((4, 33), np.float32), layout="blackwell_value",
                                                    client=client))
    assert "even K" in details


def test_bad_arguments_are_refused(client):
    x = np.zeros((2, 32), np.float32)
    assert "layout" in _invalid(lambda: wprep.quantize_mxfp4(x, layout="blackwell_scale", client=client))
    assert "scale_rounding" in _invalid(lambda: wprep.quantize_mxfp4(x, scale_rounding="nearest", client=client))
    assert "numpy array" in _invalid(lambda: wprep.quantize_mxfp4([[1.0] * 32], client=client))
    assert "completion" in _invalid(lambda: wprep.quantize_mxfp4(x, completion="later", client=client))


def test_a_wrong_out_is_refused_and_nothing_is_written(client):
    x = np.ones((2, 64), np.float32)
    good = (np.zeros((2, 32), np.uint8), np.zeros((2, 2), np.uint8))
    short = (np.zeros((2, 32), np.uint8), np.zeros(3, np.uint8))
    assert "out scales" in _invalid(lambda: wprep.quantize_mxfp4(x, out=short, client=client))
    assert not short[0].any()
    assert "(values, scales)" in _invalid(lambda: wprep.quantize_mxfp4(x, out=good[:1], client=client))
    assert "numpy array" in _invalid(lambda: wprep.quantize_mxfp4(x, out=(bytearray(64), good[1]), client=client))
    strided = (np.zeros((2, 64), np.uint8)[:, ::2], good[1])
    assert "contiguous" in _invalid(lambda: wprep.quantize_mxfp4(x, out=strided, client=client))
    assert not good[0].any() and not good[1].any()


@pytest.mark.parametrize("completion", ["stream", "async"])
def test_fenced_completions_are_refused_before_sending(client, completion):
    with pytest.raises(WprepError) as e:
        wprep.quantize_mxfp4(np.zeros((2, 32), np.float32), completion=completion, client=client)
    assert e.value.code == grpc.StatusCode.UNIMPLEMENTED and "host" in e.value.details


def test_the_daemon_serves_no_fences_for_quantize_items(client):
    # Why completion= is "host" only: the daemon refuses a fenced quantize batch. When it
    # serves one, this fails: let quantize_mxfp4 take "stream" and "async" then.
    req = pb.ConvertBatchRequest(answer_when=pb.ANSWER_WHEN_QUEUED)
    item = req.items.add().quantize
    item.dtype, item.source.inline_bytes = pb.QUANTIZE_DTYPE_FLOAT32, bytes(128)
    item.shape.extend([32])
    with pytest.raises(WprepError) as e:
        client._unary("ConvertBatch", req, None)
    assert e.value.code == grpc.StatusCode.UNIMPLEMENTED and "quantize" in e.value.details


def test_the_daemons_refusals_come_back_as_wprep_errors():
    # What only the daemon knows (its limits) is refused by it, naming the item.
    from conftest import wprepd_path
    from wprep.testing import LocalDaemon

    with LocalDaemon(wprepd_path(), ["--devices=cpu", "--max-tensor-bytes=4096"]) as d:
        with wprep.Client(d.target, timeout=60) as c:
            with pytest.raises(WprepError) as e:
                wprep.quantize_mxfp4(np.zeros((64, 64), np.float32), client=c)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.details.startswith("items[0].quantize.source"), e.value.details
            small = wprep.quantize_mxfp4(np.zeros((4, 64), np.float32), client=c)
            assert small.values.shape == (4, 32) and not small.values.any()


# -- torch: CPU tensors inline, CUDA tensors in place ----------------------------------------


def test_cpu_tensors_go_inline_and_come_back_as_tensors(client):
    torch = pytest.importorskip("torch")
    case = CASES[8]
    x = torch.from_numpy(_input(case).view(np.int16)).view(torch.bfloat16)
    q = wprep.quantize_mxfp4(x, scale_rounding=_rounding(case), client=client)
    want_v, want_s = _expected(case)
    assert isinstance(q.values, torch.Tensor) and q.values.dtype == torch.uint8
    assert q.values.numpy().tobytes() == want_v.tobytes() and q.scales.numpy().tobytes() == want_s.tobytes()




@pytest.fixture(scope="module")
def gpu_client():
    """A daemon serving the GPUs (the session's `client` is pinned to the CPU engine). The tests
    that use it have "gpu" in their names, for `pytest -k gpu` on a GPU machine."""
    torch_cuda()
    from conftest import wprepd_path
    from wprep.testing import LocalDaemon

    with LocalDaemon(wprepd_path(), []) as d:
        with wprep.Client(d.target, timeout=120) as c:
            yield c


def _cuda_bf16(torch, bits):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).cuda().view(torch.bfloat16)


def _bytes(t):
    import torch

    return t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("layout", [None, "blackwell_value", "blackwell_shuffled_value"])
@pytest.mark.parametrize("case", CASES[::3], ids=[c["name"] for c in CASES[::3]])
def test_gpu_cuda_tensors_are_quantized_in_place_and_equal_the_cpu_engine(client, gpu_client, case, layout):
    torch = torch_cuda()
    x = _cuda_bf16(torch, _input(case))
    cpu = wprep.quantize_mxfp4(_input(case), layout=layout, scale_rounding=_rounding(case), client=client)
    q = wprep.quantize_mxfp4(x, layout=layout, scale_rounding=_rounding(case), client=gpu_client)
    assert q.engine.startswith("cuda:"), q.engine  # in place on the GPU, not through the host
    assert q.values.is_cuda and q.values.device == x.device and q.values.dtype == torch.uint8
    assert tuple(q.values.shape) == cpu.values.shape and tuple(q.scales.shape) == cpu.scales.shape
    assert _bytes(q.values) == cpu.values.tobytes() and _bytes(q.scales) == cpu.scales.tobytes()
    if layout is None:
        want_v, want_s = _expected(case)
        assert _bytes(q.values) == want_v.tobytes() and _bytes(q.scales) == want_s.tobytes()
    # out=: written in place, addresses kept.
    out = (torch.full(cpu.values.shape, 0xEE, dtype=torch.uint8, device="cuda"),
           torch.full(cpu.scales.shape, 0xEE, dtype=torch.uint8, device="cuda"))
    ptrs = [t.data_ptr() for t in out]
    r = wprep.quantize_mxfp4(x, layout=layout, scale_rounding=_rounding(case), out=out, client=gpu_client)
    assert r.values is out[0] and r.scales is out[1] and [t.data_ptr() for t in out] == ptrs
    assert _bytes(out[0]) == cpu.values.tobytes() and _bytes(out[1]) == cpu.scales.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_cuda_float16_and_float32_equal_the_cpu_engine(client, gpu_client, dtype):
    torch = torch_cuda()
    x = _random(np.random.default_rng(3), (3, 130, 96), dtype)
    cpu = wprep.quantize_mxfp4(x, layout="blackwell_value", client=client)
    q = wprep.quantize_mxfp4(torch.from_numpy(x).cuda(), layout="blackwell_value", client=gpu_client)
    assert _bytes(q.values) == cpu.values.tobytes() and _bytes(q.scales) == cpu.scales.tobytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_hopper_pair_in_place_equals_the_cpu_engine(client, gpu_client, dtype):
    torch = torch_cuda()
    rng = np.random.default_rng(11)
    for shape, params in (((3, 300, 200), (3, 8, 2)), ((2, 130, 96), (2, 4, 4)), ((1, 513, 5760), (3, 16, 64))):
        x = _random(rng, shape, dtype)
        kw = dict(layout="hopper_value", mma_version=params[0], num_warps=params[1], align_k=params[2])
        cpu = wprep.quantize_mxfp4(x, client=client, **kw)
        xc = _cuda_bf16(torch, x) if dtype == "bfloat16" else torch.from_numpy(x).cuda()
        q = wprep.quantize_mxfp4(xc, client=gpu_client, **kw)
        assert q.engine.startswith("cuda:"), q.engine
        assert tuple(q.values.shape) == cpu.values.shape and tuple(q.scales.shape) == cpu.scales.shape
        assert q.values.stride() == cpu.values.strides and q.scales.stride() == cpu.scales.strides
        assert _bytes(q.values) == cpu.values.tobytes() and _bytes(q.scales) == cpu.scales.tobytes()
        # out= is the layouts' row-major memory; the answer views it, addresses kept.
        mem = output_shapes(shape, "hopper_value", params[1], params[2])
        out = tuple(torch.full(m, 0xEE, dtype=torch.uint8, device="cuda") for m in mem)
        r = wprep.quantize_mxfp4(xc, out=out, client=gpu_client, **kw)
        assert [t.data_ptr() for t in (r.values, r.scales)] == [t.data_ptr() for t in out]
        assert _bytes(r.values) == cpu.values.tobytes() and _bytes(r.scales) == cpu.scales.tobytes()


@pytest.mark.parametrize("layout,shape,align,bias_dtype", TRTLLM_CASES)
def test_gpu_trtllm_in_place_equals_the_cpu_engine(client, gpu_client, layout, shape, align, bias_dtype):
    torch = torch_cuda()
    rng = np.random.default_rng(sum(shape))
    x = _random(rng, shape, "bfloat16")
    bias = _bias(rng, shape, bias_dtype) if bias_dtype else None
    cpu = wprep.quantize_mxfp4(x, layout=layout, align=align, bias=bias, client=client)
    bc = None
    if bias is not None:
        bc = _cuda_bf16(torch, bias) if bias_dtype == "bfloat16" else torch.from_numpy(bias).cuda()
    q = wprep.quantize_mxfp4(_cuda_bf16(torch, x), layout=layout, align=align, bias=bc, client=gpu_client)
    assert q.engine.startswith("cuda:"), q.engine
    assert _bytes(q.values) == cpu.values.tobytes() and _bytes(q.scales) == cpu.scales.tobytes()
    if bias is not None:
        assert q.bias.dtype == torch.float32 and _bytes(q.bias) == cpu.bias.tobytes()
    # out=: the loader's parameters, written in place.
    out = [torch.full(cpu.values.shape, 0xEE, dtype=torch.uint8, device="cuda"),
           torch.full(cpu.scales.shape, 0xEE, dtype=torch.uint8, device="cuda")]
    if bias is not None:
        out.append(torch.full(cpu.bias.shape, 7.0, dtype=torch.float32, device="cuda"))
    ptrs = [t.data_ptr() for t in out]
    r = wprep.quantize_mxfp4(_cuda_bf16(torch, x), layout=layout, align=align, bias=bc, out=out, client=gpu_client)
    assert [t.data_ptr() for t in out] == ptrs and r.values is out[0]
    assert _bytes(out[0]) == cpu.values.tobytes() and _bytes(out[1]) == cpu.scales.tobytes()
    if bias is not None:
        assert _bytes(out[2]) == cpu.bias.tobytes()


def test_gpu_cuda_bad_inputs_are_refused(gpu_client):
    torch = torch_cuda()
    x = torch.zeros((64, 64), dtype=torch.bfloat16, device="cuda")
    assert "dtype" in _invalid(lambda: wprep.quantize_mxfp4(x.to(torch.float64), client=gpu_client))
    assert "contiguous" in _invalid(lambda: wprep.quantize_mxfp4(x.t(), client=gpu_client))
    short = (torch.zeros((64, 32), dtype=torch.uint8, device="cuda"), torch.zeros(1, dtype=torch.uint8, device="cuda"))
    assert "out scales" in _invalid(lambda: wprep.quantize_mxfp4(x, out=short, client=gpu_client))
    host = (np.zeros((64, 32), np.uint8), np.zeros((64, 2), np.uint8))
    assert "CUDA tensor" in _invalid(lambda: wprep.quantize_mxfp4(x, out=host, client=gpu_client))
    with pytest.raises(WprepError) as e:
        wprep.quantize_mxfp4(x, completion="stream", client=gpu_client)
    assert e.value.code == grpc.StatusCode.UNIMPLEMENTED


# -- the CUDA request, against a stand-in for torch (machines without a GPU) -------------------


class _DType:
    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __repr__(self):
        return f"torch.{self.name}"


class _Device:
    type = "cuda"

    def __init__(self, index):
        self.index = index

    def __eq__(self, other):
        return isinstance(other, _Device) and other.index == self.index

    def __repr__(self):
        return f"cuda:{self.index}"


def _fake_torch(rec):
    """What quantize_mxfp4 uses of torch: dtypes, contiguous views, byte views, _share_cuda_'s
    8-tuple (version byte + b"c" + the 64-byte handle, the storage's offset in its block)."""
    import types

    torch = types.ModuleType("torch")
    dtypes = {n: _DType(n, s) for n, s in (("bfloat16", 2), ("float16", 2), ("float32", 4), ("float64", 8),
                                            ("uint8", 1))}

    class Storage:
        def __init__(self, base, block_offset, nbytes):
            self.base, self.block_offset, self._nbytes = base, block_offset, nbytes

        def data_ptr(self):
            return self.base + self.block_offset

        def nbytes(self):
            return self._nbytes

        def _share_cuda_(self):
            rec["shared"] += 1
            handle = b"\x02c" + self.base.to_bytes(8, "little") * 8
            return (0, handle, self._nbytes, self.block_offset, b"/refs", rec["shared"], b"\0" * 64, True)

    class Tensor:
        is_cuda = True

        def __init__(self, storage, shape, strides, offset, dtype, device=0):
            self._storage, self.shape, self._strides = storage, tuple(shape), tuple(strides)
            self._offset, self.dtype, self.device = offset, dtype, _Device(device)

        def stride(self):
            return self._strides

        def storage_offset(self):
            return self._offset

        def untyped_storage(self):
            return self._storage

        def element_size(self):
            return self.dtype.itemsize

        def numel(self):
            return int(np.prod(self.shape, dtype=np.int64))

        def is_contiguous(self):
            return self._strides == tuple(np.cumprod((1, *self.shape[:0:-1]))[::-1].tolist())

        def detach(self):
            return self

        def reshape(self, *shape):
            assert shape == (-1,) and self.is_contiguous()
            return Tensor(self._storage, (self.numel(),), (1,), self._offset, self.dtype, self.device.index)

        def view(self, dtype):
            assert len(self.shape) == 1 and self.dtype.itemsize % dtype.itemsize == 0
            r = self.dtype.itemsize // dtype.itemsize
            return Tensor(self._storage, (self.numel() * r,), (1,), self._offset * r, dtype, self.device.index)

        def t(self):
            return Tensor(self._storage, self.shape[::-1], self._strides[::-1], self._offset, self.dtype,
                          self.device.index)

    class UntypedStorage:
        @staticmethod
        def _release_ipc_counter_cuda(handle, offset):
            rec["released"] += 1

    bases = [1 << 40]

    def empty(shape, dtype=None, device=None):
        bases[0] += 1 << 30
        n = int(np.prod(shape, dtype=np.int64))
        rec["allocated"].append((tuple(shape), dtype))
        strides = tuple(np.cumprod((1, *shape[:0:-1]))[::-1].tolist()) if shape else ()
        return Tensor(Storage(bases[0], 0, n), shape, strides, 0, dtype, device.index)

    class Stream:
        def __init__(self, d):
            self.d = d

        def synchronize(self):
            rec["synced"].append(self.d)

    torch.Tensor, torch.UntypedStorage, torch.empty, torch.__version__ = Tensor, UntypedStorage, empty, "fake"
    torch.cuda = types.SimpleNamespace(
        current_stream=Stream,
        get_device_properties=lambda i: types.SimpleNamespace(uuid=types.SimpleNamespace(bytes=[i] * 16)))
    torch.Storage = Storage
    for n, d in dtypes.items():
        setattr(torch, n, d)
    return torch


@pytest.fixture
def fake_torch(monkeypatch):
    import sys

    from wprep import _torch

    rec = {"shared": 0, "released": 0, "synced": [], "allocated": []}
    torch = _fake_torch(rec)
    monkeypatch.setitem(sys.modules, "torch", torch)
    _torch.device_uuid.cache_clear()
    yield torch, rec
    _torch.device_uuid.cache_clear()


class _Recording:
    """A client that records the request and answers as a GPU daemon would."""

    def __init__(self):
        import wprep._torch as t

        self._registry = t.Registry()
        self.requests = []

    def _unary(self, method, req, timeout):
        self.requests.append((method, req))
        q = req.items[0].quantize
        shapes = output_shapes(q.shape, "blackwell_value" if q.layout == pb.QUANTIZE_LAYOUT_BLACKWELL else None)
        resp = pb.ConvertBatchResponse()
        item = resp.items.add(engine="cuda:GPU-fake", kernel_seconds=0.5)
        for name, shape in zip(("values", "scales"), shapes):
            item.outputs.add(name=name, shape=shape, bytes=int(np.prod(shape, dtype=np.int64)))
        return resp


def _fake_x(torch, shape=(2, 64, 96), dtype="bfloat16", block_offset=4096, offset=10):
    dt = getattr(torch, dtype)
    n = int(np.prod(shape))
    storage = torch.Storage(1 << 36, block_offset, (n + offset) * dt.itemsize)
    strides = tuple(np.cumprod((1, *shape[:0:-1]))[::-1].tolist())
    return torch.Tensor(storage, shape, strides, offset, dt)


@pytest.mark.parametrize("layout", [None, "blackwell_value"])
def test_a_cuda_tensor_goes_by_ipc_with_outputs_allocated_on_its_gpu(fake_torch, layout):
    torch, rec = fake_torch
    x = _fake_x(torch)
    c = _Recording()
    q = wprep.quantize_mxfp4(x, layout=layout, scale_rounding="down", client=c)
    (method, req), = c.requests
    assert method == "ConvertBatch" and len(req.items) == 1 and not req.HasField("wait_for")
    item = req.items[0].quantize
    assert item.dtype == pb.QUANTIZE_DTYPE_BFLOAT16 and list(item.shape) == [2, 64, 96]
    assert item.scale_rounding == pb.SCALE_ROUNDING_DOWN
    assert item.layout == (pb.QUANTIZE_LAYOUT_BLACKWELL if layout else pb.QUANTIZE_LAYOUT_CANONICAL)
    # The source: its block's handle, at the block offset plus the view's offset in bytes.
    src = item.source.ipc
    assert len(src.handle) == 64 and src.offset == 4096 + 10 * 2 and src.size == 2 * 64 * 96 * 2
    assert src.device_uuid == bytes(16) and not src.strides
    vshape, sshape = output_shapes((2, 64, 96), layout)
    assert rec["allocated"] == [(vshape, torch.uint8), (sshape, torch.uint8)]
    assert item.values.ipc.size == np.prod(vshape) and item.scales.ipc.size == np.prod(sshape)
    assert item.values.ipc.handle != src.handle != item.scales.ipc.handle
    # Exported once each, their ref counters released; the stream synchronized before sending.
    assert rec["shared"] == 3 and rec["released"] == 3 and rec["synced"] == [0]
    assert tuple(q.values.shape) == vshape and tuple(q.scales.shape) == sshape and q.engine == "cuda:GPU-fake"


def test_cuda_out_is_written_in_place(fake_torch):
    torch, rec = fake_torch
    x = _fake_x(torch, (4, 64), "float32")
    out = (torch.empty((4, 32), dtype=torch.uint8, device=_Device(0)),
           torch.empty((8,), dtype=torch.uint8, device=_Device(0)))  # any shape of the right bytes
    rec["allocated"].clear()
    c = _Recording()
    q = wprep.quantize_mxfp4(x, out=out, client=c)
    assert q.values is out[0] and q.scales is out[1] and rec["allocated"] == []
    item = c.requests[0][1].items[0].quantize
    assert item.dtype == pb.QUANTIZE_DTYPE_FLOAT32 and item.values.ipc.size == 128 and item.scales.ipc.size == 8


def test_cuda_bad_inputs_are_refused_before_any_export(fake_torch):
    torch, rec = fake_torch
    c = _Recording()
    x = _fake_x(torch, (64, 64))
    assert "dtype" in _invalid(lambda: wprep.quantize_mxfp4(_fake_x(torch, (4, 64), "float64"), client=c))
    assert "contiguous" in _invalid(lambda: wprep.quantize_mxfp4(x.t(), client=c))
    other = (torch.empty((64, 32), dtype=torch.uint8, device=_Device(1)),
             torch.empty((64, 2), dtype=torch.uint8, device=_Device(1)))
    assert "share a GPU" in _invalid(lambda: wprep.quantize_mxfp4(x, out=other, client=c))
    short = (torch.empty((64, 32), dtype=torch.uint8, device=_Device(0)),
             torch.empty((64, 1), dtype=torch.uint8, device=_Device(0)))
    assert "out scales" in _invalid(lambda: wprep.quantize_mxfp4(x, out=short, client=c))
    wide = (torch.empty((64, 32), dtype=torch.uint8, device=_Device(0)),
            torch.empty((64, 1), dtype=torch.bfloat16, device=_Device(0)))
    assert "one-byte" in _invalid(lambda: wprep.quantize_mxfp4(x, out=wide, client=c))
    host = (np.zeros((64, 32), np.uint8), np.zeros((64, 2), np.uint8))
    assert "CUDA tensor" in _invalid(lambda: wprep.quantize_mxfp4(x, out=host, client=c))
    assert "even K" in _invalid(lambda: wprep.quantize_mxfp4(_fake_x(torch, (4, 33)), layout="blackwell_value",
                                                            client=c))
    with pytest.raises(WprepError) as e:
        wprep.quantize_mxfp4(x, completion="async", client=c)
    assert e.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert rec["shared"] == 0 and rec["synced"] == [] and c.requests == []


def test_the_cpu_daemon_takes_the_ipc_request_up_to_finding_the_gpu(fake_torch, client):
    # The request is well formed for the daemon (handles, sizes, one GPU, no overlap): the
    # CPU-only daemon refuses it only where it looks for the source's GPU.
    torch, _ = fake_torch
    with pytest.raises(WprepError) as e:
        wprep.quantize_mxfp4(_fake_x(torch), layout="blackwell_value", client=client)
    assert e.value.details.startswith("items[0].quantize.source.ipc.device_uuid"), e.value
