"""Resident weight sets from Python (wprep.weights) against a real wprepd on the CPU engine,
started with --weights-root and --weights-shm-dir in a temporary folder: a checkpoint written
here by hand whose converted tensors are reference vectors (tests/data/golden*), loaded with
rules, listed, attached (zero-copy read-only views) and compared with the vectors' expected
bytes and with `convert` of the same bytes, detached and dropped; refusals; a forced drop; a
killed client's attachment ending."""

import gc
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import golden
from conftest import torch_cuda
import wprep
import wprep.weights
from wprep import Client, Spec, WprepError
from wprep.testing import LocalDaemon

PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


def _reference_cases():
    """One swizzle case per (vector set, layout): dense inputs, non-empty, small."""
    seen, out = set(), []
    for c in golden.all_cases():
        key = (c.set, c.spec.layout)
        dense = not c.input_strides or c.input_strides == golden._row_major(c.input_shape)
        if (c.error or c.spec.direction != wprep.Direction.SWIZZLE or not dense or not c.input_bytes
                or c.input_bytes > 64 << 10 or key in seen):
            continue
        seen.add(key)
        out.append(c)
    return out


CASES = _reference_cases()


def _rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# The checkpoint: each reference case's input as "ref.<i>.w" (U8, its storage shape), a U8
# tensor a verbatim rule shields from the "ref.*" rules, and a BF16 tensor no rule matches.
TENSORS = [(f"ref.{i}.w", "U8", c.input_shape, golden.golden_input(c)) for i, c in enumerate(CASES)] + [
    ("ref.shielded", "U8", (64, 32), _rand(64 * 32, 1)),
    ("embed.weight", "BF16", (16, 8), _rand(16 * 8 * 2, 2)),
]
RULES = [("ref.shielded", "verbatim")] + [(f"ref.{i}.w", c.spec) for i, c in enumerate(CASES)]


def write_safetensors(path, tensors):
    """The format by hand (8-byte little-endian header length, JSON, data); returns the header
    bytes (length word and JSON) for the checksum."""
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    js = json.dumps(header).encode()
    js += b" " * (-len(js) % 8)
    head = struct.pack("<Q", len(js)) + js
    Path(path).write_bytes(head + data)
    return head


@pytest.fixture(scope="module")
def wdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    (d / "root").mkdir()
    (d / "shm").mkdir()
    (d / "outside").mkdir()
    return d


def _start(wdir, *extra):
    from conftest import wprepd_path
    return LocalDaemon(wprepd_path(), ["--devices=cpu", "--cpu-threads=2", f"--weights-root={wdir / 'root'}",
                                       f"--weights-shm-dir={wdir / 'shm'}", *extra])


@pytest.fixture(scope="module")
def wdaemon(wdir):
    with _start(wdir) as d:
        yield d


