"""The CUDA IPC request building against a stand-in for torch, on machines without a GPU.

The stand-in returns what torch's StorageSharing.cpp returns from _share_cuda_ (an 8-tuple whose
handle is version byte + b"c" + the 64-byte cudaIpcMemHandle_t, and the storage's offset in its
caching-allocator block), so these tests pin down the arithmetic: buffer offsets, sizes and
strides, the ref-counter release, the stream synchronization, the errors. The real thing runs
in test_gpu.py on a GPU.
"""

import dataclasses
import os
import signal
import sys
import time
import types

import grpc
import pytest

import wprep
from wprep import Spec, WprepError
from wprep import _requests, _torch, _triton
from wprep._cuda import ipc
from wprep.v1 import wprep_pb2 as pb

GOLDEN = 0x9E3779B97F4A7C15


class Recorder:
    def __init__(self):
        self.shared = 0
        self.released = []
        self.synced = []
        self.waits = []
        self.records = []


class FakeAllocation:
    def __init__(self, base, size, kind=b"c", version=2):
        self.base, self.size = base, size
        self.handle = bytes((base >> (8 * (i % 8))) & 255 for i in range(64))
        self.kind, self.version = kind, version


class FakeStorage:
    def __init__(self, rec, alloc, offset, nbytes):
        self.rec, self.alloc, self.offset, self._nbytes = rec, alloc, offset, nbytes

    def data_ptr(self):
        return self.alloc.base + self.offset

    def nbytes(self):
        return self._nbytes

    def _share_cuda_(self):
        self.rec.shared += 1
        h = bytes([self.alloc.version]) + self.alloc.kind + self.alloc.handle
        return (0, h, self._nbytes, self.offset, b"/torch_fake_refs", self.rec.shared, b"\0" * 64, True)


class FakeDevice:
    type = "cuda"

    def __init__(self, index):
        self.index = index

    def __eq__(self, other):
        return isinstance(other, FakeDevice) and other.index == self.index

    def __repr__(self):
        return f"cuda:{self.index}"


def make_torch(rec):
    torch = types.ModuleType("torch")

    class Tensor:
        def __init__(self, storage, shape, strides, offset, device=0, dtype="uint8", itemsize=1):
            self._storage, self.shape, self._strides, self._offset = storage, tuple(shape), tuple(strides), offset
            self.device, self.dtype, self._itemsize = FakeDevice(device), dtype, itemsize
            self.is_cuda = True

        @property
        def ndim(self):
            return len(self.shape)

        def stride(self, i=None):
            return self._strides if i is None else self._strides[i]

        def storage_offset(self):
            return self._offset

        def untyped_storage(self):
            return self._storage

        def element_size(self):
            return self._itemsize

        def numel(self):
            n = 1
            for d in self.shape:
                n *= d
            return n

        def is_contiguous(self):
            need = 1
            for d, s in reversed(list(zip(self.shape, self._strides))):
                if d != 1 and s != need:
                    return False
                need *= d
            return True

        def data_ptr(self):
            return self._storage.data_ptr() + self._offset * self._itemsize

        def as_strided(self, size, stride, storage_offset=None):
            return Tensor(self._storage, size, stride, self._offset if storage_offset is None else storage_offset,
                          self.device.index, self.dtype)

        def transpose(self, a, b):
            shape, strides = list(self.shape), list(self._strides)
            shape[a], shape[b] = shape[b], shape[a]
            strides[a], strides[b] = strides[b], strides[a]
            return Tensor(self._storage, shape, strides, self._offset, self.device.index, self.dtype)

    class UntypedStorage:
        @staticmethod
        def _release_ipc_counter_cuda(handle, offset):
            rec.released.append((handle, offset))

    next_base = [1 << 40]

    def empty(n, dtype=None, device=None):
        base = next_base[0]
        next_base[0] += 1 << 30
        alloc = FakeAllocation(base, max(n, 1))
        return Tensor(FakeStorage(rec, alloc, 0, n), (n,), (1,), 0, device.index, dtype)

    class Stream:
        def __init__(self, d):
            self.d = d

        def synchronize(self):
            rec.synced.append(self.d)

        def wait_event(self, ev):
            rec.waits.append((self.d, ev))

    current = [0]

    class Event:
        made = 0

        def __init__(self, enable_timing=True, blocking=False, interprocess=False):
            assert interprocess and not enable_timing, "an IPC event needs interprocess=True, no timing"
            Event.made += 1
            self.n, self.device = Event.made, current[0]

        def ipc_handle(self):
            return bytes([self.n, self.device]) + b"E" * 62

        def record(self, stream):
            rec.records.append((stream.d, self))

    class device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.before, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.before

    cuda = types.SimpleNamespace(
        current_stream=lambda d: Stream(d),
        Event=Event,
        device=device,
        get_device_properties=lambda i: types.SimpleNamespace(
            uuid=types.SimpleNamespace(bytes=[(i * 16 + k) & 255 for k in range(16)])),
        get_device_capability=lambda d=None: (9, 0),
    )
    torch.Tensor, torch.UntypedStorage, torch.empty, torch.cuda, torch.uint8 = Tensor, UntypedStorage, empty, cuda, "uint8"
    torch.__version__ = "fake"
    return torch


@pytest.fixture
def fake(monkeypatch):
    rec = Recorder()
    torch = make_torch(rec)
    monkeypatch.setitem(sys.modules, "torch", torch)
    # no driver to name allocations unless a test gives one: every storage is exported
    monkeypatch.setattr(ipc, "allocation_of", lambda ptr: None)
    monkeypatch.setattr(ipc, "EXPORTS", ipc.Exports())
    _torch.device_uuid.cache_clear()
    _triton._import.cache_clear()
    _triton.layout_align_k.cache_clear()
    yield torch, rec
    _torch.device_uuid.cache_clear()
    _triton._import.cache_clear()
    _triton.layout_align_k.cache_clear()


