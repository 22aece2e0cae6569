"""wprep._vmm: torch's expandable-segment handle and CudaVmmBuffer messages without a GPU, and
(on a GPU with torch) the real handles of an expandable segment and a cuMem mapping."""

import os
import struct

import pytest

from wprep import _vmm
from wprep.v1 import wprep_pb2 as pb

UUID = bytes(range(16))
MIB = 1 << 20


def torch_handle(pid, segment_size, fds=(), fabric=(), version=2):
    """What ExpandableSegment::share writes, after _share_cuda_'s version byte and kind."""
    n = len(fds) or len(fabric)
    body = struct.pack("=i4xQQ", pid, segment_size, n)
    body += b"".join(struct.pack("=i", fd) for fd in fds) + b"".join(fabric)
    return bytes([version]) + b"e" + body


def test_parses_posix_fd_handle():
    h = _vmm.parse_expandable_handle(torch_handle(4321, 20 * MIB, fds=(17, 18, 23)))
    assert h == _vmm.ExpandableHandle(4321, 20 * MIB, fds=(17, 18, 23))
    assert h.num_chunks == 3


def test_parses_fabric_handle():
    fab = (b"\x01" * 64, b"\x02" * 64)
    h = _vmm.parse_expandable_handle(torch_handle(1, 2 * MIB, fabric=fab))
    assert h.fabric_handles == fab and h.fds == ()


@pytest.mark.parametrize(
    "handle, match",
    [
        (b"\x02e", "at least"),
        (b"\x02c" + b"\0" * 64, "not an expandable-segment handle"),
        (b"\x09e" + b"\0" * 24, "not an expandable-segment handle"),
        (torch_handle(1, 2 * MIB, fds=(3,))[:-1], "bytes after its header"),
        (bytes([2]) + b"e" + struct.pack("=i4xQQ", 1, 2 * MIB, 0), "0 chunks"),
    ],
)
def test_refuses_malformed_handles(handle, match):
    with pytest.raises(_vmm.VmmHandleError, match=match):
        _vmm.parse_expandable_handle(handle)


def test_buffer_from_expandable_segment():
    b = _vmm.buffer_from_expandable(torch_handle(os.getpid(), 20 * MIB, fds=(30, 31)), 19 * MIB, 2 * MIB, UUID)
    assert b.handle == b"" and b.offset == 19 * MIB and b.size == 2 * MIB and b.device_uuid == UUID
    v = b.vmm
    assert v.handle_type == pb.VMM_HANDLE_TYPE_POSIX_FD
    assert v.pid == os.getpid()
    assert [c.fd for c in v.chunks] == [30, 31]
    assert [c.size for c in v.chunks] == [20 * MIB, 20 * MIB]
    assert v.granularity == 2 * MIB  # 20 MiB's largest power-of-two divisor is 4 MiB, capped
    # It survives the wire.
    assert pb.CudaIpcBuffer.FromString(b.SerializeToString()) == b


def test_refuses_another_process_handle():
    with pytest.raises(_vmm.VmmHandleError, match="not this one"):
        _vmm.buffer_from_expandable(torch_handle(os.getpid() + 1, 2 * MIB, fds=(3,)), 0, 16, UUID)


def test_granularity():
    assert _vmm.granularity_of(2 * MIB) == 2 * MIB
    assert _vmm.granularity_of(20 * MIB) == 2 * MIB
    assert _vmm.granularity_of(3 * 4096) == 4096
    with pytest.raises(_vmm.VmmHandleError):
        _vmm.granularity_of(0)


def test_vmm_buffer_needs_one_kind_of_handle():
    with pytest.raises(_vmm.VmmHandleError):
        _vmm.vmm_buffer(pid=1, chunk_sizes=[2 * MIB], offset=0, size=1, device_uuid=UUID)
    with pytest.raises(_vmm.VmmHandleError, match="2 handles for 1"):
        _vmm.vmm_buffer(pid=1, chunk_sizes=[2 * MIB], offset=0, size=1, device_uuid=UUID, fds=[3, 4])


def _cuda_torch():
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch


def test_gpu_expandable_segment_handle_parses():
    """Run in a fresh process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the H200
    run sets it): torch's real handle of an expandable segment parses, and names open fds."""
    torch = _cuda_torch()
    if "expandable_segments:true" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower().replace(" ", ""):
        pytest.skip("needs PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set before torch starts")
    t = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
    b = _vmm.share_expandable(t, UUID)
    assert b.vmm.pid == os.getpid()
    assert len(b.vmm.chunks) >= 1
    for c in b.vmm.chunks:
        os.fstat(c.fd)  # open in this process
    assert b.offset + b.size <= sum(c.size for c in b.vmm.chunks)


def test_gpu_expandable_segment_tensor_converts_byte_equal_to_the_bytes_path():
    """End to end on a GPU: a fresh process with expandable segments sends a source and a
    destination as CudaVmmBuffers to a daemon on its GPU; the output equals what the CPU
    engine makes from the same bytes sent inline."""
    _cuda_torch()
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from wprep.testing import LocalDaemon

    package = Path(__file__).resolve().parents[1]
    wprepd = os.environ.get("WPREPD") or str(package.parents[1] / "build" / "server" / "wprepd")
    with LocalDaemon(wprepd, []) as gpu, LocalDaemon(wprepd, ["--devices=cpu", "--cpu-threads=2"]) as cpu:
        script = textwrap.dedent(f"""
            import sys, torch, grpc
            sys.path.insert(0, {str(package)!r})
            from wprep import Spec, _torch, _vmm
            from wprep.v1 import wprep_pb2 as pb, wprep_pb2_grpc as pbg
            shape = [4, 512, 1536]
            src = torch.randint(0, 256, (4, 256, 1536), dtype=torch.uint8, device="cuda")
            spec = Spec("hopper_value").to_proto()
            cpu = pbg.WeightPrepStub(grpc.insecure_channel({cpu.target!r}))
            want = cpu.Convert(pb.ConvertRequest(spec=spec, logical_shape=shape,
                                                 source_bytes=src.cpu().numpy().tobytes()))
            dst = torch.zeros(want.output_bytes, dtype=torch.uint8, device="cuda")
            uuid = _torch.device_uuid(torch.cuda.current_device())
            req = pb.ConvertRequest(spec=spec, logical_shape=shape)
            req.source_ipc.CopyFrom(_vmm.share_expandable(src, uuid))
            req.destination_ipc.CopyFrom(_vmm.share_expandable(dst, uuid))
            req.source_ipc.size = src.numel()
            req.destination_ipc.size = dst.numel()
            torch.cuda.synchronize()
            gpu = pbg.WeightPrepStub(grpc.insecure_channel({gpu.target!r}))
            for _ in range(3):
                gpu.Convert(req)
            print("EQUAL" if dst.cpu().numpy().tobytes() == want.output_bytes_inline else "DIFFERENT",
                  len(req.source_ipc.vmm.chunks), req.source_ipc.vmm.granularity)
        """)
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-4000:]
        assert out.stdout.startswith("EQUAL"), out.stdout
