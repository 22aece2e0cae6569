"""Expandable-segments tensors through every request path, against the stand-in torch of
test_torch_fake.py: a tensor whose storage torch shares with an expandable-segment handle
(kind b"e": pid, chunk size, one descriptor per chunk) goes as a CudaVmmBuffer, a cudaMalloc
one as a legacy handle, in the same request; offsets count from the segment's first chunk;
the parse is cached per segment and a registered storage is exported once. The real
thing runs on a GPU (test_vmm.py, test_gpu_vmm.py)."""

import os
import struct

import grpc
import numpy as np
import pytest

import wprep
from wprep import _quantize, _requests, _torch, trtllm
from wprep._cuda import ipc
from wprep.v1 import wprep_pb2 as pb

from test_torch_fake import PLAN, PLAN_KEY, SPEC, FakeAllocation, FakeStorage, fake  # noqa: F401

MIB = 1 << 20
UUID0 = bytes(range(16))


class FakeSegment(FakeAllocation):
    """An expandable segment: what _share_cuda_ returns after the version byte and kind b"e"
    is ExpandableSegment::share's header and the descriptors of the chunks around the block."""

    def __init__(self, base, fds, segment_size=20 * MIB, pid=None):
        super().__init__(base, segment_size * len(fds), kind=b"e")
        self.fds, self.segment_size = tuple(fds), segment_size
        pid = os.getpid() if pid is None else pid
        self.handle = struct.pack("=i4xQQ", pid, segment_size, len(fds)) + b"".join(struct.pack("=i", f) for f in fds)


def es_tensor(torch, rec, seg, *, block_offset, nbytes, shape, strides, offset=0, device=0):
    return torch.Tensor(FakeStorage(rec, seg, block_offset, nbytes), shape, strides, offset, device)


def legacy_tensor(torch, rec, *, block_offset, nbytes, shape, strides, offset=0):
    alloc = FakeAllocation(1 << 36, 1 << 26)
    return torch.Tensor(FakeStorage(rec, alloc, block_offset, nbytes), shape, strides, offset)


def chunks(b):
    return [(c.fd, c.size) for c in b.vmm.chunks]


def test_an_expandable_source_goes_as_vmm_chunks_and_a_cudamalloc_output_as_a_handle(fake):
    torch, rec = fake
    seg = FakeSegment(1 << 40, fds=(41, 42))
    # The block starts 1 MiB before the end of the first 20 MiB chunk and runs into the second.
    src = es_tensor(torch, rec, seg, block_offset=19 * MIB, nbytes=40000, shape=(2, 256, 64),
                    strides=(16384, 64, 1), offset=123)
    out = legacy_tensor(torch, rec, block_offset=1 << 20, nbytes=1 << 16, shape=(32768,), strides=(1,), offset=5)
    r = _requests.convert_call(SPEC, [2, 128, 256], src, out, None, None, {}, _torch.Registry(), None).request
    s = r.source_ipc
    assert s.HasField("vmm") and s.handle == b""
    assert s.vmm.handle_type == pb.VMM_HANDLE_TYPE_POSIX_FD and s.vmm.pid == os.getpid()
    assert chunks(s) == [(41, 20 * MIB), (42, 20 * MIB)]
    assert s.vmm.granularity == 2 * MIB
    assert s.offset == 19 * MIB + 123 and s.size == 2 * 256 * 64
    assert s.device_uuid == UUID0 and list(s.strides) == []
    d = r.destination_ipc
    assert not d.HasField("vmm") and d.handle == out.untyped_storage().alloc.handle
    assert d.offset == (1 << 20) + 5 and d.size == 32768
    # Both exports' ref counters released at once, as for legacy handles; the stream synchronized.
    assert rec.shared == 2 and len(rec.released) == 2 and rec.synced == [0]
    # What the daemon gets, and what it checks first (offset + size inside the chunks).
    assert pb.ConvertRequest.FromString(r.SerializeToString()) == r
    assert s.offset + s.size <= sum(c.size for c in s.vmm.chunks)


def test_a_strided_view_of_an_expandable_tensor_keeps_its_strides(fake):
    torch, rec = fake
    e, n, k32 = 4, 640, 90
    seg = FakeSegment(1 << 40, fds=(7,), segment_size=2 * MIB)
    ckpt = es_tensor(torch, rec, seg, block_offset=4096, nbytes=e * n * k32, shape=(e, n, k32),
                     strides=(n * k32, k32, 1))
    b = _torch.source_view(ckpt.transpose(-2, -1), _torch.Registry())
    m = pb.CudaIpcBuffer()
    b.fill(m)
    assert chunks(m) == [(7, 2 * MIB)] and m.offset == 4096
    assert list(m.strides) == [n * k32, 1, k32] and m.size == e * n * k32