def tensor(torch, rec, *, block_offset, nbytes, shape, strides, offset=0, alloc=None, kind=b"c", version=2):
    alloc = alloc or FakeAllocation(1 << 36, 1 << 26, kind, version)
    return torch.Tensor(FakeStorage(rec, alloc, block_offset, nbytes), shape, strides, offset)


SPEC = Spec("hopper_value", mx_axis=-2, mma_version=3, packing_axis=-2)
PLAN = wprep.Plan((2, 256, 64), (16384, 64, 1), 32768, (2, 256, 64), (16384, 1, 256), 32768, "", None)
PLAN_KEY = (SPEC, (2, 128, 256))


def test_a_slice_inside_a_block_is_its_allocations_handle_plus_both_offsets(fake):
    torch, rec = fake
    src = tensor(torch, rec, block_offset=4096, nbytes=40000, shape=(2, 256, 64), strides=(16384, 64, 1), offset=123)
    out = tensor(torch, rec, block_offset=1 << 20, nbytes=1 << 16, shape=(32768,), strides=(1,), offset=5)
    call = _requests.convert_call(SPEC, [2, 128, 256], src, out, None, None, {}, _torch.Registry(), None)
    r = call.request
    assert r.source_ipc.handle == src.untyped_storage().alloc.handle and len(r.source_ipc.handle) == 64
    assert r.source_ipc.offset == 4096 + 123
    assert r.source_ipc.size == 2 * 256 * 64
    assert list(r.source_ipc.strides) == []  # contiguous: dense
    assert r.source_ipc.device_uuid == bytes(range(16))
    assert r.destination_ipc.offset == (1 << 20) + 5 and r.destination_ipc.size == 32768
    assert list(r.destination_ipc.strides) == []
    # each export's ref counter is released at once; the stream is synchronized once per GPU
    assert rec.shared == 2 and rec.released == [(b"/torch_fake_refs", 1), (b"/torch_fake_refs", 2)]
    assert rec.synced == [0]
    assert src in call.keep and out in call.keep


def test_a_transposed_view_goes_with_its_strides(fake):
    torch, rec = fake
    e, n, k32 = 4, 640, 90
    ckpt = tensor(torch, rec, block_offset=0, nbytes=(e + 1) * n * k32, shape=(e, n, k32), strides=(n * k32, k32, 1),
                  offset=n * k32)
    view = ckpt.transpose(-2, -1)
    b = _torch.source_view(view, _torch.Registry())
    assert list(b.strides) == [n * k32, 1, k32]
    assert b.offset == n * k32
    assert b.size == 1 + (e - 1) * n * k32 + (k32 - 1) * 1 + (n - 1) * k32 == e * n * k32


def test_an_output_is_allocated_from_the_plan_and_viewed_as_reported(fake):
    torch, rec = fake
    src = tensor(torch, rec, block_offset=0, nbytes=32768, shape=(2, 256, 64), strides=(16384, 64, 1))
    call = _requests.convert_call(SPEC, [2, 128, 256], src, None, None, None, {(SPEC, (2, 128, 256)): PLAN},
                                  _torch.Registry(), None)
    assert call.request.destination_ipc.size == PLAN.output_bytes
    resp = wprep.v1.wprep_pb2.ConvertResponse(output_shape=PLAN.output_shape, output_strides=PLAN.output_strides,
                                              output_bytes=PLAN.output_bytes, engine="cuda:GPU-x")
    res = call.finish(resp)
    assert res.data is None and res.tensor.shape == PLAN.output_shape and res.tensor.stride() == PLAN.output_strides


def test_outputs_must_be_dense_and_on_the_sources_gpu(fake):
    torch, rec = fake
    src = tensor(torch, rec, block_offset=0, nbytes=32768, shape=(2, 256, 64), strides=(16384, 64, 1))
    gappy = tensor(torch, rec, block_offset=0, nbytes=1 << 20, shape=(256, 64), strides=(128, 1))
    with pytest.raises(ValueError, match="dense"):
        _requests.convert_call(SPEC, [2, 128, 256], src, gappy, None, None, {}, _torch.Registry(), None)
    other = torch.Tensor(FakeStorage(rec, FakeAllocation(1 << 37, 1 << 20), 0, 32768), (32768,), (1,), 0, device=1)
    with pytest.raises(ValueError, match="share a GPU"):
        _requests.convert_call(SPEC, [2, 128, 256], src, other, None, None, {}, _torch.Registry(), None)
    wide = torch.Tensor(src.untyped_storage(), (2, 256, 64), (16384, 64, 1), 0, itemsize=2)
    with pytest.raises(TypeError, match="one-byte dtype"):
        _requests.convert_call(SPEC, [2, 128, 256], wide, None, None, None, {}, _torch.Registry(), None)


def test_unshareable_and_unknown_handles_are_refused_and_released(fake, monkeypatch):
    torch, rec = fake
    # Kind b"e" whose body is no expandable-segment handle (test_vmm_fake.py sends real ones).
    es = tensor(torch, rec, block_offset=0, nbytes=64, shape=(64,), strides=(1,), kind=b"e")
    with pytest.raises(wprep.ExpandableSegmentsError, match="expandable-segment handle"):
        _torch.source_view(es, _torch.Registry())
    assert len(rec.released) == 1
    # No cuMem export to fall back on below: memory that is not cuMem, or no driver.
    monkeypatch.setattr(wprep._vmm, "export_cumem", lambda *a: (_ for _ in ()).throw(OSError("no libcuda.so.1")))
    odd = tensor(torch, rec, block_offset=0, nbytes=64, shape=(64,), strides=(1,), version=9)
    with pytest.raises(RuntimeError, match="version byte 09"):
        _torch.source_view(odd, _torch.Registry())
    assert len(rec.released) == 2

    def refuse():
        raise RuntimeError("Tensors allocated with expandable_segments:True cannot be shared between processes")

    es2 = tensor(torch, rec, block_offset=0, nbytes=64, shape=(64,), strides=(1,))
    es2.untyped_storage()._share_cuda_ = refuse
    with pytest.raises(wprep.ExpandableSegmentsError):
        _torch.source_view(es2, _torch.Registry())