@pytest.fixture(scope="module")
def wclient(wdaemon):
    with Client(wdaemon.target, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def checkpoint(wdir):
    return write_safetensors(wdir / "root" / "model.safetensors", TENSORS)


@pytest.fixture
def loaded(wclient, checkpoint):
    """A set loaded with RULES, dropped (forced) after the test."""
    names = []

    def load(name, progress=None):
        r = wclient.load_weights(name, "model.safetensors", rules=RULES, progress=progress)
        names.append(name)
        return r

    yield load
    for n in names:
        try:
            wclient.drop_weights(n, force=True)
        except WprepError as e:
            assert e.code == grpc.StatusCode.NOT_FOUND


def _file_bytes(path, offset, n):
    """The set's bytes read from its file directly, not through the attachment."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def _attachments(c, name):
    s = c.list_weights().get(name)
    return None if s is None else s.attachments


def _wait_attachments(c, name, n, limit_s=30.0):
    """Polls (bounded) until set `name` has `n` attachments; the daemon notices a dead
    connection on its own schedule."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if _attachments(c, name) == n:
            return True
        time.sleep(0.02)
    return False


def test_there_are_reference_cases_of_every_kind():
    layouts = {c.spec.layout for c in CASES}
    assert {wprep.Layout.HOPPER_VALUE, wprep.Layout.BLACKWELL_SHUFFLED_VALUE} <= layouts
    assert any(c.spec.packing_axis == -2 for c in CASES), "no checkpoint-order (packing -2) case"
    assert any(not wprep.Layout(c.spec.layout).value.endswith("_value") for c in CASES), "no scale case"


def test_load_list_attach_compare_detach_drop(wclient, loaded, checkpoint):
    seen = []
    r = loaded("set1", progress=seen.append)
    # Progress: from nothing to everything, never backwards.
    assert seen[0].tensors_done == 0 and seen[0].tensors_total == len(TENSORS)
    assert seen[-1].tensors_done == len(TENSORS) and seen[-1].bytes_done == seen[-1].bytes_total
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(seen, seen[1:]))
    m = r.manifest
    assert (m.name, m.path, m.device_uuid) == ("set1", "model.safetensors", b"")
    assert m.source_checksum == hashlib.sha256(hashlib.sha256(checkpoint).digest()).digest()
    assert r.load_seconds >= 0
    assert [t.name for t in m.tensors] == [t[0] for t in TENSORS]

    sets = wclient.list_weights()
    info = sets.get("set1")
    assert info is not None and info.attachments == 0 and info.manifest.tensors == ()
    assert sets.resident_bytes >= m.total_bytes and sets.budget_bytes == 0
    assert wclient.list_weights(with_tensors=True).get("set1").manifest == m

    with wclient.attach_weights("set1") as w:
        assert w.alive and w.manifest == m and len(w) == len(TENSORS)
        assert os.path.dirname(w.shm_path).endswith("shm")
        assert _attachments(wclient, "set1") == 1
        _check_every_tensor(wclient, w)
        # Attached: a plain drop is refused and changes nothing.
        with pytest.raises(WprepError) as e:
            wclient.drop_weights("set1")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        kept = w["embed.weight"]
    # close() detaches before it returns: the count is 0 now, and a plain drop succeeds.
    assert not w.alive
    assert _attachments(wclient, "set1") == 0
    assert len(w) == 0
    with pytest.raises(ValueError, match="closed"):
        w["embed.weight"]
    # A view taken before the close still reads the set's bytes (it holds the mapping).
    assert kept.tobytes() == TENSORS[-1][3]
    assert wclient.drop_weights("set1") == m.total_bytes
    assert wclient.list_weights().get("set1") is None
    assert not os.path.exists(w.shm_path)
    assert kept.tobytes() == TENSORS[-1][3], "a dropped set's mapping stays valid"
    with pytest.raises(WprepError) as e:
        wclient.drop_weights("set1")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def _check_every_tensor(c, w):
    base = np.frombuffer(w._buffer, dtype=np.uint8).ctypes.data  # where the mapping starts
    for i, case in enumerate(CASES):
        name = f"ref.{i}.w"
        t = w.entry(name)
        a = w[name]
        # The reference vectors' bytes, read from the file, and `convert` of the same input.
        raw = _file_bytes(w.shm_path, t.offset, t.bytes)
        assert golden.matches(case, raw), f"{name} ({case.name}): bytes differ from the reference vector"
        ref = c.convert(case.spec, case.logical_shape, golden.golden_input(case))
        assert raw == ref.data, f"{name} ({case.name}): bytes differ from convert"
        plan = c.plan(case.spec, case.logical_shape)
        assert (t.dtype, t.shape, t.strides) == ("U8", plan.output_shape, plan.output_strides)
        assert t.bytes == plan.output_bytes
        assert t.shape == case.output_shape
        assert t.identity is not None and t.identity == plan.identity == w.identity(name)
        assert t.identity.layout == golden.expected_identity(case) and t.identity.contract_version == 1
        assert t.rule == 1 + i and t.offset % 256 == 0
        # The view: the manifest's shape and strides over the set's memory, where it lies.
        assert a.dtype == np.uint8 and a.shape == t.shape and a.strides == t.strides
        assert not a.flags.writeable
        assert a.__array_interface__["data"][0] == base + t.offset, "not a view of the mapping"
        want = np.ndarray(t.shape, np.uint8, buffer=raw, strides=t.strides)
        assert np.array_equal(a, want)
    for name, dtype, shape, raw in TENSORS[len(CASES):]:
        t = w.entry(name)
        a = w[name]
        assert (t.dtype, t.shape, t.identity) == (dtype, shape, None)
        assert t.rule == (0 if name == "ref.shielded" else -1)
        assert a.shape == shape and a.dtype.itemsize == (2 if dtype == "BF16" else 1)
        assert a.__array_interface__["data"][0] == base + t.offset and not a.flags.writeable
        assert a.tobytes() == raw, f"{name}: a copied tensor differs from the file"
        assert _file_bytes(w.shm_path, t.offset, t.bytes) == raw