def test_the_same_segment_names_the_same_descriptors_and_is_parsed_once(fake):
    torch, rec = fake
    seg = FakeSegment(1 << 40, fds=(50, 51, 52))
    reg = _torch.Registry()
    views = [_torch.source_view(es_tensor(torch, rec, seg, block_offset=k * MIB, nbytes=MIB, shape=(MIB,),
                                          strides=(1,)), reg) for k in range(3)]
    # torch exports each chunk once and returns the same handle; the client parses it once.
    assert views[0].vmm is views[1].vmm is views[2].vmm
    assert [v.offset for v in views] == [0, MIB, 2 * MIB]
    assert rec.shared == 3  # not registered: shared (and its counter released) per call, as legacy
    # Another segment: other descriptors, another message.
    other = FakeSegment(1 << 41, fds=(60,))
    v = _torch.source_view(es_tensor(torch, rec, other, block_offset=0, nbytes=64, shape=(64,), strides=(1,)), reg)
    assert v.vmm is not views[0].vmm and [c.fd for c in v.vmm.chunks] == [60]


def test_an_expandable_segment_the_driver_names_as_one_allocation_still_goes_as_vmm(fake, monkeypatch):
    # The client keeps one legacy export per driver allocation; an expandable segment is one
    # allocation to the driver too, and every tensor in it must still go as its chunks (a
    # cached "export" of it would be an empty legacy handle the daemon refuses).
    torch, rec = fake
    seg = FakeSegment(1 << 40, fds=(70, 71))
    monkeypatch.setattr(ipc, "EXPORTS", ipc.Exports())
    monkeypatch.setattr(ipc, "allocation_of",
                        lambda ptr: (99, seg.base) if seg.base <= ptr < seg.base + seg.size else None)
    for k in range(3):
        v = _torch.source_view(es_tensor(torch, rec, seg, block_offset=k * MIB, nbytes=MIB, shape=(MIB,),
                                         strides=(1,)), _torch.Registry())
        assert v.vmm is not None and v.handle == b"", k
        assert [c.fd for c in v.vmm.chunks] == [70, 71] and v.offset == k * MIB


def test_a_registered_expandable_storage_is_exported_once_and_named_by_its_chunks(fake):
    torch, rec = fake
    seg = FakeSegment(1 << 40, fds=(70, 71))
    reg = _torch.Registry()
    pool = es_tensor(torch, rec, seg, block_offset=MIB, nbytes=30 * MIB, shape=(30 * MIB,), strides=(1,))
    legacy = legacy_tensor(torch, rec, block_offset=0, nbytes=4096, shape=(4096,), strides=(1,))
    refs = _torch.handle_refs([pool, pool.as_strided((100,), (1,), 10), legacy], reg, register=True)
    # One ref per allocation: the segment's chunks (RegisterIpcHandles maps them whole), the
    # legacy allocation's handle.
    assert len(refs) == 2 and rec.shared == 2
    assert refs[0].handle == b"" and [(c.fd, c.size) for c in refs[0].vmm.chunks] == [(70, 20 * MIB), (71, 20 * MIB)]
    assert refs[0].vmm.pid == os.getpid() and refs[0].device_uuid == UUID0
    assert not refs[1].HasField("vmm") and refs[1].handle == legacy.untyped_storage().alloc.handle
    for i in range(3):
        b = _torch.source_view(pool.as_strided((10, 10), (10, 1), 4096 * i), reg)
        assert b.vmm is not None and b.offset == MIB + 4096 * i
    assert rec.shared == 2
    released = _torch.handle_refs([pool], reg, register=False)
    assert [r.vmm for r in released] == [refs[0].vmm]
    assert reg.lookup(pool.untyped_storage(), 0) is None


