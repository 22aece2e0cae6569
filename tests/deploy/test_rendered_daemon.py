"""The rendered manifests, started by hand with the same arguments, give a daemon whose
probes succeed: wprepd runs with the rendered command line (pod IP expanded, as its user,
its volumes laid out as kubelet makes them, init containers run first), and each probe runs
exactly as rendered: native gRPC probes as kubelet's Check to the pod IP, exec probes in the
wprepd container."""
import json
import os
import pathlib
import re
import shutil
import signal
import stat
import struct
import subprocess
import tempfile
import time

import pytest

from conftest import (IMAGE_PREFIX, POD_IP, RenderedDaemon, flag_value, image_env, need_sandbox, objects,
                      require_flags_for, variants)

# A client of the socket in a serving pod: another user, in the daemon's group (fsGroup in
# the sidecar recipe, supplementalGroups in a DaemonSet client).
CLIENT_UID = 1000


@pytest.fixture(params=variants())
def daemon(request):
    need_sandbox()
    require_flags_for(request.param)
    d = RenderedDaemon(request.param).start()
    yield d
    d.close()


def listening_tcp_ports():
    """(address, port) of every listening TCP socket in this network namespace; IPv4
    addresses of dual-stack sockets (::ffff:a.b.c.d) as a.b.c.d, "::" as 0.0.0.0."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            ip_hex, port_hex = fields[1].split(":")
            words = [ip_hex[i:i + 8] for i in range(0, len(ip_hex), 8)]
            if len(words) == 4 and words[:2] == ["00000000", "00000000"] and words[2] in ("FFFF0000", "00000000"):
                v4 = words[3]
                if words[2] == "00000000" and v4 != "00000000":
                    out.add((ip_hex, int(port_hex, 16)))  # a real IPv6 address
                    continue
            else:
                v4 = words[0] if len(words) == 1 else None
                if v4 is None:
                    out.add((ip_hex, int(port_hex, 16)))
                    continue
            ip = ".".join(str(int(v4[i:i + 2], 16)) for i in (6, 4, 2, 0))
            out.add((ip, int(port_hex, 16)))
    return out


@pytest.fixture
def client_dir():
    """A folder the client user may read and write (pytest's tmp_path is root's alone)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="wprep-client-"))
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def convert(target, uid, groups, folder):
    inp = folder / "in.bin"
    inp.write_bytes(bytes(range(256)) * 64)  # 256 x 128 values
    out = folder / "out.bin"
    cmd = [str(IMAGE_PREFIX / "bin" / "wprep"), "convert", "--target", target, "--layout", "hopper_value",
           "--direction", "swizzle", "--shape", "256,128", "--input", str(inp), "--output", str(out)]
    g = ",".join(str(x) for x in groups)
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}",
                           f"--groups={g}" if g else "--clear-groups", "--"] + cmd,
                          env=image_env(), capture_output=True, text=True, timeout=60)


def test_probes_succeed_as_rendered(daemon, client_dir):
    c = daemon.container
    # Startup: polled as kubelet polls it, within the budget the manifest gives.
    st = c["startupProbe"]
    daemon.wait_probe(st, min(st["periodSeconds"] * st["failureThreshold"], 120))
    r = daemon.probe_grpc(c["readinessProbe"])
    assert r.returncode == 0 and r.stdout == "SERVING\n", r.stdout + r.stderr
    r = daemon.probe_exec(c["livenessProbe"])
    assert r.returncode == 0 and r.stdout == "SERVING\n", r.stdout + r.stderr

    # The socket: mode 0660, the daemon's group; a client in that group converts through it,
    # a client outside it cannot connect.
    target = flag_value(daemon.cmd, "--listen")
    sock = pathlib.Path(target[len("unix://"):])
    st_sock = sock.stat()
    assert stat.S_ISSOCK(st_sock.st_mode) and stat.S_IMODE(st_sock.st_mode) == 0o660, oct(st_sock.st_mode)
    assert st_sock.st_gid == daemon.gid and st_sock.st_uid == daemon.uid
    ok = convert(target, CLIENT_UID, [daemon.gid], client_dir)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    denied = convert(target, CLIENT_UID, [], client_dir)
    assert denied.returncode == 2 and denied.stderr.startswith("UNAVAILABLE"), denied.stderr

    # On the pod IP: the health-only listener and /metrics, nothing else.
    health_port = c["startupProbe"]["grpc"]["port"]
    metrics = flag_value(daemon.cmd, "--metrics-address")
    exposed = {p for ip, p in listening_tcp_ports() if ip in (POD_IP, "0.0.0.0")}
    assert exposed == {health_port, int(metrics.rsplit(":", 1)[1])}, exposed
    r = convert(f"{POD_IP}:{health_port}", CLIENT_UID, [], client_dir)
    assert r.returncode == 2 and r.stderr.startswith("UNIMPLEMENTED"), r.stderr
    body = subprocess.run(["python3", "-c", f"import urllib.request as u; print(u.urlopen('http://{metrics}/metrics', timeout=5).read().decode())"],
                          capture_output=True, text=True, timeout=30)
    assert "wprep_build_info" in body.stdout, body.stderr

    # SIGTERM drains and exits 0 within the pod's grace period.
    grace = daemon.spec["terminationGracePeriodSeconds"]
    assert daemon.stop(signal.SIGTERM, grace) == 0, daemon.log_text()


