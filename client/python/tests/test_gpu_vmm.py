"""GPU tests of CUDA virtual memory through the client: the GPU tests of the drop-in,
convert / convert_batch, trtllm and quantize_mxfp4 run again, unchanged, in a child Python
whose torch allocates with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (so every CUDA
tensor they send goes as a CudaVmmBuffer); and the drop-in's outputs of one seeded layer
compared byte for byte between a legacy-IPC child and an expandable-segments child. Each
test compares with the CPU engine (the same bytes the legacy run compares with), so their
passing under expandable segments is the byte-equality with the legacy run. Skipped without
torch or CUDA.

On the GPU machine, from the repo root:
    WPREPD=.bundle/bin/wprepd LD_LIBRARY_PATH=.bundle/lib PYTHONPATH=client/python \
        python3 -m pytest -v -rs client/python/tests/test_gpu_vmm.py
"""

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1]
EXPANDABLE = "expandable_segments:True"

# The GPU tests run again under expandable segments: every test of test_gpu.py but three
# (the runtimes' stub import, which sends no tensor; the legacy handle's byte format, which
# expandable segments do not have; and the killed client's 20 s GPU spin, which tests the
# daemon's ready words, not the memory), the trtllm and quantize in-place tests, and the VMM
# tests that need the setting from the start.
RERUN = [
    "tests/test_gpu.py::test_gpu_sources_and_outputs_at_offsets_inside_blocks",
    "tests/test_gpu.py::test_gpu_small_tensors_of_one_block_in_one_batch_with_allocated_outputs",
    "tests/test_gpu.py::test_gpu_transposed_scale_views_as_loaders_pass_them",
    "tests/test_gpu.py::test_gpu_producer_stream_is_synchronized_before_the_daemon_reads",
    "tests/test_gpu.py::test_gpu_futures_with_cuda_tensors",
    "tests/test_gpu.py::test_gpu_tensors_freed_right_after_their_requests",
    "tests/test_gpu.py::test_gpu_register_a_pool_once",
    "tests/test_gpu.py::test_gpu_uuid_names_the_gpu",
    "tests/test_gpu.py::test_gpu_expandable_segments_convert_in_place_byte_equal_to_the_cpu_engine",
    "tests/test_gpu.py::test_gpu_drop_in_matches_the_contract_for_gpt_oss_20b_layers",
    "tests/test_gpu.py::test_gpu_a_layer_is_one_round_trip",
    "tests/test_gpu.py::test_gpu_drop_in_into_preallocated_outputs",
    "tests/test_gpu.py::test_gpu_stream_completion_orders_the_current_stream_after_the_daemons_work",
    "tests/test_gpu.py::test_gpu_stream_completion_reads_the_inputs_after_the_work_queued_before_the_call",
    "tests/test_gpu.py::test_gpu_stream_completion_needs_cuda_tensors_in_and_out",
    "tests/test_gpu.py::test_gpu_a_client_gone_right_after_a_stream_answer_leaves_the_daemon_serving",
    "tests/test_gpu.py::test_gpu_async_drop_in_many_layers_back_to_back_matches_the_host_completion",
    "tests/test_gpu.py::test_gpu_async_reads_the_inputs_after_the_work_queued_before_the_call",
    "tests/test_gpu.py::test_gpu_a_refused_async_call_releases_the_stream_and_raises_later",
    "tests/test_trtllm.py::test_cuda_out_is_written_in_place_by_ipc_and_equals_the_cpu_engine",
    "tests/test_quantize.py::test_gpu_cuda_tensors_are_quantized_in_place_and_equal_the_cpu_engine",
    "tests/test_quantize.py::test_gpu_cuda_float16_and_float32_equal_the_cpu_engine",
    "tests/test_vmm.py::test_gpu_expandable_segment_handle_parses",
]

# A pytest plugin for the child: at the end, whether the client sent VMM buffers at all (a
# torch that ignored the setting would pass every test through legacy IPC).
PROBE = '''
def pytest_sessionfinish(session, exitstatus):
    from wprep._cuda import ipc
    print("\\nVMM_EXPORTED", ipc.vmm_exported, flush=True)
'''


def _torch():
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - no torch, no GPU tests
        pytest.skip(f"torch is not importable: {e}")
    if not torch.cuda.is_available():
        pytest.skip("torch finds no CUDA device")
    return torch


def _env(tmp_path, conf):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(PACKAGE_DIR), env.get("PYTHONPATH", "")])
    env.pop("PYTORCH_ALLOC_CONF", None)
    if conf is None:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    return env


def test_gpu_drop_in_convert_batch_trtllm_and_quantize_tests_pass_under_expandable_segments(tmp_path):
    _torch()
    (tmp_path / "wprep_vmm_probe.py").write_text(PROBE)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "wprep_vmm_probe", "-q", "-rs", *RERUN]
    out = subprocess.run(cmd, cwd=PACKAGE_DIR, env=_env(tmp_path, EXPANDABLE), capture_output=True, text=True,
                         timeout=900)
    tail = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0, tail
    assert "VMM_EXPORTED True" in out.stdout, "no VMM buffer was sent: did torch use expandable segments?\n" + tail
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= len(RERUN), "some of the chosen tests did not run:\n" + tail


