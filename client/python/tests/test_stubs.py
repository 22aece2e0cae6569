"""The checked-in stubs are what the regeneration script makes, and import on the runtimes
the package supports (this one here; the GPU machine's newer one in test_gpu.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "client" / "python"
STUBS = ("wprep_pb2.py", "wprep_pb2.pyi", "wprep_pb2_grpc.py")


def _protoc_321() -> bool:
    if not shutil.which("protoc") or not shutil.which("grpc_python_plugin"):
        return False
    return subprocess.run(["protoc", "--version"], capture_output=True, text=True).stdout.startswith("libprotoc 3.21.")


def test_checked_in_stubs_equal_a_fresh_generation(tmp_path):
    if not _protoc_321():
        if os.environ.get("CI"):
            pytest.fail("CI needs protoc 3.21 and grpc_python_plugin (scripts/bootstrap.sh installs them)")
        pytest.skip("protoc 3.21 with grpc_python_plugin is not installed")
    subprocess.run(["bash", str(PACKAGE / "scripts" / "regen_stubs.sh"), str(tmp_path)], check=True)
    for name in STUBS:
        fresh = (tmp_path / "wprep" / "v1" / name).read_bytes()
        checked_in = (PACKAGE / "wprep" / "v1" / name).read_bytes()
        assert fresh == checked_in, (
            f"wprep/v1/{name} differs from a fresh generation: run client/python/scripts/regen_stubs.sh"
        )


def test_the_stubs_carry_no_version_checks():
    # Newer generators add checks that refuse runtimes older than themselves.
    for name in STUBS:
        text = (PACKAGE / "wprep" / "v1" / name).read_text()
        for marker in ("ValidateProtobufRuntimeVersion", "GRPC_GENERATED_VERSION", "runtime_version"):
            assert marker not in text, f"{name} has {marker}"


@pytest.mark.parametrize("backend", ["default", "python"])
def test_the_stubs_import_and_round_trip(backend):
    # "python" is protobuf's pure-Python backend, the other branch of the generated code.
    code = (
        "from wprep.v1 import wprep_pb2 as pb, wprep_pb2_grpc as g\n"
        "r = pb.ConvertBatchRequest()\n"
        "c = r.items.add().convert\n"
        "c.spec.layout = pb.LAYOUT_HOPPER_SCALE\n"
        "c.spec.hopper_scale.num_warps = 4\n"
        "c.spec.packing_axis = -1\n"
        "c.source.ipc.handle = bytes(64)\n"
        "c.source.ipc.strides.extend([5, 1, 7])\n"
        "back = pb.ConvertBatchRequest.FromString(r.SerializeToString())\n"
        "s = back.items[0].convert.spec\n"
        "assert s.HasField('packing_axis') and not s.hopper_scale.HasField('mx_axis')\n"
        "assert list(back.items[0].convert.source.ipc.strides) == [5, 1, 7]\n"
        "assert hasattr(g, 'WeightPrepStub')\n"
        "from google.protobuf.internal import api_implementation\n"
        "print(api_implementation.Type())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(PACKAGE))
    if backend == "python":
        env["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    if backend == "python":
        assert out.stdout.strip() == "python"


def test_pip_installs_the_package_offline(tmp_path):
    # A copy, so that setuptools' in-tree build files stay out of the checkout.
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests", "bench"))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps", "--no-index",
         "--target", str(target), str(src)],
        check=True,
    )
    assert (target / "wprep" / "py.typed").exists()
    assert (target / "wprep" / "v1" / "wprep_pb2.pyi").exists()
    code = "import wprep, wprep.testing; print(wprep.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(target)),
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(target))
