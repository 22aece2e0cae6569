"""wprep.trtllm's CUDA IPC requests against the stand-in torch of test_torch_fake.py: the
per-shape item templates (never reused across ops, params, dtypes or shapes), the operands'
byte offsets and sizes read without views, the registry's rules (a registered storage is
exported once; one released and made again at its address is exported again), the errors
in their order, and one identity object per distinct identity of a batch. The real thing
runs on a GPU (test_trtllm.py)."""

import grpc
import pytest

from wprep import WprepError, _torch, trtllm
from wprep.v1 import wprep_pb2 as pb

from test_torch_fake import FakeAllocation, FakeStorage, fake  # noqa: F401

UUID0 = bytes(range(16))


@pytest.fixture
def tg(fake, monkeypatch):
    """The stand-in's dtypes are strings: name them as torch's would map."""
    torch, rec = fake
    monkeypatch.setattr(trtllm, "_TORCH_DTYPES", {"uint8": pb.MOE_DTYPE_UINT8, "float32": pb.MOE_DTYPE_FLOAT32})
    monkeypatch.setattr(trtllm, "_TEMPLATES", {})
    monkeypatch.setattr(trtllm, "_VALID_PARAMS", {})
    monkeypatch.setattr(torch, "float32", "float32", raising=False)
    monkeypatch.setattr(torch, "bfloat16", "bfloat16", raising=False)
    return torch, rec


def cuda(torch, rec, shape, *, dtype="uint8", base=1 << 36, block_offset=0, offset=0, alloc=None):
    itemsize = 4 if dtype == "float32" else 1
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    alloc = alloc or FakeAllocation(base, 1 << 30)
    storage = FakeStorage(rec, alloc, block_offset, (n + offset) * itemsize)
    return torch.Tensor(storage, shape, tuple(reversed(strides)), offset, dtype=dtype, itemsize=itemsize)


