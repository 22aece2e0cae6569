"""wprep.trtllm against the CPU daemon (numpy, inline bytes): every trtllm-gen reference
case byte for byte, out= in place, one-round-trip layers and the errors; and, with torch and
a GPU (skipped otherwise), CUDA tensors in place through IPC on a GPU daemon: data_ptr()
kept, bytes equal the CPU engine's and the reference."""

import json

import grpc
import numpy as np
import pytest

import wprep.trtllm as tg
from wprep import WprepError

from conftest import torch_cuda
from golden import data_dir, sha256, splitmix64_bytes

_NP = {"uint8": np.uint8, "float32": np.float32, "bfloat16": np.uint16}


def _cases():
    out = []
    for set_name in ("golden_trtllm", "golden_trtllm_formats"):
        m = json.loads((data_dir() / set_name / "manifest.json").read_text())
        out += m["cases"]
    return out


CASES = _cases()
GOOD = [c for c in CASES if "error" not in c]
BAD = [c for c in CASES if "error" in c]


def _inputs(c):
    arrs = {}
    for t in c["inputs"]:
        if "splitmix64_seed" in t:
            data = splitmix64_bytes(t["splitmix64_seed"], t["bytes"])
            assert sha256(data) == t["sha256"], "the input generator disagrees with the manifest"
            arrs[t["name"]] = np.frombuffer(data, dtype=_NP[t["dtype"]]).reshape(t["shape"])
        else:
            arrs[t["name"]] = np.zeros(t["shape"], dtype=_NP[t["dtype"]])
    return arrs


def _run(c, client, out=None):
    x = _inputs(c)
    p = dict(c["params"])
    if c["op"] == "prepare_w13":
        return tg.prepare_w13(x["values"], x.get("scales"), x.get("bias"), out=out, client=client, **p)
    if c["op"] == "prepare_w2":
        return tg.prepare_w2(x["values"], x.get("scales"), x.get("bias"), out=out, client=client, **p)
    return tg.run_op(c["op"], x["x"], out=None if out is None else out[0], client=client, **p)


def test_counts():
    assert (len(GOOD), len(BAD)) == (54, 27)


@pytest.mark.parametrize("case", GOOD, ids=[c["name"] for c in GOOD])
def test_reference_case(client, case):
    r = _run(case, client)
    assert list(r.outputs) == [o["name"] for o in case["outputs"]]
    for o in case["outputs"]:
        got = r.outputs[o["name"]]
        assert got.dtype == _NP[o["dtype"]] and list(got.shape) == o["shape"]
        assert sha256(got.tobytes()) == o["sha256"], o["name"]
    assert r.identity.op == case["op"] and r.identity.contract_version == tg.CONTRACT_VERSION
    if case["op"].startswith("prepare_"):
        assert r.identity.format == case["params"].get("format", "mxfp4")
    for k, v in case["params"].items():
        assert r.identity.params[k] == v, k


@pytest.mark.parametrize("case", BAD, ids=[c["name"] for c in BAD])
def test_reference_error_case(client, case):
    with pytest.raises(WprepError) as e:
        _run(case, client)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details.startswith("items[0].moe"), e.value.details


def test_out_writes_in_place_and_keeps_addresses(client):
    case = next(c for c in GOOD if c["name"] == "prepare_w13_e2_i96_h160")
    out = [np.full(o["shape"], 0xEE, dtype=_NP[o["dtype"]]) for o in case["outputs"]]
    addresses = [a.ctypes.data for a in out]
    r = _run(case, client, out=out)
    for a, addr, o in zip(out, addresses, case["outputs"]):
        assert a.ctypes.data == addr
        assert sha256(a.tobytes()) == o["sha256"], o["name"]
        assert r.outputs[o["name"]] is a


def test_out_of_the_wrong_size_writes_nothing(client):
    case = next(c for c in GOOD if c["name"] == "prepare_w13_e2_i96_h160")
    out = [np.zeros(o["shape"], dtype=_NP[o["dtype"]]) for o in case["outputs"]]
    out[2] = np.zeros(7, dtype=np.float32)
    with pytest.raises(WprepError) as e:
        _run(case, client, out=out)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "bias" in e.value.details
    assert not out[0].any() and not out[1].any()


