"""LocalDaemon: a private wprepd for tests and benchmarks (a loader's CI, this package's tests).

    with LocalDaemon(args=["--devices=cpu"]) as d:     # the CPU engine: no GPU needed
        wprep.Client(d.target).convert(...)

It runs the wprepd binary ($WPREPD, else `wprepd` on PATH) on a Unix socket in a fresh
temporary folder, with metrics off, and waits until the daemon's health service is SERVING.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Mapping, Optional, Sequence

from ._client import Client


class LocalDaemon:
    """A wprepd child process on unix://<tmp>/s.sock; stop() (or the with block) ends it."""

    def __init__(
        self,
        binary: Optional[str] = None,
        args: Sequence[str] = ("--devices=cpu",),
        *,
        startup_timeout: float = 120.0,
        env: Optional[Mapping[str, str]] = None,
    ) -> None:
        path = binary or os.environ.get("WPREPD") or shutil.which("wprepd")
        if not path or not os.access(path, os.X_OK):
            raise FileNotFoundError(
                f"no wprepd binary at {path!r}: build it (make build: build/server/wprepd) or set $WPREPD"
            )
        self.binary = path
        self.dir = tempfile.mkdtemp(prefix="wprepd-py-")
        self.socket = os.path.join(self.dir, "s.sock")
        self.log_path = os.path.join(self.dir, "wprepd.log")
        port_file = os.path.join(self.dir, "ports")
        cmd = [path, f"--listen=unix://{self.socket}", "--metrics-address=", f"--port-file={port_file}", *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env=None if env is None else dict(env))
        self.target = ""
        self.tcp_targets: list = []  # "HOST:PORT" of each TCP --listen in `args`, as bound
        self.metrics_address = ""  # "HOST:PORT" of /metrics, when `args` turn it on (--metrics-address=H:0)
        deadline = time.monotonic() + startup_timeout
        try:
            while not self.target:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"wprepd exited with {self.proc.returncode} during start-up:\n{self.log()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"wprepd wrote no port file in {startup_timeout} s:\n{self.log()}")
                try:
                    with open(port_file) as f:
                        for line in f:
                            kind, _, addr = line.strip().partition(" ")
                            if kind == "grpc" and addr.startswith("unix://"):
                                self.target = addr
                            elif kind == "grpc" and addr not in self.tcp_targets:
                                self.tcp_targets.append(addr)
                            elif kind == "metrics":
                                self.metrics_address = addr
                except FileNotFoundError:
                    pass
                time.sleep(0.005)
            with Client(self.target) as c:
                c.wait_serving(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        """What the daemon wrote to stderr so far (one line per request)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def metric(self, name: str) -> float:
        """The sum over its labels of metric `name` on the daemon's /metrics (the daemon must
        have been started with a metrics address, e.g. args=["--metrics-address=127.0.0.1:0"])."""
        if not self.metrics_address:
            raise RuntimeError("this wprepd serves no /metrics: start it with --metrics-address=127.0.0.1:0")
        import urllib.request

        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the daemon drains), then SIGKILL after `timeout` s; removes the folder."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalDaemon":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