def test_older_torch_handles_without_a_version_byte(fake):
    assert _torch.decode_handle(bytes(range(64))) == bytes(range(64))
    assert _torch.decode_handle(b"\x01c" + bytes(range(64))) == bytes(range(64))


def test_registered_storages_are_exported_once(fake):
    torch, rec = fake
    reg = _torch.Registry()
    pool = tensor(torch, rec, block_offset=512, nbytes=1 << 20, shape=(1 << 20,), strides=(1,))
    refs = _torch.handle_refs([pool, pool.as_strided((100,), (1,), 1000)], reg, register=True)
    assert len(refs) == 1 and rec.shared == 1
    for i in range(3):
        b = _torch.source_view(pool.as_strided((10, 10), (10, 1), 4096 * i), reg)
        assert b.offset == 512 + 4096 * i
    assert rec.shared == 1
    _torch.handle_refs([pool], reg, register=False)
    assert reg.lookup(pool.untyped_storage(), 0) is None


class FakeDriver:
    """The driver's view of the fake allocations: a unique id each (never reused) and the start."""

    def __init__(self):
        self.allocs = []  # (FakeAllocation, id)
        self.asked = 0

    def add(self, alloc):
        self.allocs.append((alloc, len(self.allocs) + 1))
        return alloc

    def __call__(self, ptr):
        self.asked += 1
        for alloc, ident in reversed(self.allocs):  # the newest allocation at an address wins
            if alloc.base <= ptr < alloc.base + alloc.size:
                return ident, alloc.base
        return None


def test_one_export_serves_every_storage_of_an_allocation(fake, monkeypatch):
    torch, rec = fake
    driver = FakeDriver()
    monkeypatch.setattr(ipc, "allocation_of", driver)
    seg = driver.add(FakeAllocation(1 << 36, 1 << 26))
    a = tensor(torch, rec, alloc=seg, block_offset=4096, nbytes=1 << 16, shape=(256, 256), strides=(256, 1))
    b = tensor(torch, rec, alloc=seg, block_offset=1 << 20, nbytes=1 << 16, shape=(256, 256), strides=(1, 256),
               offset=7)
    va = _torch.source_view(a, _torch.Registry())
    vb = _torch.source_view(b, _torch.Registry())
    assert rec.shared == 1, "the second storage of the allocation was exported again"
    assert va.handle == vb.handle == seg.handle
    assert (va.offset, vb.offset) == (4096, (1 << 20) + 7)  # what _share_cuda_ would have said
    assert vb.strides == (1, 256) and vb.device_uuid == va.device_uuid
    out = _torch.destination_view(tensor(torch, rec, alloc=seg, block_offset=1 << 24, nbytes=4096, shape=(4096,),
                                         strides=(1,)), _torch.Registry())
    assert rec.shared == 1 and out.offset == 1 << 24
    # Freed and made again at the same address: a new allocation id, so a new export.
    again = driver.add(FakeAllocation(1 << 36, 1 << 26))
    again.handle = bytes(64 - i for i in range(64))
    c = tensor(torch, rec, alloc=again, block_offset=4096, nbytes=1 << 16, shape=(256, 256), strides=(256, 1))
    assert _torch.source_view(c, _torch.Registry()).handle == again.handle and rec.shared == 2
    # Where torch's offset is not the driver's (another allocator), nothing is reused.
    odd = driver.add(FakeAllocation(1 << 37, 1 << 20))
    d = tensor(torch, rec, alloc=odd, block_offset=512, nbytes=1024, shape=(1024,), strides=(1,))
    d.untyped_storage().data_ptr = lambda: odd.base + 600
    _torch.source_view(d, _torch.Registry())
    _torch.source_view(d, _torch.Registry())
    assert rec.shared == 4
    # the exports are bounded, oldest first
    small = ipc.Exports()
    small.CAPACITY = 2
    for k in range(3):
        small.add((0, k), b"h", b"u")
    assert small.lookup((0, 0)) is None and small.lookup((0, 2)) == (b"h", b"u")


def test_without_the_driver_each_storage_is_exported(fake):
    torch, rec = fake
    seg = FakeAllocation(1 << 36, 1 << 26)
    for k in range(3):
        _torch.source_view(tensor(torch, rec, alloc=seg, block_offset=k << 16, nbytes=4096, shape=(4096,),
                                  strides=(1,)), _torch.Registry())
    assert rec.shared == 3


