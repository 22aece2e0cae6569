"""Shared pieces of the deploy checks: where things are, the rendered manifests, and a
daemon started from a rendered container exactly as kubelet would start it.

Run through `make test-deploy` (tests/deploy/run.sh): it stages the runtime image's files
(scripts/stage_runtime.sh) and runs these tests in private network and mount namespaces,
where a veth carries the pod IP and the staged /opt/wprep and a private /run stand where
the image has them.
"""
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import yaml

from pending import PENDING_METRICS

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
PROM = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
TOOLS = ROOT / ".tools"
# Inside the sandbox the staged image files are at their image path.
IMAGE_PREFIX = pathlib.Path("/opt/wprep")
POD_IP = os.environ.get("WPREP_POD_IP", "")
IN_SANDBOX = os.environ.get("WPREP_DEPLOY_SANDBOX") == "1"
# The PATH and LD_LIBRARY_PATH of nvidia/cuda runtime images, before our ENV lines.
BASE_IMAGE_ENV = {
    "PATH": "/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LD_LIBRARY_PATH": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
}


def need_sandbox():
    if not IN_SANDBOX:
        pytest.fail("this check runs inside tests/deploy/run.sh (make test-deploy): it needs the "
                    "pod-IP network namespace and the staged image files at /opt/wprep")


def variants():
    return sorted(p.parent.name for p in K8S.glob("*/kustomization.yaml"))


_rendered = {}


def render(variant):
    """`kubectl kustomize deploy/k8s/VARIANT` as a list of objects."""
    if variant not in _rendered:
        r = subprocess.run(["kubectl", "kustomize", str(K8S / variant)], capture_output=True, text=True)
        assert r.returncode == 0, f"kubectl kustomize {variant} failed: {r.stderr}"
        assert r.stderr.strip() == "", f"kubectl kustomize {variant} warned: {r.stderr}"
        _rendered[variant] = [o for o in yaml.safe_load_all(r.stdout) if o]
    return _rendered[variant]


def objects(variant, kind):
    return [o for o in render(variant) if o["kind"] == kind]


def pod_spec(obj):
    return obj["spec"]["template"]["spec"]


def workload(variant):
    """The one Deployment or DaemonSet of a variant."""
    ws = [o for o in render(variant) if o["kind"] in ("Deployment", "DaemonSet")]
    assert len(ws) == 1, f"{variant}: expected one workload, got {[o['kind'] for o in ws]}"
    return ws[0]


def all_containers(spec):
    return spec.get("initContainers", []) + spec.get("containers", [])


def wprepd_container(spec):
    cs = [c for c in all_containers(spec) if c.get("command", [None])[0] == "wprepd"]
    assert len(cs) == 1, "expected one container whose command is wprepd"
    return cs[0]


def flag_value(args, name):
    """The last value of --name=V / --name V in args, or None."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
        elif a == name and i + 1 < len(args):
            value = args[i + 1]
    return value


def flag_values(args, name):
    out = []
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            out.append(a.split("=", 1)[1])
        elif a == name and i + 1 < len(args):
            out.append(args[i + 1])
    return out


def host_port(addr):
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------------------------------
# The image's environment (Dockerfile ENV of the final stage) and kubelet's expansion.

def dockerfile_final_stage():
    """Instructions of the Dockerfile's last stage as (KEYWORD, text), continuations joined."""
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    stages, current = [], []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        kw, _, rest = line.partition(" ")
        if kw.upper() == "FROM":
            current = []
            stages.append(current)
        current.append((kw.upper(), rest.strip()))
    return stages


def image_env():
    env = dict(BASE_IMAGE_ENV)
    for kw, rest in dockerfile_final_stage()[-1]:
        if kw != "ENV":
            continue
        for m in re.finditer(r'(\w+)=("[^"]*"|\S+)', rest):
            value = m.group(2).strip('"')
            value = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda v: env.get(v.group(1) or v.group(2), ""), value)
            env[m.group(1)] = value
    return env


