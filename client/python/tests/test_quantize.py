"""wprep.quantize_mxfp4 against a real wprepd on the CPU engine (numpy, inline bytes): every
case of tests/data/golden_quant byte for byte, the fused Blackwell layout equal to quantize
then the two swizzles (the daemon's convert) and to the CLI's in-process engine
(`wprep quantize --local`), float16 and float32 inputs, out= in place, and the errors; and,
with torch and a GPU (skipped otherwise), CUDA tensors quantized in place through IPC on a GPU
daemon, bytes equal to the CPU engine's."""

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
    assert q.values.tobytes() == (tmp_path / "v").read_bytes()
    assert q.scales.tobytes() == (tmp_path / "s").read_bytes()
    assert (q.values.shape, q.scales.shape) == output_shapes(shape, layout)


@pytest.mark.parametrize("layout", [None, "blackwell_value"])
def test_the_clients_output_shapes_are_the_daemons(client, layout):
    # A CUDA caller's outputs are allocated from output_shapes before the call: it must give
    # what the daemon answers, ragged and empty shapes included (the call checks the answer too).
    rng = np.random.default_rng(7)
    shapes = [(1, 2), (3, 0), (0, 64), (2, 0, 64), (4, 34), (129, 66), (2, 1, 9, 258)]
    if layout is None:
        shapes += [(0,), (1,), (31,), (33,), (2, 3, 65)]
    for shape in shapes:
        q = wprep.quantize_mxfp4(rng.standard_normal(shape).astype(np.float16), layout=layout, client=client)
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
    assert "layout" in _invalid(lambda: wprep.quantize_mxfp4(x, layout="hopper_value", client=client))
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


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch finds no CUDA device")
    return torch


@pytest.fixture(scope="module")
def gpu_client():
    """A daemon serving the GPUs (the session's `client` is pinned to the CPU engine). The tests
    that use it have "gpu" in their names, for `pytest -k gpu` on a GPU machine."""
    _torch_cuda()
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


@pytest.mark.parametrize("layout", [None, "blackwell_value"])
@pytest.mark.parametrize("case", CASES[::3], ids=[c["name"] for c in CASES[::3]])
def test_gpu_cuda_tensors_are_quantized_in_place_and_equal_the_cpu_engine(client, gpu_client, case, layout):
    torch = _torch_cuda()
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
    torch = _torch_cuda()
    x = _random(np.random.default_rng(3), (3, 130, 96), dtype)
    cpu = wprep.quantize_mxfp4(x, layout="blackwell_value", client=client)
    q = wprep.quantize_mxfp4(torch.from_numpy(x).cuda(), layout="blackwell_value", client=gpu_client)
    assert _bytes(q.values) == cpu.values.tobytes() and _bytes(q.scales) == cpu.scales.tobytes()


def test_gpu_cuda_bad_inputs_are_refused(gpu_client):
    torch = _torch_cuda()
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