def test_a_batch_mixes_both_kinds_item_by_item(fake):
    torch, rec = fake
    seg = FakeSegment(1 << 40, fds=(80,))
    items = []
    for k in range(2):
        src = es_tensor(torch, rec, seg, block_offset=k << 16, nbytes=32768, shape=(2, 256, 64),
                        strides=(16384, 64, 1))
        out = legacy_tensor(torch, rec, block_offset=k << 16, nbytes=32768, shape=(32768,), strides=(1,))
        items.append(wprep.Item(SPEC, [2, 128, 256], src, out=out))
    # A third item whose output the client allocates (torch.empty: the stand-in's cudaMalloc).
    items.append(wprep.Item(SPEC, [2, 128, 256], es_tensor(torch, rec, seg, block_offset=3 << 16, nbytes=32768,
                                                           shape=(2, 256, 64), strides=(16384, 64, 1))))
    r = _requests.batch_call(items, None, {PLAN_KEY: PLAN}, _torch.Registry(), None).request
    for k, it in enumerate(r.items):
        c = it.convert
        assert c.source.ipc.HasField("vmm") and chunks(c.source.ipc) == [(80, 20 * MIB)]
        assert c.source.ipc.offset == (k if k < 2 else 3) << 16
        assert not c.destination.ipc.HasField("vmm") and len(c.destination.ipc.handle) == 64