def test_two_attachments_share_the_set_and_torch_views(wclient, loaded):
    loaded("set2")
    a = wprep.weights.attach("set2", client=wclient)
    b = wclient.attach_weights("set2")
    try:
        assert a.attachment_id != b.attachment_id
        assert _attachments(wclient, "set2") == 2
        for name in a:
            assert np.array_equal(a[name], b[name])
        try:
            import torch  # noqa: F401
        except ImportError:
            with pytest.raises(ImportError, match="torch"):
                a.torch_tensors()
        else:
            tt = a.torch_tensors()
            for name, t in tt.items():
                e = a.entry(name)
                assert tuple(t.shape) == e.shape and tuple(t.stride()) == e.strides and t.device.type == "cpu"
                assert t.data_ptr() == a[name].__array_interface__["data"][0], f"{name}: torch copied"
            assert tt["embed.weight"].dtype == torch.bfloat16
            del tt, t  # views that would keep the mapping
    finally:
        a.close()
        assert _attachments(wclient, "set2") == 1
        b.close()
        b.close()  # idempotent
    assert _attachments(wclient, "set2") == 0
    # Closed, with no view left: the file is no longer mapped.
    path = a.shm_path
    del a, b
    gc.collect()
    assert not _mapped(path), "closed attachments left the set mapped"


def _mapped(path):
    with open("/proc/self/maps") as f:
        return any(line.rstrip().split(" ", 5)[-1].strip().startswith(path) for line in f)


def test_views_keep_the_mapping_until_the_last_goes(wclient, loaded):
    loaded("set5")
    w = wclient.attach_weights("set5")
    assert _mapped(w.shm_path)
    kept = w["embed.weight"]
    w.close()
    assert _mapped(w.shm_path), "a live view lost its mapping"
    assert kept.tobytes() == TENSORS[-1][3]
    del kept
    gc.collect()
    assert not _mapped(w.shm_path)


def test_forced_drop_ends_the_attachment_and_keeps_the_views(wclient, loaded):
    loaded("set3")
    w = wclient.attach_weights("set3")
    view = w["embed.weight"]
    with pytest.raises(WprepError) as e:
        wclient.drop_weights("set3")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert wclient.drop_weights("set3", force=True) > 0
    end = time.monotonic() + 30
    while w.alive and time.monotonic() < end:
        time.sleep(0.01)
    assert not w.alive, "a forced drop left the attachment open"
    assert view.tobytes() == TENSORS[-1][3]
    w.close()  # its stream already ended ABORTED: nothing to detach, no error


