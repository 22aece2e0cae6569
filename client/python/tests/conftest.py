"""Fixtures: one wprepd on the CPU engine for the whole session (the bytes-path tests)."""

import os
import sys
from pathlib import Path

import pytest

# The package under test is this checkout's, whether or not one is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wprep import Client  # noqa: E402
from wprep.testing import LocalDaemon  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def wprepd_path() -> str:
    """$WPREPD, else the build tree's wprepd (make build)."""
    return os.environ.get("WPREPD") or str(REPO / "build" / "server" / "wprepd")


def torch_cuda():
    """torch, for a test that needs a CUDA device: skips the test without torch or a device."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch finds no CUDA device")
    return torch


@pytest.fixture(scope="session")
def daemon():
    # --devices=cpu: the CPU engine, the same on a machine with GPUs.
    with LocalDaemon(wprepd_path(), ["--devices=cpu", "--cpu-threads=2"]) as d:
        yield d


@pytest.fixture(scope="session")
def client(daemon):
    with Client(daemon.target, timeout=120) as c:
        yield c