def container_env(container):
    """The image's environment plus the container's env, as kubelet sets it on the pod IP."""
    env = image_env()
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = kubelet_expand(e["value"], env)
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = POD_IP
        else:
            pytest.fail(f"env {e['name']}: no stand-in for {e.get('valueFrom')}")
    return env


def kubelet_expand(s, env):
    """Kubernetes' $(VAR) expansion of command, args and env values ($$ escapes)."""
    def sub(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, s)


def command_line(container, env):
    return [kubelet_expand(a, env) for a in container.get("command", []) + container.get("args", [])]


def as_user(cmd, uid, gid, groups=()):
    """cmd run with the uid, gid and supplementary groups of a container's securityContext."""
    g = ",".join(str(x) for x in groups)
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}",
            f"--groups={g}" if g else "--clear-groups", "--"] + cmd


def run_in_container(cmd, env, uid=0, gid=0, groups=(), timeout=30):
    return subprocess.run(as_user(cmd, uid, gid, groups), env=env, capture_output=True, text=True,
                          timeout=timeout)


def wprepd_help():
    r = subprocess.run([str(IMAGE_PREFIX / "bin" / "wprepd"), "--help"], env=image_env(),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def wprepd_flags():
    return set(re.findall(r"^\s+(--[a-z][a-z0-9-]*)", wprepd_help(), re.M))


class RenderedDaemon:
    """wprepd started from a rendered workload: volumes laid out as kubelet would, init
    containers run, then the wprepd container's command line as rendered, as its user."""

    def __init__(self, variant):
        need_sandbox()
        self.variant = variant
        self.workload = workload(variant)
        self.spec = pod_spec(self.workload)
        self.container = wprepd_container(self.spec)
        self.env = container_env(self.container)
        self.cmd = command_line(self.container, self.env)
        sc = self.container.get("securityContext", {})
        psc = self.spec.get("securityContext", {})
        self.uid = sc.get("runAsUser", psc.get("runAsUser", 0))
        self.gid = sc.get("runAsGroup", psc.get("runAsGroup", 0))
        self.fs_group = psc.get("fsGroup")
        self.groups = [self.fs_group] if self.fs_group is not None else []
        self.log = tempfile.NamedTemporaryFile(prefix=f"wprepd-{variant}-", suffix=".log", delete=False)
        self.proc = None
        self.mounts = []
        # Files on the node that hostPath volumes of type Directory show: {path: {relative: bytes}}.
        self.node_files = {}

    def lay_out_volumes(self):
        """Each volume the wprepd container mounts, at its mountPath, as kubelet makes it."""
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        for m in self.container.get("volumeMounts", []):
            v = volumes[m["name"]]
            path = pathlib.Path(m["mountPath"])
            if path in (pathlib.Path("/tmp"), pathlib.Path("/dev/shm")):
                # The test machine's /tmp stands in for the scratch emptyDir, and its /dev/shm
                # (a tmpfs mount, which cannot be removed) for the memory-backed one.
                continue
            if path.exists():
                shutil.rmtree(path)
            if "emptyDir" in v:
                # An emptyDir is mode 0777; with fsGroup, kubelet gives it that group and setgid.
                path.mkdir(parents=True)
                if self.fs_group is not None:
                    os.chown(path, 0, self.fs_group)
                    os.chmod(path, 0o2777)
                else:
                    os.chmod(path, 0o777)
            elif "hostPath" in v:
                assert v["hostPath"]["path"] == str(path), "the test lays hostPaths out at the same path"
                # DirectoryOrCreate: what kubelet creates, root, 0755. Directory: the node's own
                # folder, which the test makes the same way (and may fill, see `node_files`).
                assert v["hostPath"].get("type") in ("DirectoryOrCreate", "Directory")
                path.mkdir(parents=True, mode=0o755)
                os.chmod(path, 0o755)
                for rel, data in self.node_files.get(str(path), {}).items():
                    (path / rel).parent.mkdir(parents=True, exist_ok=True)
                    (path / rel).write_bytes(data)
                    os.chmod(path / rel, 0o644)
            elif "configMap" in v:
                # kubelet writes each key of the ConfigMap as a file, readable by all.
                maps = {o["metadata"]["name"]: o for o in objects(self.variant, "ConfigMap")}
                path.mkdir(parents=True, mode=0o755)
                for key, text in maps[v["configMap"]["name"]].get("data", {}).items():
                    (path / key).write_text(text)
                    os.chmod(path / key, 0o644)
            else:
                pytest.fail(f"volume {m['name']}: no stand-in for {v}")
            self.mounts.append(path)

    def run_init_containers(self):
        for c in self.spec.get("initContainers", []):
            if c.get("restartPolicy") == "Always":
                continue  # a native sidecar: this is the daemon itself
            env = container_env(c)
            sc = c.get("securityContext", {})
            r = run_in_container(command_line(c, env), env, sc.get("runAsUser", 0), sc.get("runAsGroup", 0))
            assert r.returncode == 0, f"init container {c['name']} failed: {r.stdout}{r.stderr}"

    def start(self):
        self.lay_out_volumes()
        self.run_init_containers()
        self.proc = subprocess.Popen(as_user(self.cmd, self.uid, self.gid, self.groups), env=self.env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def log_text(self):
        return pathlib.Path(self.log.name).read_text(errors="replace")

    def exited(self):
        return self.proc is not None and self.proc.poll() is not None

    def probe_exec(self, probe):
        """A rendered exec probe, run in the wprepd container as kubelet runs it."""
        cmd = probe["exec"]["command"]
        return run_in_container(cmd, self.env, self.uid, self.gid, self.groups,
                                timeout=probe.get("timeoutSeconds", 1) + 5)

    def probe_grpc(self, probe):
        """A rendered native gRPC probe: kubelet's Check, plaintext, to the pod IP."""
        g = probe["grpc"]
        cmd = [str(IMAGE_PREFIX / "bin" / "wprep"), "health", "--target", f"{POD_IP}:{g['port']}",
               "--service", g.get("service", ""), "--timeout", f"{probe.get('timeoutSeconds', 1)}s"]
        return subprocess.run(cmd, env=image_env(), capture_output=True, text=True, timeout=30)

    def wait_probe(self, probe, bound_s):
        """Polls a probe until it succeeds, the daemon exits, or bound_s passes."""
        deadline = time.monotonic() + bound_s
        r = None
        while time.monotonic() < deadline:
            if self.exited():
                pytest.fail(f"{self.variant}: wprepd exited ({self.proc.returncode}) with the rendered "
                            f"command line {self.cmd}:\n{self.log_text()}")
            r = self.probe_grpc(probe) if "grpc" in probe else self.probe_exec(probe)
            if r.returncode == 0:
                return r
            time.sleep(0.1)
        pytest.fail(f"{self.variant}: probe {probe} did not succeed in {bound_s}s: "
                    f"{r.stdout if r else ''}{r.stderr if r else ''}\nwprepd log:\n{self.log_text()}")

    def stop(self, sig=signal.SIGTERM, bound_s=40):
        if self.proc is None or self.exited():
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(bound_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def close(self):
        self.stop(signal.SIGKILL, 5)
        for path in self.mounts:
            shutil.rmtree(path, ignore_errors=True)
        os.unlink(self.log.name)


def require_flags_for(variant):
    """Fails, naming them, when the rendered wprepd command line uses flags wprepd lacks."""
    args = command_line(wprepd_container(pod_spec(workload(variant))), {})
    used = {a.split("=", 1)[0] for a in args[1:] if a.startswith("--")}
    missing = sorted(used - wprepd_flags())
    if missing:
        pytest.fail(f"{variant}: wprepd --help has no {', '.join(missing)}, which the rendered manifest "
                    "passes; the daemon flag has not landed yet")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.section("pending metrics (asked of the daemon; their checks are expected failures)")
    for name, what in PENDING_METRICS.items():
        terminalreporter.write_line(f"{name}: {what}")