def test_refusals_are_wprep_errors_and_the_daemon_serves_on(wclient, wdir, checkpoint):
    def refused(code, fn, *names):
        with pytest.raises(WprepError) as e:
            fn()
        assert e.value.code == code, e.value
        for n in names:
            assert n in e.value.details, e.value
        assert wclient.health() == "SERVING"

    root = wdir / "root"
    write_safetensors(wdir / "outside" / "model.safetensors", TENSORS[-1:])
    (root / "link_out.safetensors").symlink_to(wdir / "outside" / "model.safetensors")
    (root / "long.safetensors").write_bytes(struct.pack("<Q", 1 << 20) + b"{}      ")
    load = wclient.load_weights
    refused(grpc.StatusCode.NOT_FOUND, lambda: wclient.attach_weights("nope"), "nope")
    refused(grpc.StatusCode.NOT_FOUND, lambda: wclient.drop_weights("nope"), "nope")
    refused(grpc.StatusCode.PERMISSION_DENIED, lambda: load("x", "../outside/model.safetensors", progress=None), "'..'")
    refused(grpc.StatusCode.PERMISSION_DENIED, lambda: load("x", str(wdir / "outside" / "model.safetensors"),
                                                            progress=None), "absolute")
    refused(grpc.StatusCode.PERMISSION_DENIED, lambda: load("x", "link_out.safetensors", progress=None), "link_out")
    refused(grpc.StatusCode.NOT_FOUND, lambda: load("x", "missing.safetensors", progress=None), "missing")
    refused(grpc.StatusCode.INVALID_ARGUMENT, lambda: load("x", "long.safetensors", progress=None), "long.safetensors")
    # A rule the tensor cannot take (BF16 as MXFP4 storage), and a bad set name.
    refused(grpc.StatusCode.INVALID_ARGUMENT,
            lambda: load("x", "model.safetensors", rules={"embed.*": Spec("hopper_value")}, progress=None),
            "embed.weight", "BF16")
    refused(grpc.StatusCode.INVALID_ARGUMENT, lambda: load("bad/name", "model.safetensors", progress=None), "name")
    assert wclient.list_weights().get("x") is None
    # Rules the client can tell are bad never reach the daemon.
    for bad in ("*_blocks", "*_blocks=nolayout", "a=hopper_value:mx_axis=x", "a=hopper_value:bogus=1",
                "a=blackwell_value:num_warps=4"):
        with pytest.raises(ValueError):
            wprep.weights.parse_rules(bad)
    with pytest.raises(TypeError):
        wprep.weights.parse_rules([("a", 3)])
    # A taken name.
    load("dup", "model.safetensors", progress=None)
    try:
        refused(grpc.StatusCode.ALREADY_EXISTS, lambda: load("dup", "model.safetensors", progress=None), "dup")
    finally:
        wclient.drop_weights("dup")


def test_over_budget_is_resource_exhausted_and_changes_nothing(wdir, checkpoint):
    with _start(wdir, "--weights-budget=4096") as d, Client(d.target, timeout=60) as c:
        with pytest.raises(WprepError) as e:
            c.load_weights("big", "model.safetensors", rules=RULES, progress=None)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert "--weights-budget" in e.value.details
        s = c.list_weights()
        assert (s.sets, s.budget_bytes, s.resident_bytes) == ((), 4096, 0)
        assert c.health() == "SERVING"


def test_the_cli_rules_syntax_gives_the_same_rules():
    text = "lm_head*=verbatim; *_blocks=hopper_value:packing_axis=-2:mx_axis=-2 ;*_scales=hopper_scale:num_warps=4"
    want = [
        wprep.v1.wprep_pb2.WeightRule(pattern="lm_head*", verbatim=True),
        wprep.v1.wprep_pb2.WeightRule(pattern="*_blocks",
                                      convert=Spec("hopper_value", mx_axis=-2, packing_axis=-2).to_proto()),
        wprep.v1.wprep_pb2.WeightRule(pattern="*_scales", convert=Spec("hopper_scale", num_warps=4).to_proto()),
    ]
    assert wprep.weights.parse_rules(text) == want
    as_mapping = {"lm_head*": "verbatim", "*_blocks": Spec("hopper_value", mx_axis=-2, packing_axis=-2),
                  "*_scales": "hopper_scale:num_warps=4"}
    assert wprep.weights.parse_rules(as_mapping) == want
    assert wprep.weights.parse_rules(list(as_mapping.items())) == want
    assert wprep.weights.parse_rules(None) == []