def test_the_drop_in_asks_for_the_loaders_layouts(fake):
    torch, rec = fake
    e, n, k = 2, 256, 512
    alloc = FakeAllocation(1 << 38, 1 << 24)
    values = torch.Tensor(FakeStorage(rec, alloc, 0, e * n * k // 2), (e, n, k // 2), (n * k // 2, k // 2, 1), 0)
    scales = torch.Tensor(FakeStorage(rec, alloc, 1 << 20, e * n * k // 32), (e, n, k // 32), (n * k // 32, k // 32, 1), 0)
    hopper = wprep.mxfp4_specs((9, 0), 4)
    assert hopper == (Spec("hopper_value", mx_axis=-2, mma_version=3, packing_axis=-2),
                      Spec("hopper_scale", mx_axis=-2, num_warps=4))
    assert wprep.mxfp4_specs((10, 0)) == (Spec("blackwell_value", packing_axis=-2), Spec("blackwell_scale"))
    with pytest.raises(ValueError, match="sm_80"):
        wprep.mxfp4_specs((8, 0))
    from wprep._mxfp4 import _check_pair, _items

    _check_pair(-1, values, scales)
    v, s = _items(values, scales, hopper, None)
    assert list(v.logical_shape) == [e, k, n] and v.source is values
    assert list(s.logical_shape) == [e, k // 32, n] and s.source.stride() == (n * k // 32, 1, k // 32)
    bad = torch.Tensor(scales.untyped_storage(), (e, n, 15), (n * 15, 15, 1), 0)
    with pytest.raises(ValueError, match=r"scales must be \[2, 256, 16\]"):
        _check_pair(-1, values, bad)


class StubClient:
    """Takes the drop-in's ConvertBatch items and answers with placeholder outputs."""

    def __init__(self):
        self.items = None
        self.planned = []

    def _plans_for(self, keys, timeout):
        out = {}
        for spec, shape in keys:
            self.planned.append((spec, tuple(shape)))
            n = 1
            for d in shape:
                n *= d
            dense = tuple(int(np_prod(shape[i + 1:])) for i in range(len(shape)))
            out[(spec, tuple(shape))] = wprep.Plan(tuple(shape), dense, n, tuple(shape), dense, n + 3, "", None)
        return out

    def convert_batch(self, items, stream=None, completion="stream"):
        self.items = items
        out = []
        for it in items:
            ident = wprep.LayoutIdentity(layout=_spec_identity(it.spec), conversion="", contract_version=1)
            out.append(types.SimpleNamespace(tensor=object(), identity=ident, kernel_seconds=0.0))
        return out


def np_prod(dims):
    n = 1
    for d in dims:
        n *= d
    return n


def _spec_identity(spec):
    if spec.layout.value == "hopper_value":
        return "HopperMXValueLayout(mx_axis=-2, mma_version=3)"
    return f"HopperMXScaleLayout(mx_axis=-2, num_warps={spec.num_warps})"


def _gpt_oss_pair(torch, rec, e=2, n=256, k=2880):
    alloc = FakeAllocation(1 << 38, 1 << 26)
    values = torch.Tensor(FakeStorage(rec, alloc, 0, e * n * k // 2), (e, n, k // 2), (n * k // 2, k // 2, 1), 0)
    scales = torch.Tensor(FakeStorage(rec, alloc, 1 << 24, e * n * k // 32), (e, n, k // 32),
                          (n * k // 32, k // 32, 1), 0)
    return values, scales


def test_the_drop_in_pads_the_scale_groups_by_default_and_not_on_request(fake):
    torch, rec = fake
    values, scales = _gpt_oss_pair(torch, rec)  # K = 2880: 90 groups
    stub = StubClient()
    r = wprep.swizzle_mxfp4(values, scales, 8, client=stub, triton=False)
    assert stub.items[1].spec == Spec("hopper_scale", mx_axis=-2, num_warps=8, align_k=4)
    assert stub.items[1].spec.to_proto().hopper_scale.align_k == 4
    assert r.triton_error == "not asked for (triton=False)"
    wprep.swizzle_mxfp4(values, scales, 8, client=stub, triton=False, pad_scales=True)
    assert stub.items[1].spec.align_k == 4
    wprep.swizzle_mxfp4(values, scales, 8, client=stub, triton=False, pad_scales=False)
    assert stub.items[1].spec == Spec("hopper_scale", mx_axis=-2, num_warps=8)
    assert not stub.items[1].spec.to_proto().hopper_scale.HasField("align_k")
    # the values and the scales' view are the same either way: only the padding differs
    assert stub.items[0].spec == Spec("hopper_value", mx_axis=-2, mma_version=3, packing_axis=-2)
    assert list(stub.items[1].logical_shape) == [2, 90, 256] and stub.items[1].source.stride() == (256 * 90, 1, 90)


def test_a_projections_outputs_share_one_allocation_planned_once_per_shape(fake):
    torch, rec = fake
    w13 = _gpt_oss_pair(torch, rec, n=512)
    w2 = _gpt_oss_pair(torch, rec, n=256)
    stub = StubClient()
    wprep.swizzle_mxfp4_batch([w13, w2], 8, client=stub, triton=False)
    first = list(stub.planned)
    assert len(first) == 4  # two shapes, each pair's values and scales
    outs = [it.out for it in stub.items]
    for vo, so in (outs[0:2], outs[2:4]):
        assert vo.untyped_storage() is so.untyped_storage(), "a projection's outputs are one allocation"
        assert vo.storage_offset() == 0 and so.storage_offset() % 512 == 0
        vbytes = np_prod(vo.shape) + 3  # the stub's plan: output_bytes = elements + 3
        assert so.storage_offset() == -(-vbytes // 512) * 512
        assert so.untyped_storage().nbytes() == so.storage_offset() + np_prod(so.shape) + 3
    assert outs[0].untyped_storage() is not outs[2].untyped_storage()
    # the scales' plan is asked for their [E, K/32, N] view, as the stub echoes it
    assert tuple(outs[1].shape) == (2, 90, 512) and stub.items[1].spec.align_k == 4
    # The next layer of the same shapes asks for no plan.
    wprep.swizzle_mxfp4_batch([_gpt_oss_pair(torch, rec, n=512), _gpt_oss_pair(torch, rec, n=256)], 8, client=stub,
                              triton=False)
    assert stub.planned == first
    # A given out= is used as it is, with no plan.
    vo, so = object(), object()
    wprep.swizzle_mxfp4(*w13, 8, client=stub, triton=False, out=(vo, so))
    assert stub.items[0].out is vo and stub.items[1].out is so and stub.planned == first


def test_blackwell_pads_nothing_more(fake, monkeypatch):
    torch, rec = fake
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    from wprep import _mxfp4

    _mxfp4._capability.cache_clear()
    try:
        values, scales = _gpt_oss_pair(torch, rec)
        stub = StubClient()
        for pad in (None, True, False):
            wprep.swizzle_mxfp4(values, scales, client=stub, triton=False, pad_scales=pad)
            assert stub.items[1].spec == Spec("blackwell_scale")
    finally:
        _mxfp4._capability.cache_clear()


def _fake_triton(monkeypatch, new_api, own_align_k=None):
    @dataclasses.dataclass
    class Storage:
        data: object
        layout: object = None

    @dataclasses.dataclass
    class Tensor:
        storage: Storage
        dtype: object = None
        shape: list = None
        shape_max: list = None

    FP4 = "FP4"

    def wrap_torch_tensor(t, dtype=None):
        shape = list(t.shape)
        shape[list(t.stride()).index(1)] *= 2 if dtype == FP4 else 1
        return Tensor(Storage(t), dtype or t.dtype, shape, list(shape))

    @dataclasses.dataclass(frozen=True)
    class HopperMXValueLayout:
        mx_axis: int
        mma_version: int

    @dataclasses.dataclass(frozen=True)
    class HopperMXScaleLayout:
        mx_axis: int
        num_warps: int

    class OldHopperMXValueLayout:
        def __init__(self, shape, mx_axis, mma_version=3):
            self.shape, self.mx_axis, self.mma_version = shape, mx_axis, mma_version

    OldHopperMXValueLayout.__name__ = "HopperMXValueLayout"

    class OldHopperMXScaleLayout:
        def __init__(self, shape, mx_axis, num_warps=8):
            self.shape, self.mx_axis, self.num_warps = shape, mx_axis, num_warps

    OldHopperMXScaleLayout.__name__ = "HopperMXScaleLayout"

    if new_api:
        def mv(mx_axis):
            return HopperMXValueLayout(mx_axis=mx_axis, mma_version=3)

        def ms(mx_axis, num_warps=8):
            return HopperMXScaleLayout(mx_axis=mx_axis, num_warps=num_warps)
    else:
        def mv(mx_axis):
            return OldHopperMXValueLayout, {"mx_axis": mx_axis}

        def ms(mx_axis, num_warps=8):
            return OldHopperMXScaleLayout, {"mx_axis": mx_axis, "num_warps": num_warps}

    tk = types.ModuleType("triton_kernels")
    tensor_mod = types.ModuleType("triton_kernels.tensor")
    tensor_mod.FP4, tensor_mod.Storage, tensor_mod.Tensor, tensor_mod.wrap_torch_tensor = FP4, Storage, Tensor, wrap_torch_tensor
    details = types.ModuleType("triton_kernels.tensor_details")
    layout_mod = types.ModuleType("triton_kernels.tensor_details.layout")
    layout_mod.make_default_matmul_mxfp4_w_layout = mv
    layout_mod.make_default_matmul_mxfp4_w_scale_layout = ms
    if own_align_k is not None:  # swizzle_data's storage: [..., rows/32, 32 * padded groups]
        class Transform:
            def __init__(self, shape):
                self.shape = shape

            def swizzle_data(self, data):
                groups = -(-self.shape[-1] // own_align_k) * own_align_k
                return types.SimpleNamespace(shape=(*self.shape[:-2], -(-self.shape[-2] // 32), 32 * groups))

        @dataclasses.dataclass(frozen=True)
        class MeasuredHopperMXScaleLayout:
            mx_axis: int
            num_warps: int

            def make_transformation(self, shape):
                return Transform(shape)

        layout_mod.HopperMXScaleLayout = MeasuredHopperMXScaleLayout
    details.layout = layout_mod
    for name, m in (("triton_kernels", tk), ("triton_kernels.tensor", tensor_mod),
                    ("triton_kernels.tensor_details", details), ("triton_kernels.tensor_details.layout", layout_mod)):
        monkeypatch.setitem(sys.modules, name, m)
    return Tensor, Storage


@pytest.mark.parametrize("new_api", [True, False])
def test_triton_tensors_are_built_as_convert_layout_builds_them(fake, monkeypatch, new_api):
    torch, rec = fake
    Tensor, Storage = _fake_triton(monkeypatch, new_api)
    e, n, k = 2, 256, 512
    alloc = FakeAllocation(1 << 38, 1 << 24)
    values = torch.Tensor(FakeStorage(rec, alloc, 0, e * n * k // 2), (e, n, k // 2), (n * k // 2, k // 2, 1), 0)
    scales = torch.Tensor(FakeStorage(rec, alloc, 1 << 20, e * n * k // 32), (e, n, k // 32), (n * k // 32, k // 32, 1), 0)
    vo, so = object(), object()
    tv, ts = _triton.build(values, scales, vo, so, "HopperMXValueLayout(mx_axis=-2, mma_version=3)",
                           "HopperMXScaleLayout(mx_axis=-2, num_warps=4)", 4)
    assert isinstance(tv, Tensor) and tv.storage.data is vo and ts.storage.data is so
    assert tv.dtype == "FP4" and tv.shape == [e, k, n] and tv.shape_max == [e, k, n]
    assert ts.shape == [e, k // 32, n]
    if new_api:
        lay = tv.storage.layout
        assert type(lay).__name__ == "HopperMXValueLayout" and (lay.mx_axis, lay.mma_version) == (-2, 3)
    else:  # LayoutClass(storage shape, non-negative mx_axis), as the old convert_layout makes it
        assert list(tv.storage.layout.shape) == [e, k // 2, n] and tv.storage.layout.mx_axis == 1
        assert list(ts.storage.layout.shape) == [e, k // 32, n] and ts.storage.layout.num_warps == 4
    with pytest.raises(_triton.TritonUnavailable, match="default layout for this GPU"):
        _triton.build(values, scales, vo, so, "BlackwellMXValueLayout()", "BlackwellMXScaleLayout()", 4)


def test_padded_scales_make_the_tensor_the_loader_padded(fake, monkeypatch):
    torch, rec = fake
    Tensor, _ = _fake_triton(monkeypatch, True)
    values, scales = _gpt_oss_pair(torch, rec)
    vo, so = object(), object()
    tv, ts = _triton.build(values, scales, vo, so, "HopperMXValueLayout(mx_axis=-2, mma_version=3)",
                           "HopperMXScaleLayout(mx_axis=-2, num_warps=8)", 8, scale_groups=92)
    # vLLM wraps the zero-padded [E, 92, N] view: its Tensor says 92 groups
    assert ts.shape == [2, 92, 256] and ts.shape_max == [2, 92, 256] and ts.storage.data is so
    assert tv.shape == [2, 2880, 256]
    # through the drop-in: the default pads, and the Tensor follows
    r = wprep.swizzle_mxfp4(values, scales, 8, client=StubClient(), triton=True)
    assert r.triton_scales.shape == [2, 92, 256]
    r = wprep.swizzle_mxfp4(values, scales, 8, client=StubClient(), triton=True, pad_scales=False)
    assert r.triton_scales.shape == [2, 90, 256]


@pytest.mark.parametrize("own", [2, 4, 8])
def test_a_triton_kernels_that_pads_the_groups_itself_is_followed(fake, monkeypatch, own):
    torch, rec = fake
    monkeypatch.setattr(torch, "zeros", lambda shape, dtype=None: ("zeros", tuple(shape)), raising=False)
    _fake_triton(monkeypatch, True, own_align_k=own)
    from wprep._mxfp4 import scale_align_k

    assert _triton.layout_align_k() == own  # measured on a tiny tensor, once
    assert scale_align_k(None) == scale_align_k(True) == max(4, own)
    assert scale_align_k(False) == own  # the unpadded form is what convert_layout alone gives
    values, scales = _gpt_oss_pair(torch, rec)
    stub = StubClient()
    r = wprep.swizzle_mxfp4(values, scales, 8, client=stub, triton=True)
    assert stub.items[1].spec.align_k == (None if max(4, own) == 2 else max(4, own))
    # a layout that pads to 4 or more itself took the loader's unpadded tensor
    assert r.triton_scales.shape == ([2, 92, 256] if own < 4 else [2, 90, 256])
    stub = StubClient()
    wprep.swizzle_mxfp4(values, scales, 8, client=stub, triton=False, pad_scales=False)
    assert stub.items[1].spec.align_k == (None if own == 2 else own)


def test_an_unknown_triton_kernels_layout_api_counts_as_the_upstream_padding(fake, monkeypatch):
    _fake_triton(monkeypatch, True)  # no HopperMXScaleLayout to measure
    assert _triton.layout_align_k() is None
    from wprep._mxfp4 import scale_align_k

    assert scale_align_k(None) == 4 and scale_align_k(False) == 2


def test_triton_unavailable_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_kernels", None)
    _triton._import.cache_clear()
    try:
        with pytest.raises(_triton.TritonUnavailable, match="not importable"):
            _triton.build(None, None, None, None, "", "", 8)
    finally:
        _triton._import.cache_clear()


def test_uuid_strings(fake):
    assert _requests.uuid_bytes("GPU-00010203-0405-0607-0809-0a0b0c0d0e0f") == bytes(range(16))
    d = wprep.Device(bytes(range(16)), "x", 0, (9, 0), 0, True, 4, 0, 0)
    assert d.uuid_string == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    with pytest.raises(ValueError, match="16 bytes"):
        _requests.uuid_bytes(b"short")


def test_stream_completion_sends_a_pooled_event_and_waits_on_it_after_the_answer(fake):
    torch, rec = fake
    dev = 3
    alloc = FakeAllocation(1 << 39, 1 << 24)

    def item(k):
        src = torch.Tensor(FakeStorage(rec, alloc, k << 16, 32768), (2, 256, 64), (16384, 64, 1), 0, dev)
        out = torch.Tensor(FakeStorage(rec, alloc, (k << 16) + 32768, 32768), (32768,), (1,), 0, dev)
        return wprep.Item(SPEC, [2, 128, 256], src, out=out)

    pool = _torch.EventPool()
    call = _requests.batch_call([item(0), item(1)], None, {}, _torch.Registry(), None, "stream", pool)
    assert call.request.answer_when == pb.ANSWER_WHEN_QUEUED
    assert len(call.request.signal_when_done) == 1
    ev = call.request.signal_when_done[0].event
    assert len(ev.handle) == 64 and ev.handle[1] == dev, "the event is made on the items' device"
    assert ev.device_uuid == bytes((dev * 16 + k) & 255 for k in range(16))
    assert rec.waits == []
    # Ordered on the GPU both ways with one event: recorded on the device's current stream
    # before sending (the daemon waits for it there), and no host synchronization.
    assert call.request.wait_for.event == ev
    assert len(rec.records) == 1 and rec.records[0][0] == dev and rec.records[0][1].ipc_handle() == ev.handle
    assert rec.synced == [], "completion='stream' made the host wait for the stream"
    def resp_of(n):
        resp = pb.ConvertBatchResponse()
        for _ in range(n):
            o = resp.items.add().outputs.add()
            o.shape.extend([32768])
            o.strides.extend([1])
            o.bytes = 32768
        return resp

    call.complete(resp_of(2))
    assert len(rec.waits) == 1 and rec.waits[0][0] == dev and rec.waits[0][1].ipc_handle() == ev.handle
    # The event went back to the pool: the next call on the device reuses it.
    again = _requests.batch_call([item(2)], None, {}, _torch.Registry(), None, "stream", pool)
    assert again.request.signal_when_done[0].event.handle == ev.handle
    # A call that failed without an answer (a deadline): the daemon may still record its
    # event, so it is never handed to another call.
    again.fail()
    assert len(rec.waits) == 1
    third = _requests.batch_call([item(3)], None, {}, _torch.Registry(), None, "stream", pool)
    assert third.request.signal_when_done[0].event.handle != ev.handle
    third.complete(resp_of(1))
    fourth = _requests.batch_call([item(4)], None, {}, _torch.Registry(), None, "stream", pool)
    assert fourth.request.signal_when_done[0].event.handle == third.request.signal_when_done[0].event.handle
    # host completion sends no event
    host = _requests.batch_call([item(5)], None, {}, _torch.Registry(), None, "host", pool)
    assert not host.request.HasField("wait_for") and not host.request.signal_when_done
    assert host.request.answer_when == pb.ANSWER_WHEN_DONE
    assert rec.synced == [dev], "completion='host' synchronizes the stream before sending"
    assert len(rec.records) == 4


def test_stream_completion_refuses_host_items_and_two_gpus(fake):
    torch, rec = fake
    import numpy as np

    pool = _torch.EventPool()
    with pytest.raises(ValueError, match=r"items\[0\]: completion='stream' needs a CUDA tensor"):
        _requests.batch_call([wprep.Item(SPEC, [2, 128, 256], np.zeros(32768, np.uint8))], None, {PLAN_KEY: PLAN},
                             _torch.Registry(), None, "stream", pool)
    alloc = FakeAllocation(1 << 39, 1 << 24)
    items = []
    for d in (0, 1):
        src = torch.Tensor(FakeStorage(rec, alloc, d << 16, 32768), (2, 256, 64), (16384, 64, 1), 0, d)
        out = torch.Tensor(FakeStorage(rec, alloc, (d << 16) + 32768, 32768), (32768,), (1,), 0, d)
        items.append(wprep.Item(SPEC, [2, 128, 256], src, out=out))
    with pytest.raises(ValueError, match=r"items\[1\]: completion='stream' orders one GPU's work"):
        _requests.batch_call(items, None, {}, _torch.Registry(), None, "stream", pool)
    with pytest.raises(ValueError, match="completion must be one of"):
        _requests.batch_call(items[:1], None, {}, _torch.Registry(), None, "soon", pool)


class FakeWords:
    """completion='async' with the real /dev/shm pages, and the driver's stream operations
    (cudaHostRegister, cuMemHostGetDevicePointer, cuStreamWriteValue32, cuStreamWaitValue32)
    recorded instead of called."""

    def __init__(self, torch, monkeypatch):
        self.ops = []
        torch.cuda.cudart = lambda: types.SimpleNamespace(cudaHostRegister=lambda addr, size, flags: 0)
        monkeypatch.setattr(_torch.FlagPool, "_device_ptr", staticmethod(lambda page, d: page.addr))
        def write(pool, f, stream, d):  # the stream runs at once: it writes the word
            self.ops.append(("write", stream.d, f.page.name, f.offset, f.value))
            f.write(f.value)

        monkeypatch.setattr(_torch.FlagPool, "enqueue_write", write)
        monkeypatch.setattr(_torch.FlagPool, "enqueue_wait",
                            lambda pool, f, stream, d: self.ops.append(("wait", stream.d, f.page.name, f.offset, f.value)))

    @staticmethod
    def word(name, offset):
        """The word as another process sees it: read from the file."""
        with open(f"/dev/shm/{name}", "rb") as f:
            f.seek(offset)
            return int.from_bytes(f.read(4), "little")


def _ipc_item(torch, rec, k, dev=0):
    alloc = FakeAllocation(1 << 39, 1 << 24)
    src = torch.Tensor(FakeStorage(rec, alloc, k << 16, 32768), (2, 256, 64), (16384, 64, 1), 0, dev)
    out = torch.Tensor(FakeStorage(rec, alloc, (k << 16) + 32768, 32768), (32768,), (1,), 0, dev)
    return wprep.Item(SPEC, [2, 128, 256], src, out=out)


def test_async_completion_orders_the_stream_with_two_words_and_a_refusal_releases_it(fake, monkeypatch, daemon):
    # The real daemon (CPU engine) refuses CUDA IPC items: the refusal comes back on the
    # ordered stream after the call has returned, the client's CPU writes the done word (in
    # the shared file, where the caller's stream waits for it), and the error is raised by
    # wait_async() and, for a later refusal, by the next async call.
    torch, rec = fake
    words = FakeWords(torch, monkeypatch)
    with wprep.Client(daemon.target, timeout=30) as c:
        r = c.convert_batch([_ipc_item(torch, rec, 0), _ipc_item(torch, rec, 1)], completion="async")
        # Returned before the answer, with the daemon's Plan of each output.
        plan = c.plan(SPEC, [2, 128, 256])
        assert [(x.shape, x.strides, x.nbytes) for x in r] == [(plan.output_shape, plan.output_strides,
                                                                plan.output_bytes)] * 2
        assert r[0].tensor.shape == plan.output_shape and r[0].kernel_seconds == 0.0
        # The current stream writes the ready word, then waits for the done word; no event, no host wait.
        (w_op, w_dev, w_name, w_off, w_val), (d_op, d_dev, d_name, d_off, d_val) = words.ops
        assert (w_op, d_op, w_dev, d_dev) == ("write", "wait", 0, 0)
        assert rec.records == [] and rec.synced == [] and rec.waits == []
        assert (w_name, w_off) != (d_name, d_off)
        with pytest.raises(WprepError) as e:
            c.wait_async(30)
        assert e.value.code != grpc.StatusCode.OK and e.value.method == "ConvertBatches"
        assert "items[0]" in e.value.details, e.value.details
        assert FakeWords.word(d_name, d_off) == d_val, "the refusal left the caller's stream waiting"
        c.wait_async(30)  # raised once
        # A refusal nobody waited for is raised by the next async call, before it sends anything.
        c.convert_batch([_ipc_item(torch, rec, 2)], completion="async")
        assert c._stream.wait(30)
        sent = len(words.ops)
        with pytest.raises(WprepError) as later:
            c.convert_batch([_ipc_item(torch, rec, 3)], completion="async")
        assert "items[0]" in later.value.details and len(words.ops) == sent
        # A refused batch's words go back to the pool (answered, and holding their values).
        by_place = {(f.page.name, f.offset): f for f in c._flags._words}
        for op in words.ops:
            f = by_place[(op[2], op[3])]
            assert not f.in_use and not f.retired and _torch.reached(f.read(), f.value), op


def test_auto_completion_raises_the_first_calls_refusal_itself_and_stays_undecided(fake, monkeypatch, daemon):
    # Before an auto call has succeeded, each is sent async and waits for its own answer: the
    # CPU engine refuses CUDA IPC items, so the call raises that refusal itself (nothing is
    # left for a later call), the done word is released, and the Client has not decided.
    torch, rec = fake
    words = FakeWords(torch, monkeypatch)
    with wprep.Client(daemon.target, timeout=30) as c:
        for k in range(2):
            with pytest.raises(WprepError) as e:
                c.convert_batch([_ipc_item(torch, rec, k)], completion="auto")
            assert e.value.method == "ConvertBatches" and "items[0]" in e.value.details, e.value
            assert c._auto is None and c._async_errors == []
        ops = [op[0] for op in words.ops]
        assert ops == ["write", "wait"] * 2, ops
        (_, _, name, off, val) = words.ops[-1]
        assert FakeWords.word(name, off) == val, "the refusal left the caller's stream waiting"
        c.wait_async(30)  # raised once, by the call


def test_auto_completion_takes_stream_where_the_driver_cannot_register_host_words(fake, monkeypatch, daemon):
    # cudaHostRegister fails (as on a driver without stream memory operations on host memory):
    # the call warns and goes as completion="stream" (one interprocess event both ways), and so
    # does every later auto call of the Client, without warning again.
    torch, rec = fake
    torch.cuda.cudart = lambda: types.SimpleNamespace(cudaHostRegister=lambda addr, size, flags: 1)
    with wprep.Client(daemon.target, timeout=30) as c:
        with pytest.warns(RuntimeWarning, match="cudaHostRegister"):
            with pytest.raises(WprepError) as e:  # the CPU engine refuses the IPC item, answered at once
                c.convert_batch([_ipc_item(torch, rec, 0)], completion="auto")
        assert e.value.method == "ConvertBatch" and "items[0]" in e.value.details, e.value
        assert c._auto == "stream" and len(rec.records) == 1, rec.records
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(WprepError):
                c.convert_batch([_ipc_item(torch, rec, 1)], completion="auto")
        assert len(rec.records) == 2


def test_an_async_error_is_raised_by_the_next_call_of_any_completion_and_reported_at_exit(fake, monkeypatch, daemon,
                                                                                         capsys):
    torch, rec = fake
    FakeWords(torch, monkeypatch)
    from wprep import _client

    with wprep.Client(daemon.target, timeout=30) as c:
        c.convert_batch([_ipc_item(torch, rec, 0)], completion="async")
        assert c._stream.wait(30)
        with pytest.raises(WprepError) as e:  # a "host" call raises it before sending anything
            c.convert_batch([wprep.Item(SPEC, [2, 128, 256], bytes(32768))], completion="host")
        assert e.value.method == "ConvertBatches" and "items[0]" in e.value.details, e.value
        c.convert_batch([wprep.Item(SPEC, [2, 128, 256], bytes(32768))], completion="host")  # raised once
        # One nobody raised is written to stderr by the exit hook.
        c.convert_batch([_ipc_item(torch, rec, 1)], completion="async")
        assert c in _client._async_clients
        capsys.readouterr()
        _client._report_unraised_async_errors()
        err = capsys.readouterr().err
        assert "no later call raised it" in err and "items[0]" in err, err
        c.wait_async(30)


def _wait_stopped(pid, seconds=30.0):
    """Waits until every thread of `pid` is stopped (a stop signal takes effect thread by thread)."""
    deadline = time.monotonic() + seconds
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue
        if states and all(st in ("T", "t") for st in states):
            return
        assert time.monotonic() < deadline, f"the daemon's threads did not all stop: {states}"
        time.sleep(0.01)


def test_async_completion_releases_the_stream_when_the_daemon_dies(fake, monkeypatch, tmp_path):
    torch, rec = fake
    words = FakeWords(torch, monkeypatch)
    from conftest import wprepd_path
    from wprep.testing import LocalDaemon

    with LocalDaemon(wprepd_path(), ["--devices=cpu", "--cpu-threads=1"]) as d:
        c = wprep.Client(d.target, timeout=30)
        c.convert_batch([_ipc_item(torch, rec, 9)], completion="async")  # the Plan cached, the stream open
        with pytest.raises(WprepError):
            c.wait_async(30)
        words.ops.clear()
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            _wait_stopped(d.proc.pid)  # every thread: until then one may still take the next batch
            c.convert_batch([_ipc_item(torch, rec, 0)], completion="async")
            (_, _, name, off, val), = [op for op in words.ops if op[0] == "wait"]
            time.sleep(0.3)
            # No answer yet: the stream still waits.
            assert FakeWords.word(name, off) != val, (c._async_errors, d.log()[-3000:])
        finally:
            os.kill(d.proc.pid, signal.SIGKILL)
        with pytest.raises(WprepError) as e:
            c.wait_async(30)
        assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
        assert FakeWords.word(name, off) == val, "a lost batch left the caller's stream waiting"
        c.close()