def safetensors_file(tensors):
    """A .safetensors file of {name: (dtype, shape, bytes)}."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def test_the_weights_recipe_preloads_its_sets_once_serving():
    """The weights recipe as rendered, with a checkpoint in the node's model folder at the
    path its preload file names: once serving, the daemon has the set resident, byte for byte
    as stored, and a serving pod's client (the daemon's group) lists it."""
    need_sandbox()
    require_flags_for("daemonset-weights")
    d = RenderedDaemon("daemonset-weights")
    root = flag_value(d.cmd, "--weights-root")
    preload_path = flag_value(d.cmd, "--preload")
    preload_map = objects("daemonset-weights", "ConfigMap")[0]["data"][pathlib.Path(preload_path).name]
    names = re.findall(r'^\s*name: "([^"]+)"', preload_map, re.M)
    paths = re.findall(r'^\s*path: "([^"]+)"', preload_map, re.M)
    assert names and len(names) == len(paths), preload_map
    weight = bytes(range(256)) * 8
    d.node_files[root] = {f"{p}/model.safetensors": safetensors_file({"w": ("BF16", [32, 32], weight)}) for p in paths}
    d.start()
    try:
        c = d.container
        d.wait_probe(c["startupProbe"], 120)
        target = flag_value(d.cmd, "--listen")
        deadline = time.monotonic() + 60
        listed = None
        while time.monotonic() < deadline:
            listed = subprocess.run(["setpriv", f"--reuid={CLIENT_UID}", f"--regid={CLIENT_UID}", f"--groups={d.gid}",
                                     "--", str(IMAGE_PREFIX / "bin" / "wprep"), "weights", "list", "--target", target],
                                    env=image_env(), capture_output=True, text=True, timeout=30)
            if listed.returncode == 0 and all(n in listed.stdout for n in names):
                break
            time.sleep(0.2)
        assert listed.returncode == 0 and all(n in listed.stdout for n in names), \
            f"{listed.stdout}{listed.stderr}\nwprepd log:\n{d.log_text()}"
        assert "event=weights_preloaded" in d.log_text(), d.log_text()
        assert "event=weights_preload_failed" not in d.log_text(), d.log_text()
    finally:
        d.close()


def test_conversion_api_on_the_pod_ip_without_tls_is_refused():
    """No conversion API beyond loopback and the Unix socket unless TLS is on."""
    need_sandbox()
    cmd = [str(IMAGE_PREFIX / "bin" / "wprepd"), "--devices=cpu", "--metrics-address=",
           f"--listen={POD_IP}:50051"]
    p = subprocess.Popen(cmd, env=image_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"wprepd accepted --listen={POD_IP}:50051 without --tls-cert/--tls-key and kept "
                    f"running (the refusal of non-loopback TCP without TLS has not landed): {out}")
    assert p.returncode != 0, out
    assert "tls" in out.lower(), f"the refusal should say TLS is needed: {out}"