def test_prepare_layer_is_w13_and_w2_in_one_batch(client):
    c13 = next(c for c in GOOD if c["name"] == "prepare_w13_nvfp4_e2_i48_h160_pad")
    c2 = next(c for c in GOOD if c["name"] == "prepare_w2_nvfp4_e2_h160_i48_pad")
    x13, x2 = _inputs(c13), _inputs(c2)
    p = {k: v for k, v in c13["params"].items() if k != "gated"}
    r13, r2 = tg.prepare_layer((x13["values"], x13["scales"]), (x2["values"], x2["scales"]), gated=True,
                               client=client, **p)
    for r, c in ((r13, c13), (r2, c2)):
        for o in c["outputs"]:
            assert sha256(r.outputs[o["name"]].tobytes()) == o["sha256"], (c["name"], o["name"])
    # One bad half: the whole layer is rejected, naming the item.
    with pytest.raises(WprepError) as e:
        tg.prepare_layer((x13["values"], x13["scales"]), (x2["values"], x2["scales"][:, :, :2]), gated=True,
                         client=client, **p)
    assert e.value.details.startswith("items[1].moe.scales"), e.value.details


def test_prepare_layers_is_every_layer_in_one_batch(client):
    c13 = next(c for c in GOOD if c["name"] == "prepare_w13_nvfp4_e2_i48_h160_pad")
    c2 = next(c for c in GOOD if c["name"] == "prepare_w2_nvfp4_e2_h160_i48_pad")
    x13, x2 = _inputs(c13), _inputs(c2)
    p = {k: v for k, v in c13["params"].items() if k != "gated"}
    layer = ((x13["values"], x13["scales"]), (x2["values"], x2["scales"]))
    results = tg.prepare_layers([layer, layer, layer], gated=True, client=client, **p)
    assert len(results) == 3
    for r13, r2 in results:
        for r, c in ((r13, c13), (r2, c2)):
            for o in c["outputs"]:
                assert sha256(r.outputs[o["name"]].tobytes()) == o["sha256"], (c["name"], o["name"])
    # A bad w2 in the third layer rejects the whole batch, naming its item (the sixth).
    bad = ((x13["values"], x13["scales"]), (x2["values"], x2["scales"][:, :, :2]))
    with pytest.raises(WprepError) as e:
        tg.prepare_layers([layer, layer, bad], gated=True, client=client, **p)
    assert e.value.details.startswith("items[5].moe.scales"), e.value.details
    with pytest.raises(WprepError):
        tg.prepare_layers([layer, layer], out=[(None, None)], gated=True, client=client, **p)


def test_unknown_param_is_refused_before_sending(client):
    with pytest.raises(WprepError) as e:
        tg.run_op("row_shuffle", np.zeros((1, 64, 4), np.uint8), tile=128, client=client)
    assert "tile" in e.value.details




@pytest.fixture(scope="module")
def gpu_client():
    """A daemon serving the GPUs (the session's `client` is pinned to the CPU engine)."""
    torch_cuda()
    from conftest import wprepd_path
    from wprep import Client
    from wprep.testing import LocalDaemon

    with LocalDaemon(wprepd_path(), []) as d:
        with Client(d.target, timeout=120) as c:
            yield c


def _cuda(torch, a):
    a = np.ascontiguousarray(a).copy()
    if a.dtype == np.uint16:  # bfloat16 bits: int16 has the same bytes, and every torch has it
        return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(a).cuda()


@pytest.mark.parametrize("name", ["prepare_w13_e2_i96_h160", "prepare_w2_nvfp4_e2_h160_i48_pad",
                                  "prepare_w13_bf16_e2_i32_h64", "row_shuffle_t128_3x96x40"])
def test_cuda_out_is_written_in_place_by_ipc_and_equals_the_cpu_engine(client, gpu_client, name):
    torch = torch_cuda()
    case = next(c for c in GOOD if c["name"] == name)
    x = _inputs(case)
    cpu = _run(case, client)
    dt = {"uint8": torch.uint8, "float32": torch.float32, "bfloat16": torch.bfloat16}
    out = [torch.full(o["shape"], 0, dtype=dt[o["dtype"]], device="cuda") for o in case["outputs"]]
    ptrs = [t.data_ptr() for t in out]
    ins = {k: _cuda(torch, v) for k, v in x.items()}
    p = dict(case["params"])
    if case["op"] == "prepare_w13":
        r = tg.prepare_w13(ins["values"], ins.get("scales"), ins.get("bias"), out=out, client=gpu_client, **p)
    elif case["op"] == "prepare_w2":
        r = tg.prepare_w2(ins["values"], ins.get("scales"), ins.get("bias"), out=out, client=gpu_client, **p)
    else:
        r = tg.run_op(case["op"], ins["x"], out=out[0], client=gpu_client, **p)
    assert r.engine.startswith("cuda:"), r.engine  # in place on the GPU, not through the host
    for t, ptr, o in zip(out, ptrs, case["outputs"]):
        assert t.data_ptr() == ptr
        got = t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert got == cpu.outputs[o["name"]].tobytes(), o["name"]
        assert sha256(got) == o["sha256"], o["name"]