def test_slices_in_every_rules_form():
    S = wprep.weights.Slice
    pb = wprep.v1.wprep_pb2
    want = [
        pb.WeightRule(pattern="emb*", verbatim=True, slice=pb.WeightSlice(axis=0, start=4, length=8)),
        pb.WeightRule(pattern="*_blocks", convert=Spec("hopper_value", packing_axis=-2).to_proto(),
                      slice=pb.WeightSlice(axis=-3, start=0, length=2)),
        pb.WeightRule(pattern="lm_head*", verbatim=True),
    ]
    text = "emb*=verbatim:slice=0/4/8;*_blocks=hopper_value:slice=-3/0/2:packing_axis=-2;lm_head*=verbatim"
    assert wprep.weights.parse_rules(text) == want
    triples = [("emb*", "verbatim", S(0, 4, 8)), ("*_blocks", Spec("hopper_value", packing_axis=-2), (-3, 0, 2)),
               ("lm_head*", "verbatim")]
    assert wprep.weights.parse_rules(triples) == want
    mapping = {"emb*": ("verbatim", S(0, 4, 8)), "*_blocks": ("hopper_value:packing_axis=-2", S(-3, 0, 2)),
               "lm_head*": "verbatim"}
    assert wprep.weights.parse_rules(mapping) == want
    for bad in ("a=verbatim:slice=0/1", "a=verbatim:slice=x/1/2", "a=verbatim:slice=0/1/2/3"):
        with pytest.raises(ValueError, match="slice=AXIS/START/LENGTH"):
            wprep.weights.parse_rules(bad)
    with pytest.raises(TypeError, match="Slice"):
        wprep.weights.parse_rules([("a", "verbatim", (0, 1))])


def test_checkpoint_rules_in_every_form():
    pb = wprep.v1.wprep_pb2
    C = wprep.weights.Checkpoint
    want = [
        pb.WeightRule(pattern="*_blocks", convert=Spec("hopper_value", mma_version=2).to_proto(), checkpoint=True,
                      slice=pb.WeightSlice(axis=0, start=0, length=4)),
        pb.WeightRule(pattern="*_scales", convert=Spec("hopper_scale", align_k=4).to_proto(), checkpoint=True),
    ]
    text = "*_blocks=hopper_value:checkpoint:mma_version=2:slice=0/0/4;*_scales=hopper_scale:align_k=4:checkpoint"
    assert wprep.weights.parse_rules(text) == want
    pairs = [("*_blocks", C(Spec("hopper_value", mma_version=2)), (0, 0, 4)),
             ("*_scales", C(Spec("hopper_scale", align_k=4)))]
    assert wprep.weights.parse_rules(pairs) == want
    with pytest.raises(ValueError, match="checkpoint is for a layout"):
        wprep.weights.parse_rules("a=verbatim:checkpoint")