def test_the_drop_in_sends_expandable_checkpoint_tensors_as_vmm(fake):
    torch, rec = fake
    from wprep._mxfp4 import _items

    e, n, k = 2, 256, 512
    seg = FakeSegment(1 << 40, fds=(90, 91))
    values = es_tensor(torch, rec, seg, block_offset=0, nbytes=e * n * k // 2, shape=(e, n, k // 2),
                       strides=(n * k // 2, k // 2, 1))
    scales = es_tensor(torch, rec, seg, block_offset=21 * MIB, nbytes=e * n * k // 32, shape=(e, n, k // 32),
                       strides=(n * k // 32, k // 32, 1))
    specs = wprep.mxfp4_specs((9, 0), 4)
    its = _items(values, scales, specs, None)
    plans = {(it.spec, tuple(it.logical_shape)): PLAN for it in its}
    r = _requests.batch_call(its, None, plans, _torch.Registry(), None).request
    v, s = r.items[0].convert, r.items[1].convert
    assert chunks(v.source.ipc) == chunks(s.source.ipc) == [(90, 20 * MIB), (91, 20 * MIB)]
    assert v.source.ipc.offset == 0 and s.source.ipc.offset == 21 * MIB
    assert list(s.source.ipc.strides) == [n * k // 32, 1, k // 32]


def test_quantize_and_trtllm_operands_go_as_vmm(fake, monkeypatch):
    torch, rec = fake
    seg = FakeSegment(1 << 40, fds=(100,))
    reg = _torch.Registry()
    x = es_tensor(torch, rec, seg, block_offset=MIB, nbytes=4096, shape=(4096,), strides=(1,))
    v = legacy_tensor(torch, rec, block_offset=0, nbytes=1024, shape=(1024,), strides=(1,))
    s = es_tensor(torch, rec, seg, block_offset=2 * MIB, nbytes=64, shape=(64,), strides=(1,))
    monkeypatch.setattr(_quantize, "_byte_view", lambda t: t)  # the stand-in has no .view(dtype)
    item = pb.QuantizeItem()
    _quantize._fill_cuda(item, x, [v, s], reg)
    assert chunks(item.source.ipc) == [(100, 20 * MIB)] and item.source.ipc.offset == MIB
    assert not item.values.ipc.HasField("vmm") and len(item.values.ipc.handle) == 64
    assert chunks(item.scales.ipc) == [(100, 20 * MIB)] and item.scales.ipc.offset == 2 * MIB

    # trtllm reads a contiguous tensor's bytes without views; the stand-in's dtype is a string.
    monkeypatch.setattr(trtllm, "_dtype_of_tensor", lambda name, t: pb.MOE_DTYPE_UINT8)
    m = trtllm._ipc_item("row_shuffle", [("x", x)], {"epilogue_tile_m": 128}, [s], reg)
    assert chunks(m.inputs[0].source.ipc) == [(100, 20 * MIB)] and m.inputs[0].source.ipc.offset == MIB
    assert chunks(m.outputs[0].destination.ipc) == [(100, 20 * MIB)]


def test_what_cannot_be_shared_still_says_what_to_do(fake, monkeypatch):
    torch, rec = fake
    # Another process's segment (a storage received from it): its descriptors are not ours.
    theirs = FakeSegment(1 << 40, fds=(5,), pid=os.getpid() + 1)
    t = es_tensor(torch, rec, theirs, block_offset=0, nbytes=64, shape=(64,), strides=(1,))
    with pytest.raises(wprep.ExpandableSegmentsError, match="not this one"):
        _torch.source_view(t, _torch.Registry())
    assert len(rec.released) == 1
    # A torch that refuses expandable segments outright, and memory the driver cannot export
    # (here: no driver at all).
    monkeypatch.setattr(ipc._vmm, "export_cumem", lambda *a: (_ for _ in ()).throw(OSError("no libcuda.so.1")))

    def refuse():
        raise RuntimeError("Tensors allocated with expandable_segments:True cannot be shared between processes")

    t2 = legacy_tensor(torch, rec, block_offset=0, nbytes=64, shape=(64,), strides=(1,))
    t2.untyped_storage()._share_cuda_ = refuse
    with pytest.raises(wprep.ExpandableSegmentsError, match="expandable_segments:False"):
        _torch.source_view(t2, _torch.Registry())


def test_memory_torch_will_not_share_goes_through_the_driver_when_it_is_cumem(fake, monkeypatch):
    torch, rec = fake
    calls = []

    def export(ptr, nbytes, uuid):
        calls.append((ptr, nbytes))
        return wprep._vmm.vmm_buffer(pid=os.getpid(), chunk_sizes=[2 * MIB, 2 * MIB], offset=ptr - (1 << 38),
                                     size=nbytes, device_uuid=uuid, fds=[33, 34])

    monkeypatch.setattr(ipc._vmm, "export_cumem", export)

    def refuse():
        raise RuntimeError("CUDAPluggableAllocator does not yet support shareIPCHandle")

    pool = FakeAllocation(1 << 38, 4 * MIB)
    t = torch.Tensor(FakeStorage(rec, pool, 3 * MIB, 4096), (4096,), (1,), 7)
    t.untyped_storage()._share_cuda_ = refuse
    b = _torch.source_view(t, _torch.Registry())
    assert calls == [((1 << 38) + 3 * MIB, 4096)]
    assert [c.fd for c in b.vmm.chunks] == [33, 34] and b.offset == 3 * MIB + 7 and b.device_uuid == UUID0


class FakeDriver:
    """cuMemGetAddressRange / cuMemRetainAllocationHandle / cuMemExportToShareableHandle over
    a table of mapped chunks {base: (size, allocation handle)}; exports are pipes' fds."""

    def __init__(self, mapped):
        self.mapped, self.exports = mapped, []

    def _chunk(self, at):
        for base, (size, h) in self.mapped.items():
            if base <= at < base + size:
                return base, size, h
        return None

    def range(self, base_p, size_p, at):
        c = self._chunk(at)
        if c is None:
            return 1
        base_p._obj.value, size_p._obj.value = c[0], c[1]
        return 0

    def retain(self, h_p, addr):
        c = self._chunk(addr.value)
        if c is None:
            return 1
        h_p._obj.value = c[2]
        return 0

    def release(self, h):
        return 0

    def export(self, fd_p, h, kind, flags):
        r, w = os.pipe()
        os.close(w)
        self.exports.append(h)
        fd_p._obj.value = r
        return 0


def test_cumem_exports_are_kept_per_chunk_and_redone_when_the_chunk_changes(monkeypatch):
    from wprep import _vmm

    drv = FakeDriver({1 << 30: (2 * MIB, 11), (1 << 30) + 2 * MIB: (2 * MIB, 12)})
    monkeypatch.setattr(_vmm, "_drv", lambda: drv)
    monkeypatch.setattr(_vmm, "_exported", {})
    a = _vmm.export_cumem((1 << 30) + MIB, 2 * MIB, UUID0)
    assert [c.size for c in a.vmm.chunks] == [2 * MIB, 2 * MIB] and a.offset == MIB and drv.exports == [11, 12]
    b = _vmm.export_cumem((1 << 30) + 3 * MIB, 4096, UUID0)
    assert drv.exports == [11, 12], "the second chunk was exported again"
    assert [c.fd for c in b.vmm.chunks] == [a.vmm.chunks[1].fd] and b.offset == MIB
    # The second chunk unmapped and another allocation mapped at its address: a new export,
    # and the old descriptor closed.
    old = a.vmm.chunks[1].fd
    drv.mapped[(1 << 30) + 2 * MIB] = (2 * MIB, 13)
    c = _vmm.export_cumem((1 << 30) + 2 * MIB, 16, UUID0)
    assert drv.exports == [11, 12, 13]
    with pytest.raises(OSError):
        os.fstat(old)
    for base in list(_vmm._exported):
        _vmm.forget_cumem(base)
    with pytest.raises(OSError):
        os.fstat(c.vmm.chunks[0].fd)


@pytest.fixture(scope="module")
def tcp_daemon():
    from conftest import wprepd_path
    from wprep.testing import LocalDaemon

    with LocalDaemon(wprepd_path(), ["--devices=cpu", "--cpu-threads=1", "--listen=127.0.0.1:0"]) as d:
        assert d.tcp_targets, d.log()
        yield d


def test_a_daemon_that_cannot_take_the_descriptors_answers_an_actionable_error(fake, tcp_daemon):
    torch, rec = fake
    seg = FakeSegment(1 << 40, fds=(3,), segment_size=2 * MIB)
    src = es_tensor(torch, rec, seg, block_offset=0, nbytes=32768, shape=(2, 256, 64), strides=(16384, 64, 1))
    out = legacy_tensor(torch, rec, block_offset=0, nbytes=32768, shape=(32768,), strides=(1,))
    with wprep.Client(tcp_daemon.tcp_targets[0], timeout=30) as c:
        with pytest.raises(wprep.VmmSharingError) as e:
            c.convert(SPEC, [2, 128, 256], src, out=out)
        # The daemon's status, and what to do about it; both kinds of error at once.
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "Unix socket" in e.value.details
        assert isinstance(e.value, wprep.WprepError) and isinstance(e.value, wprep.ExpandableSegmentsError)
        assert "shareProcessNamespace" in str(e.value) and "CAP_SYS_PTRACE" in str(e.value)
        with pytest.raises(wprep.VmmSharingError, match=r"items\[0\]\.convert\.source\.ipc\.vmm"):
            c.convert_batch([wprep.Item(SPEC, [2, 128, 256], src, out=out)])
        # A legacy-only request over TCP gets the daemon's own answer, not this error.
        with pytest.raises(wprep.WprepError) as legacy:
            c.convert(SPEC, [2, 128, 256], legacy_tensor(torch, rec, block_offset=0, nbytes=32768, shape=(2, 256, 64),
                                                         strides=(16384, 64, 1)), out=out)
        assert not isinstance(legacy.value, wprep.VmmSharingError)
    # The inline path is untouched by any of this.
    with wprep.Client(tcp_daemon.tcp_targets[0], timeout=30) as c:
        r = c.convert(SPEC, [2, 128, 256], np.zeros(32768, np.uint8))
        assert r.nbytes == len(r.data)


def test_the_daemon_is_found_by_its_socket_for_yamas_ptracer_exception(daemon, tcp_daemon, monkeypatch):
    assert ipc.unix_socket_path("unix:///run/wprep/wprepd.sock") == "/run/wprep/wprepd.sock"
    assert ipc.unix_socket_path("unix:rel.sock") == "rel.sock"
    assert ipc.unix_socket_path("127.0.0.1:50051") is None
    # SO_PEERCRED of the daemon's socket names the daemon's process.
    assert ipc.peer_pid(ipc.unix_socket_path(daemon.target)) == daemon.proc.pid
    assert ipc.peer_pid("/nonexistent/wprepd.sock") is None
    # Under ptrace_scope 1, each Client names its own daemon before it sends VMM memory, again
    # whenever another Client's daemon was named since; nothing before VMM memory is sent.
    monkeypatch.setattr(ipc, "_yama_scope_is_1", lambda: True)
    assert ipc.daemon_needing_ptrace(daemon.target) == daemon.proc.pid
    assert ipc.daemon_needing_ptrace(tcp_daemon.tcp_targets[0]) is None
    named = []
    monkeypatch.setattr(ipc, "allow_ptrace", lambda pid: named.append(pid) or True)
    monkeypatch.setattr(ipc, "vmm_exported", False)
    a, b = wprep.Client(daemon.target), wprep.Client(tcp_daemon.target)
    try:
        a.devices()
        assert named == []
        monkeypatch.setattr(ipc, "vmm_exported", True)
        a.devices()
        b.devices()
        a.devices()
        assert named == [daemon.proc.pid, tcp_daemon.proc.pid, daemon.proc.pid]
    finally:
        a.close()
        b.close()
    monkeypatch.setattr(ipc, "_yama_scope_is_1", lambda: False)
    assert ipc.daemon_needing_ptrace(daemon.target) is None