def operands(torch, rec, e, i, h, base=1 << 36):
    """A w13 (values, scales, bias) and its outputs, each in its own allocation."""
    shapes = [((e, 2 * i, h // 2), "uint8"), ((e, 2 * i, h // 32), "uint8"), ((e, 2 * i), "float32")]
    ins = [cuda(torch, rec, s, dtype=d, base=base + (k << 32)) for k, (s, d) in enumerate(shapes)]
    outs = [cuda(torch, rec, s, dtype=d, base=base + ((k + 3) << 32)) for k, (s, d) in enumerate(shapes)]
    return ins, outs


def expected(op, params, ins, outs, names=("values", "scales", "bias")):
    """The item as built field by field, without templates."""
    m = pb.MoeItem(op=op)
    for k, v in params.items():
        setattr(m.params, k, v)
    for name, t in zip(names, ins):
        m.inputs.add(name=name, dtype=pb.MOE_DTYPE_FLOAT32 if t.dtype == "float32" else pb.MOE_DTYPE_UINT8,
                     shape=t.shape)
    for name in (["y"] if list(names) == ["x"] else names)[:len(outs)]:
        m.outputs.add(name=name)
    return m


def without_buffers(m):
    m = pb.MoeItem.FromString(m.SerializeToString())
    for x in m.inputs:
        x.ClearField("source")
    for o in m.outputs:
        o.ClearField("destination")
    return m


def test_templates_are_never_reused_across_ops_params_dtypes_or_shapes(tg):
    torch, rec = tg
    reg = _torch.Registry()
    a_in, a_out = operands(torch, rec, 4, 64, 128)
    b_in, b_out = operands(torch, rec, 4, 96, 128, base=1 << 40)
    cases = [
        ("prepare_w13", {"align": 256}, a_in, a_out),
        ("prepare_w13", {"align": 256}, b_in, b_out),  # another shape
        ("prepare_w13", {"align": 128}, a_in, a_out),  # another value
        ("prepare_w2", {"align": 256}, a_in, a_out),  # another op
        ("prepare_w13", {"format": "fp8", "gated": True}, a_in, a_out),
        ("prepare_w13", {"format": "fp8", "gated": 1}, a_in, a_out),  # keyed apart from True
        ("prepare_w13", {"align": 256}, a_in[:2], a_out[:2]),  # no bias
    ]
    bias_u8 = cuda(torch, rec, (4, 128), base=1 << 44)
    cases.append(("prepare_w13", {"align": 256}, a_in[:2] + [bias_u8], a_out))  # another dtype, same shape
    for _ in range(2):  # the second round from the templates of the first
        for op, params, ins, outs in cases:
            got = trtllm._ipc_item(op, list(zip(("values", "scales", "bias"), ins)), params, outs, reg)
            assert without_buffers(got) == expected(op, params, ins, outs), (op, params)
            assert got.params.HasField("gated") == ("gated" in params)
    with pytest.raises(TypeError):  # protobuf's own refusal, as before templates
        trtllm._ipc_item("prepare_w13", list(zip(("values", "scales", "bias"), a_in)), {"align": 2.5}, a_out, reg)


def test_operands_are_located_without_views_and_registered_storages_exported_once(tg):
    torch, rec = tg
    reg = _torch.Registry()
    pool = FakeAllocation(1 << 36, 1 << 30)
    # A float32 bias 10 elements into its storage, which is 4096 bytes into its allocation.
    bias = cuda(torch, rec, (2, 64), dtype="float32", alloc=pool, block_offset=4096, offset=10)
    x = cuda(torch, rec, (2, 64, 8), alloc=pool, block_offset=1 << 20)
    y = cuda(torch, rec, (2, 64, 8), alloc=pool, block_offset=2 << 20)
    _torch.handle_refs([x, y], reg, register=True)
    assert rec.shared == 2
    m = trtllm._ipc_item("row_shuffle", [("x", x)], {"epilogue_tile_m": 128}, [y], reg)
    assert rec.shared == 2, "a registered storage was exported again"
    src, dst = m.inputs[0].source.ipc, m.outputs[0].destination.ipc
    assert (src.handle, src.offset, src.size, src.device_uuid) == (pool.handle, 1 << 20, 1024, UUID0)
    assert (dst.handle, dst.offset, dst.size, list(dst.strides)) == (pool.handle, 2 << 20, 1024, [])
    m = trtllm._ipc_item("bias_shuffle", [("x", bias)], {"epilogue_tile_m": 128}, [bias], reg)
    assert rec.shared == 4  # unregistered: exported on each use, as source_view does
    src = m.inputs[0].source.ipc
    assert (src.offset, src.size, list(src.strides)) == (4096 + 40, 2 * 64 * 4, [])
    assert list(m.inputs[0].shape) == [2, 64] and m.inputs[0].dtype == pb.MOE_DTYPE_FLOAT32


def test_a_storage_released_and_made_again_at_its_address_is_exported_again(tg):
    torch, rec = tg
    reg = _torch.Registry()
    old = FakeAllocation(1 << 36, 1 << 30)
    x = cuda(torch, rec, (1, 64, 8), alloc=old)
    y = cuda(torch, rec, (1, 64, 8), alloc=old, block_offset=1 << 20)
    _torch.handle_refs([x, y], reg, register=True)
    trtllm._ipc_item("row_shuffle", [("x", x)], {"epilogue_tile_m": 128}, [y], reg)
    assert rec.shared == 2
    _torch.handle_refs([x], reg, register=False)  # released (Client.release), then freed
    new = FakeAllocation(1 << 36, 1 << 30)
    new.handle = bytes(64 - i for i in range(64))
    x2 = cuda(torch, rec, (1, 64, 8), alloc=new)  # the same address, another allocation
    m = trtllm._ipc_item("row_shuffle", [("x", x2)], {"epilogue_tile_m": 128}, [y], reg)
    assert m.inputs[0].source.ipc.handle == new.handle and rec.shared == 3
    # A registered storage resized since (another size at its address) is no hit either,
    # whether the tensor is found by its storage or by its address: its bytes are exported
    # again (and x2 too: it was never registered).
    y.untyped_storage()._nbytes = 256
    y3 = torch.Tensor(y.untyped_storage(), (1, 64, 4), (256, 4, 1), 0)
    m = trtllm._ipc_item("row_shuffle", [("x", x2)], {"epilogue_tile_m": 128}, [y3], reg)
    assert m.outputs[0].destination.ipc.handle == old.handle and rec.shared == 5


def test_errors_come_in_the_order_and_words_they_always_had(tg):
    torch, rec = tg
    reg = _torch.Registry()
    ins, outs = operands(torch, rec, 2, 64, 128)
    named = list(zip(("values", "scales", "bias"), ins))
    with pytest.raises(WprepError) as e:  # params first: nothing exported
        trtllm._ipc_item("prepare_w13", named, {"tile": 1}, outs[:1], reg)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "unknown param 'tile'" in e.value.details
    assert rec.shared == 0
    gappy = ins[1].transpose(-2, -1)
    with pytest.raises(WprepError, match="scales: a CUDA tensor read or written in place must be contiguous"):
        trtllm._ipc_item("prepare_w13", [named[0], ("scales", gappy), named[2]], {}, outs, reg)
    wide = cuda(torch, rec, (2, 128), dtype="float64")
    wide._itemsize = 8
    with pytest.raises(WprepError, match="bias: dtype float64 is not one the contract takes"):
        trtllm._ipc_item("prepare_w13", [named[0], named[1], ("bias", wide)], {}, outs, reg)
    with pytest.raises(WprepError, match=r"out has 2 tensors; prepare_w13 with these inputs writes 3 "
                                         r"\(values, scales, bias\)"):
        trtllm._ipc_item("prepare_w13", named, {}, outs[:2], reg)
    with pytest.raises(WprepError, match="out bias: a CUDA tensor read or written in place must be contiguous"):
        trtllm._ipc_item("prepare_w13", named, {}, outs[:2] + [outs[2].transpose(0, 1)], reg)


class StubClient:
    """Answers a ConvertBatch of MoE IPC items with each item's outputs and an identity per op."""

    def __init__(self):
        self._registry = _torch.Registry()
        self.requests = []

    def _unary(self, method, req, timeout):
        self.requests.append(req)
        resp = pb.ConvertBatchResponse()
        for it in req.items:
            r = resp.items.add(engine="cuda:GPU-0")
            for o, x in zip(it.moe.outputs, it.moe.inputs):
                t = r.outputs.add(name=o.name, shape=x.shape)
                t.moe_identity.op = it.moe.op
                t.moe_identity.params.CopyFrom(it.moe.params)
                t.moe_identity.contract_version = 1
                t.moe_identity.description = it.moe.op
        return resp


def test_a_batch_makes_one_identity_per_distinct_identity(tg):
    torch, rec = tg
    c = StubClient()
    layers, outs = [], []
    for k in range(3):
        i13, o13 = operands(torch, rec, 2, 64, 128, base=(1 << 36) + (k << 34))
        i2, o2 = operands(torch, rec, 2, 64, 128, base=(1 << 45) + (k << 34))
        layers.append((i13, i2))
        outs.append((o13, o2))
    res = trtllm.prepare_layers(layers, out=outs, align=256, client=c)
    assert len(c.requests) == 1 and len(c.requests[0].items) == 6
    assert rec.synced == [0]
    for (r13, r2), (o13, o2) in zip(res, outs):
        assert r13.identity.op == "prepare_w13" and r2.identity.op == "prepare_w2"
        assert r13.identity.params == r2.identity.params == {"align": 256}
        assert [r13.values, r13.scales, r13.bias] == o13 and r2.bias is o2[2]
        assert r13.shapes["scales"] == (2, 128, 4) and r13.engine == "cuda:GPU-0"
    assert len({id(r[0].identity) for r in res}) == 1 and res[0][0].identity is not res[0][1].identity
    # Another call gets its own objects.
    again = trtllm.prepare_layers(layers[:1], out=outs[:1], align=256, client=c)
    assert again[0][0].identity == res[0][0].identity and again[0][0].identity is not res[0][0].identity


def test_registered_tensors_are_located_by_address_without_their_storage(tg, monkeypatch):
    # Registered storages are found from a tensor's data_ptr and size alone: no storage
    # object is asked for, and the offset counts the view's own start; bytes reaching past
    # the registered storage are no hit.
    torch, rec = tg
    reg = _torch.Registry()
    pool = FakeAllocation(1 << 36, 1 << 30)
    base = cuda(torch, rec, (4, 64, 16), alloc=pool, block_offset=1 << 20)  # 4096 bytes
    out = cuda(torch, rec, (2, 64, 8), dtype="float32", alloc=pool, block_offset=2 << 20)  # 4096 bytes
    _torch.handle_refs([base, out], reg, register=True)
    x = torch.Tensor(base.untyped_storage(), (1, 64, 16), (1024, 16, 1), 2048)  # the third quarter
    y = torch.Tensor(out.untyped_storage(), (1, 64, 8), (512, 8, 1), 512, dtype="float32", itemsize=4)
    asked = []
    monkeypatch.setattr(torch.Tensor, "untyped_storage", lambda self: asked.append(self) or self._storage)
    m = trtllm._ipc_item("row_shuffle", [("x", x)], {"epilogue_tile_m": 128}, [y], reg)
    assert asked == [] and rec.shared == 2
    src, dst = m.inputs[0].source.ipc, m.outputs[0].destination.ipc
    assert (src.handle, src.offset, src.size) == (pool.handle, (1 << 20) + 2048, 1024)
    assert (dst.handle, dst.offset, dst.size) == (pool.handle, (2 << 20) + 2048, 2048)
    # A view reaching past its storage's end (as a broken tensor would) is no hit: the slow
    # path asks for its storage.
    z = torch.Tensor(base.untyped_storage(), (1, 64, 32), (2048, 32, 1), 3072)
    assert reg.locate(0, z.data_ptr(), 2048) is None
    assert reg.locate(0, base.data_ptr() - 1, 1) is None
    assert reg.locate(1, base.data_ptr(), 1) is None