def test_checkpoint_rules_load_gpt_oss_pairs_as_convert_safetensors_does(wclient, wdir):
    # A gpt-oss-style pair: the set's tensors equal the daemon's conversions of the blocks
    # as the checkpoint order of [E, K, N] and of the scales through their [E, K/32, N] view.
    e, n, k = 2, 96, 256
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (e, n, k // 32), dtype=np.uint8)
    write_safetensors(wdir / "root" / "pair.safetensors", [("experts.w_blocks", "U8", blocks.shape, blocks.tobytes()),
                                                           ("experts.w_scales", "U8", scales.shape, scales.tobytes())])
    rules = "*_blocks=hopper_value:checkpoint;*_scales=hopper_scale:checkpoint"
    wprep.weights.load("pair", "pair.safetensors", rules=rules, progress=None, client=wclient)
    try:
        v = wclient.convert(Spec("hopper_value", packing_axis=-2), [e, k, n], blocks.reshape(e, n, k // 2))
        s = wclient.convert(Spec("hopper_scale"), [e, k // 32, n], scales.swapaxes(-1, -2))
        with wprep.weights.attach("pair", client=wclient) as tensors:
            got_v, got_s = tensors["experts.w_blocks"], tensors["experts.w_scales"]
            assert got_v.shape == tuple(v.shape) and got_s.shape == tuple(s.shape)
            assert got_v.strides == tuple(v.strides) and got_s.strides == tuple(s.strides)
            assert np.ascontiguousarray(got_v.swapaxes(-1, -2)).tobytes() == v.data
            assert np.ascontiguousarray(got_s.swapaxes(-1, -2)).tobytes() == s.data
    finally:
        wprep.weights.drop("pair", force=True, client=wclient)


def test_a_ranks_slice_is_loaded_and_attached(wclient, checkpoint):
    # Rows 4..11 of the BF16 copy and columns 8..23 of the shielded U8 copy, as the
    # manifest reports them and as the attached views read.
    rules = [("embed.weight", "verbatim", wprep.weights.Slice(0, 4, 8)),
             ("ref.shielded", "verbatim", wprep.weights.Slice(-1, 8, 16))]
    r = wprep.weights.load("sliced", "model.safetensors", rules=rules, client=wclient)
    try:
        t = {x.name: x for x in r.manifest.tensors}
        assert t["embed.weight"].shape == (8, 8) and t["embed.weight"].slice == wprep.weights.Slice(0, 4, 8)
        assert t["ref.shielded"].shape == (64, 16) and t["ref.shielded"].slice == wprep.weights.Slice(1, 8, 16)
        assert t["ref.0.w"].slice is None
        embed = np.frombuffer(TENSORS[-1][3], np.uint16).reshape(16, 8)
        shielded = np.frombuffer(TENSORS[-2][3], np.uint8).reshape(64, 32)
        with wclient.attach_weights("sliced") as w:
            assert np.array_equal(w["embed.weight"], embed[4:12])
            assert np.array_equal(w["ref.shielded"], shielded[:, 8:24])
        with pytest.raises(WprepError) as e:
            wprep.weights.load("bad", "model.safetensors", rules=[("embed.weight", "verbatim", (0, 10, 8))],
                               client=wclient)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "passes axis 0 of size 16" in e.value.details
        assert wclient.list_weights().get("bad") is None
    finally:
        _wait_attachments(wclient, "sliced", 0)
        wclient.drop_weights("sliced")


def test_a_preloaded_set_is_waited_for_and_attached(wdir, checkpoint):
    # A daemon started with --preload: wait() returns once the set is resident, the set is
    # the one LoadWeights makes with the same rules, and an unknown set times out.
    pb = wprep.v1.wprep_pb2
    from google.protobuf import text_format

    preload = pb.WeightPreload(sets=[pb.LoadWeightsRequest(name="pre", path="model.safetensors",
                                                           rules=wprep.weights.parse_rules(RULES))])
    path = wdir / "preload.txtpb"
    path.write_text(text_format.MessageToString(preload))
    with _start(wdir, f"--preload={path}") as d, wprep.Client(d.target) as c:
        info = wprep.weights.wait("pre", timeout=60, client=c)
        assert info.manifest.name == "pre"
        with c.attach_weights("pre") as w:
            _check_every_tensor(c, w)
        with pytest.raises(TimeoutError, match="'nope'"):
            wprep.weights.wait("nope", timeout=0.3, client=c)


_CHILD = """
import sys, time, wprep
c = wprep.Client(sys.argv[1])
w = c.attach_weights(sys.argv[2])
print("attached", w.attachment_id, int(w["embed.weight"].sum()), flush=True)
time.sleep(3600)
"""


def test_a_killed_client_is_detached(wclient, loaded):
    loaded("set4")
    env = dict(os.environ, PYTHONPATH=PACKAGE_DIR)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, wclient.target, "set4"], stdout=subprocess.PIPE,
                             env=env, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("attached "), line
        assert int(line.split()[2]) == int(np.frombuffer(TENSORS[-1][3], "<u2").sum())
        assert _attachments(wclient, "set4") == 1
        with pytest.raises(WprepError) as e:
            wclient.drop_weights("set4")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert _wait_attachments(wclient, "set4", 0), "the killed client is still attached"
    assert wclient.drop_weights("set4") > 0
    assert wclient.health() == "SERVING"


def test_progress_bar_and_quiet_default_off_a_terminal(wclient, loaded, capsys):
    loaded("set6", progress="bar")
    err = capsys.readouterr().err
    assert err.startswith("\r[") and err.endswith("\n"), repr(err)
    assert f"{len(TENSORS)}/{len(TENSORS)} tensors" in err
    wclient.load_weights("set7", "model.safetensors", progress="auto")  # stderr is no terminal here
    try:
        assert capsys.readouterr().err == ""
    finally:
        wclient.drop_weights("set7")
    with pytest.raises(ValueError, match="progress"):
        wclient.load_weights("set8", "model.safetensors", progress="loud")
    assert wclient.list_weights().get("set8") is None


def test_the_module_functions_use_the_default_client(wclient, checkpoint):
    wprep.set_default_client(wclient)
    try:
        r = wprep.weights.load("set9", "model.safetensors", rules="ref.shielded=verbatim", progress=None)
        assert [t.rule for t in r.manifest.tensors] == [-1] * len(CASES) + [0, -1]
        assert all(t.identity is None for t in r.manifest.tensors)
        assert wprep.weights.list_sets(with_tensors=True).get("set9").manifest == r.manifest
        with wprep.weights.attach("set9") as w:
            for name, _, _, raw in TENSORS:
                assert w[name].tobytes() == raw, f"{name}: a copy differs from the file"
        assert wprep.weights.drop("set9") == r.manifest.total_bytes
    finally:
        wprep.set_default_client(None)


# -- GPU sets (skipped without torch and a CUDA device) -----------------------------------------




@pytest.fixture(scope="module")
def gpu_wclient(wdir, checkpoint):
    """A daemon serving the GPUs, with the same --weights-root."""
    torch_cuda()
    from conftest import wprepd_path
    with LocalDaemon(wprepd_path(), [f"--weights-root={wdir / 'root'}", f"--weights-shm-dir={wdir / 'shm'}"]) as d:
        with Client(d.target, timeout=120) as c:
            yield c


def _another_process_reads_the_same(target, set_name, attached):
    """A second process attaches to GPU set `set_name` and reads a tensor's bytes: they hash as
    this process's view of the same tensor does."""
    import torch

    name = next(t.name for t in attached.manifest.tensors if t.bytes)
    want = hashlib.sha256(attached[name].contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
    code = ("import hashlib, wprep, torch; from wprep import Client\n"
            f"c = Client({target!r})\n"
            f"with c.attach_weights({set_name!r}) as w:\n"
            f"    x = w[{name!r}]\n"
            "    print(hashlib.sha256(x.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": PACKAGE_DIR})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


def test_a_gpu_set_attaches_as_cuda_tensors_with_the_host_sets_bytes(gpu_wclient, wclient):
    """The same checkpoint and rules as a set on cuda:0 and as a host set of the CPU daemon:
    every tensor equal, each a CUDA view of the set's one allocation at its offset; in another
    process too; and the memory freed by the drop."""
    torch = torch_cuda()
    from wprep._cuda import ipc

    r = gpu_wclient.load_weights("gpu1", "model.safetensors", rules=RULES, device="cuda:0", progress=None)
    assert r.manifest.device_uuid == ipc.device_uuid(0)
    host = wclient.load_weights("host1", "model.safetensors", rules=RULES, progress=None)
    try:
        assert [(t.name, t.shape, t.strides, t.bytes, t.offset) for t in r.manifest.tensors] == \
            [(t.name, t.shape, t.strides, t.bytes, t.offset) for t in host.manifest.tensors]
        with gpu_wclient.attach_weights("gpu1") as g, wclient.attach_weights("host1") as h:
            assert g.device == torch.device("cuda", 0) and not g.shm_path and len(g.ipc_handle) == 64
            with pytest.raises(TypeError):
                g.numpy()
            tensors = g.torch_tensors()
            base = min(tensors[t.name].data_ptr() - t.offset for t in g.manifest.tensors if t.bytes)
            for t in g.manifest.tensors:
                x = g[t.name]
                assert x.is_cuda and x.device == g.device and tuple(x.shape) == t.shape
                assert tuple(x.stride()) == t.strides and x.data_ptr() == base + t.offset, t.name
                got = x.contiguous().view(torch.uint8).cpu().numpy().tobytes() if x.numel() else b""
                assert got == h[t.name].tobytes(), f"{t.name}: GPU set differs from the host set"
            # Another process attaches too and reads the same bytes.
            _another_process_reads_the_same(gpu_wclient.target, "gpu1", g)
            del tensors, x
        assert gpu_wclient.drop_weights("gpu1") == r.manifest.total_bytes
    finally:
        for c, n in ((gpu_wclient, "gpu1"), (wclient, "host1")):
            try:
                c.drop_weights(n, force=True)
            except WprepError as e:
                assert e.code == grpc.StatusCode.NOT_FOUND


def test_a_vmm_gpu_set_attaches_from_its_descriptor_in_two_processes(gpu_wclient, wclient):
    """A set on cuda:0 in CUDA virtual memory: the manifest says vmm, attach gives a token and
    no IPC handle, the views (mapped from the descriptor fetched over the handle socket) equal
    the host set's bytes, another process attaches the same way, and a spent token is refused."""
    torch = torch_cuda()
    r = gpu_wclient.load_weights("vmm1", "model.safetensors", rules=RULES, device="cuda:0", vmm=True, progress=None)
    assert r.manifest.vmm
    host = wclient.load_weights("host2", "model.safetensors", rules=RULES, progress=None)
    try:
        with gpu_wclient.attach_weights("vmm1") as g, wclient.attach_weights("host2") as h:
            assert not g.ipc_handle and len(g.vmm_token) == 16
            for t in g.manifest.tensors:
                x = g[t.name]
                assert x.is_cuda and tuple(x.shape) == t.shape and tuple(x.stride()) == t.strides
                got = x.contiguous().view(torch.uint8).cpu().numpy().tobytes() if x.numel() else b""
                assert got == h[t.name].tobytes(), f"{t.name}: VMM set differs from the host set"
            _another_process_reads_the_same(gpu_wclient.target, "vmm1", g)
            # The token served once: a second fetch with it is refused.
            from wprep._cuda import ipc
            with pytest.raises(WprepError) as e:
                ipc.fetch_vmm_descriptor(ipc.unix_socket_path(gpu_wclient.target), g.vmm_token)
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
            del x
        assert gpu_wclient.drop_weights("vmm1") == r.manifest.total_bytes
    finally:
        for c, n in ((gpu_wclient, "vmm1"), (wclient, "host2")):
            try:
                c.drop_weights(n, force=True)
            except WprepError as e:
                assert e.code == grpc.StatusCode.NOT_FOUND


_GPU_CHILD = """
import sys, time, torch, wprep
c = wprep.Client(sys.argv[1])
w = c.attach_weights(sys.argv[2])
print("attached", w.attachment_id, int(w.raw("w")[:4096].sum().item()), flush=True)
time.sleep(3600)
"""


def test_gpu_sets_leave_device_memory_as_it_was_after_a_killed_engine_and_100_attaches(gpu_wclient, wdir):
    """A 256 MiB set on cuda:0, as cudaMalloc memory and as CUDA virtual memory: an engine that
    is killed while attached is detached, 100 attach/detach cycles in this process leave no
    attachment, and once both sets are dropped the GPU's free memory is what it was before
    (a mapping left open in either process, or a set not freed, would hold 256 MiB)."""
    torch = torch_cuda()
    raw = np.random.default_rng(5).integers(0, 256, 256 << 20, dtype=np.uint8).tobytes()
    write_safetensors(wdir / "root" / "big.safetensors", [("w", "U8", (256, 1 << 20), raw)])
    want = int(np.frombuffer(raw[:4096], np.uint8).sum())
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(0)[0]
    env = dict(os.environ, PYTHONPATH=PACKAGE_DIR)
    for vmm in (False, True):
        name = f"big{int(vmm)}"
        r = gpu_wclient.load_weights(name, "big.safetensors", device="cuda:0", vmm=vmm, progress=None)
        try:
            child = subprocess.Popen([sys.executable, "-c", _GPU_CHILD, gpu_wclient.target, name],
                                     stdout=subprocess.PIPE, env=env, text=True)
            try:
                line = child.stdout.readline()
                assert line.startswith("attached ") and int(line.split()[2]) == want, line
                assert _attachments(gpu_wclient, name) == 1
            finally:
                child.send_signal(signal.SIGKILL)
                child.wait()
                child.stdout.close()
            assert _wait_attachments(gpu_wclient, name, 0), f"{name}: the killed engine is still attached"
            for _ in range(100):
                with gpu_wclient.attach_weights(name) as w:
                    assert int(w.raw("w")[:4096].sum().item()) == want
                    del w
            gc.collect()
            assert _attachments(gpu_wclient, name) == 0
        finally:
            assert gpu_wclient.drop_weights(name, force=True) == r.manifest.total_bytes
    gc.collect()
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info(0)[0]
    assert abs(free_after - free_before) < (32 << 20), (free_before, free_after)