# One gpt-oss-20b-shaped layer through the drop-in (host completion and stream completion),
# its inputs made from a seed on the host; prints the outputs' digest, and whether the
# client sent VMM buffers.
DROP_IN = textwrap.dedent("""
    import hashlib, sys, torch, wprep
    from wprep import _torch as wt
    from wprep._cuda import ipc
    c = wprep.Client(sys.argv[1], timeout=300)
    g = torch.Generator().manual_seed(1234)
    pairs = [(torch.randint(0, 256, (4, n, 1440), dtype=torch.uint8, generator=g).cuda(),
              torch.randint(0, 256, (4, n, 90), dtype=torch.uint8, generator=g).cuda()) for n in (5760, 2880)]
    digest = hashlib.sha256()
    for completion in ("host", "stream"):
        for r in wprep.swizzle_mxfp4_batch(pairs, 8, client=c, triton=False, completion=completion):
            torch.cuda.current_stream().synchronize()
            for t in (r.values, r.scales):
                digest.update(t.as_strided((t.untyped_storage().nbytes() - t.storage_offset(),), (1,))
                              .cpu().numpy().tobytes())
    sent_vmm = wt.source_view(pairs[0][0], wt.Registry()).vmm is not None
    print("DIGEST", digest.hexdigest(), "VMM", sent_vmm, ipc.vmm_exported)
""")


def test_gpu_the_drop_in_under_expandable_segments_is_byte_equal_to_legacy_ipc(tmp_path):
    _torch()
    from wprep.testing import LocalDaemon

    wprepd = os.environ.get("WPREPD") or str(PACKAGE_DIR.parents[1] / "build" / "server" / "wprepd")
    lines = {}
    with LocalDaemon(wprepd, []) as d:
        for name, conf in (("legacy", "expandable_segments:False"), ("vmm", EXPANDABLE)):
            out = subprocess.run([sys.executable, "-c", DROP_IN, d.target], env=_env(tmp_path, conf),
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, f"{name}: {out.stderr[-4000:]}"
            lines[name] = out.stdout.strip().splitlines()[-1].split()
        log = d.log()
    legacy, vmm = lines["legacy"], lines["vmm"]
    assert legacy[3:] == ["False", "False"], f"the legacy run sent VMM buffers: {legacy}"
    assert vmm[3:] == ["True", "True"], f"the expandable-segments run sent no VMM buffer: {vmm}"
    assert vmm[1] == legacy[1], "the drop-in's outputs differ between VMM and legacy IPC buffers"
    assert "code=OK" in log and "PERMISSION_DENIED" not in log, log[-3000:]


# A client under expandable segments: 8 source / output pairs in its segments, then 10,000
# Convert calls over them, each IPC -> IPC; the first output checked against the same bytes
# sent inline. Prints MAPPED and waits on stdin (closed: it exits; or the test kills it).
MANY_CALLS = textwrap.dedent("""
    import sys, torch, wprep
    from wprep._cuda import ipc
    c = wprep.Client(sys.argv[1], timeout=300)
    spec = wprep.Spec("hopper_value", mx_axis=-2, mma_version=3, packing_axis=-2)
    shape = [2, 256, 256]
    p = c.plan(spec, shape)
    g = torch.Generator(device="cuda").manual_seed(5)
    pairs = [(torch.randint(0, 256, tuple(p.input_shape), dtype=torch.uint8, device="cuda", generator=g),
              torch.empty(p.output_bytes, dtype=torch.uint8, device="cuda")) for _ in range(8)]
    torch.cuda.synchronize()
    want = c.convert(spec, shape, pairs[0][0].cpu().numpy().tobytes()).data
    for i in range(10_000):
        src, out = pairs[i % len(pairs)]
        c.convert(spec, shape, src, out=out)
    torch.cuda.synchronize()
    assert pairs[0][1].cpu().numpy().tobytes() == bytes(want), "the VMM output differs from the bytes path"
    print("MAPPED", ipc.vmm_exported, flush=True)
    sys.stdin.read()
""")


def test_gpu_vmm_mappings_are_reused_over_10000_calls_and_closed_when_the_client_exits_or_is_killed(tmp_path):
    # Real CUDA (cuMemImportFromShareableHandle, cuMemMap) in the daemon, a real torch client:
    # the mappings are opened once and reused by every call (cache misses stay few, hits grow
    # by at least one a call), and close when the client's process ends, killed or not
    # (wprep_ipc_cache_entries, which counts VMM mappings as well, back to zero).
    _torch()
    from wprep.testing import LocalDaemon

    wprepd = os.environ.get("WPREPD") or str(PACKAGE_DIR.parents[1] / "build" / "server" / "wprepd")
    with LocalDaemon(wprepd, ["--metrics-address=127.0.0.1:0"]) as d:
        assert d.metric("wprep_ipc_cache_entries") == 0
        for ending in ("exit", "kill"):
            misses, hits = d.metric("wprep_ipc_cache_misses_total"), d.metric("wprep_ipc_cache_hits_total")
            child = subprocess.Popen([sys.executable, "-c", MANY_CALLS, d.target], env=_env(tmp_path, EXPANDABLE),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                line = child.stdout.readline()
                assert line.split() == ["MAPPED", "True"], f"{ending}: {line!r} {child.stderr.read()[-4000:]}"
                entries = d.metric("wprep_ipc_cache_entries")
                opened = d.metric("wprep_ipc_cache_misses_total") - misses
                reused = d.metric("wprep_ipc_cache_hits_total") - hits
                assert 1 <= entries <= 16, entries
                assert 1 <= opened <= 16, f"{ending}: {opened} mappings opened for 16 buffers"
                assert reused >= 10_000 - 16, f"{ending}: {reused} mapping reuses over 10,000 calls"
            finally:
                if ending == "exit":
                    child.stdin.close()
                    assert child.wait(60) == 0, child.stderr.read()[-4000:]
                else:
                    child.kill()
                    child.wait(60)
            deadline = time.monotonic() + 15  # the daemon's janitor sweeps every second
            while d.metric("wprep_ipc_cache_entries") != 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert d.metric("wprep_ipc_cache_entries") == 0, f"{ending}: mappings left after the client ended"
        assert d.alive()
