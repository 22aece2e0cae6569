"""The kustomize recipes render, validate against the Kubernetes schemas, and agree with the
daemon: its real flags (`wprepd --help` of the staged binary), ports, paths and probes."""
import copy
import json
import subprocess

import pytest

from conftest import (K8S, ROOT, all_containers, command_line, flag_value, flag_values, host_port,
                      need_sandbox, objects, pod_spec, render, require_flags_for, variants,
                      workload, wprepd_container)

VARIANTS = variants()
# --drain-timeout's default when a manifest does not pass it.
DEFAULT_DRAIN_S = 30


def test_every_recipe_is_there():
    assert set(VARIANTS) >= {"sidecar", "daemonset", "sidecar-vmm", "daemonset-vmm"}, VARIANTS


def validate(objs):
    return subprocess.run(["node", str(ROOT / "tests" / "deploy" / "validate_k8s.js")],
                          input=json.dumps(objs), capture_output=True, text=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_objects_match_the_kubernetes_schemas(variant):
    r = validate(render(variant))
    assert r.returncode == 0, r.stdout + r.stderr
    kinds = {o["kind"] for o in render(variant)}
    assert {"Service", "ServiceMonitor"} <= kinds, kinds


def test_the_schema_check_rejects_a_wrong_object():
    bad = copy.deepcopy(workload("daemonset"))
    wprepd_container(pod_spec(bad))["ports"][0]["containerPort"] = "8081"
    r = validate([bad])
    assert r.returncode == 1 and "containerPort must be integer" in r.stdout, r.stdout + r.stderr


def seconds(d):
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for u in sorted(units, key=len, reverse=True):
        if d.endswith(u):
            return float(d[: -len(u)]) * units[u]
    raise ValueError(d)


@pytest.mark.parametrize("variant", VARIANTS)
def test_wprepd_flags_exist(variant):
    need_sandbox()
    require_flags_for(variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_ports_paths_and_probes_agree_with_the_command_line(variant):
    spec = pod_spec(workload(variant))
    c = wprepd_container(spec)
    args = command_line(c, {"POD_IP": "10.0.0.1"})
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}

    health = flag_value(args, "--health-listen")
    metrics = flag_value(args, "--metrics-address")
    assert health and host_port(health) == ("10.0.0.1", ports["grpc-health"]), (health, ports)
    assert metrics and host_port(metrics) == ("10.0.0.1", ports["metrics"]), (metrics, ports)

    # The conversion API: the Unix socket (and loopback) only, never the pod IP.
    listens = flag_values(args, "--listen")
    sockets = [a for a in listens if a.startswith("unix://")]
    assert len(sockets) == 1, listens
    for a in listens:
        assert a.startswith("unix://") or host_port(a)[0] in ("127.0.0.1", "::1", "localhost"), a
    socket_path = sockets[0][len("unix://"):]
    socket_dir = socket_path.rsplit("/", 1)[0]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert socket_dir in mounts, f"{socket_dir} is not a volume of the wprepd container: {mounts}"


    # Native gRPC probes go to the health-only port; the exec probe to the socket.
    for name in ("startupProbe", "readinessProbe"):
        assert c[name]["grpc"]["port"] == ports["grpc-health"], name
    assert c["readinessProbe"]["grpc"].get("service") == "wprep.v1.WeightPrep"
    live = c["livenessProbe"]["exec"]["command"]
    assert live[:2] == ["wprep", "health"] and flag_value(live, "--target") == sockets[0], live

    # The startup probe covers a warm-up of every GPU; liveness outlasts a drain; the pod's
    # grace period outlasts the drain.
    st, lv = c["startupProbe"], c["livenessProbe"]
    assert st["periodSeconds"] * st["failureThreshold"] >= 180
    drain = seconds(flag_value(args, "--drain-timeout") or f"{DEFAULT_DRAIN_S}s")
    assert lv["periodSeconds"] * lv["failureThreshold"] > drain
    assert spec["terminationGracePeriodSeconds"] > drain
    assert seconds(flag_value(live, "--timeout")) < lv["timeoutSeconds"]

    # Resources and a non-root user.
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    sc = c["securityContext"]
    assert not sc["allowPrivilegeEscalation"]
    if variant.endswith("-vmm"):
        # Root for pidfd_getfd, with SYS_PTRACE as its only capability (checked in full below).
        assert sc["capabilities"]["add"] == ["SYS_PTRACE"], sc
    else:
        assert sc["runAsNonRoot"] and sc["runAsUser"] != 0

    # The metrics Service selects these pods on the named port, and the ServiceMonitor
    # scrapes that Service.
    labels = workload(variant)["spec"]["template"]["metadata"]["labels"]
    (svc,) = objects(variant, "Service")
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()), svc["spec"]["selector"]
    (sport,) = svc["spec"]["ports"]
    assert sport["port"] == ports["metrics"]
    if c in spec.get("initContainers", []):
        # Services resolve a native sidecar's named ports only from Kubernetes 1.32 on.
        assert sport["targetPort"] == ports["metrics"], sport
    else:
        assert sport["targetPort"] in ("metrics", ports["metrics"]), sport
    (sm,) = objects(variant, "ServiceMonitor")
    assert all(svc["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [sport["name"]]
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "wprepd"  # job="wprepd" in the rules
    assert svc["metadata"].get("namespace") == sm["metadata"].get("namespace") == workload(variant)["metadata"].get("namespace")



def test_sidecar_shares_socket_pid_namespace_and_gpu():
    spec = pod_spec(workload("sidecar"))
    c = wprepd_container(spec)
    assert spec["shareProcessNamespace"] is True
    assert c in spec["initContainers"] and c["restartPolicy"] == "Always", "a native sidecar"
    serving = [x for x in spec["containers"] if x is not c]
    assert serving, "the serving container"
    wp_mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/run/wprep")
    for s in serving:
        assert any(m["name"] == wp_mount["name"] and m["mountPath"] == "/run/wprep" for m in s["volumeMounts"])
        assert "nvidia.com/gpu" in s["resources"]["limits"]
        assert {"name": "WPREP_TARGET", "value": "unix:///run/wprep/wprepd.sock"} in s["env"]
    # wprepd takes no GPU from the device plugin and sees the node's, the serving one's too.
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in c["env"]
    volume = next(v for v in spec["volumes"] if v["name"] == wp_mount["name"])
    assert "emptyDir" in volume
    assert spec["securityContext"]["fsGroup"] == c["securityContext"]["runAsGroup"]
    # One /dev/shm for both: the words of completion="async" calls are files there.
    shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    for s in serving:
        assert any(m["name"] == shm["name"] and m["mountPath"] == "/dev/shm" for m in s["volumeMounts"])
    assert next(v for v in spec["volumes"] if v["name"] == shm["name"])["emptyDir"]["medium"] == "Memory"


def test_the_vmm_sidecar_may_take_the_engines_descriptors_and_the_plain_one_may_not():
    # pidfd_getfd needs ptrace rights over the engine: CAP_SYS_PTRACE (also what the default
    # seccomp profile asks before it allows the call) and the pod's one PID namespace. Only
    # the overlay grants it; the plain sidecar keeps every capability dropped, as non-root.
    vmm_spec = pod_spec(workload("sidecar-vmm"))
    vmm = wprepd_container(vmm_spec)["securityContext"]
    assert vmm_spec["shareProcessNamespace"] is True
    assert vmm["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert vmm["runAsUser"] == 0 and vmm["allowPrivilegeEscalation"] is False
    assert vmm["seccompProfile"] == {"type": "RuntimeDefault"}
    plain = wprepd_container(pod_spec(workload("sidecar")))["securityContext"]
    assert plain["runAsNonRoot"] is True and plain["capabilities"] == {"drop": ["ALL"]}
    # Everything else is the sidecar's.
    base = copy.deepcopy(pod_spec(workload("sidecar")))
    other = copy.deepcopy(vmm_spec)
    for spec in (base, other):
        wprepd_container(spec).pop("securityContext")
    assert base == other


@pytest.mark.parametrize("variant", ["daemonset", "daemonset-vmm"])
def test_daemonset_runs_on_gpu_nodes_with_the_socket_on_the_node(variant):
    spec = pod_spec(workload(variant))
    c = wprepd_container(spec)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["hostPID"] is True
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in c["env"]
    volume = next(v for v in spec["volumes"] if v["name"] == "wprep-socket")
    assert volume["hostPath"] == {"path": "/run/wprep", "type": "DirectoryOrCreate"}
    (init,) = [x for x in spec["initContainers"]]
    assert init["command"][:2] == ["install", "-d"] and "/run/wprep" in init["command"]
    owner = init["command"][init["command"].index("-o") + 1]
    group = init["command"][init["command"].index("-g") + 1]
    assert (int(owner), int(group)) == (c["securityContext"]["runAsUser"], c["securityContext"]["runAsGroup"])


def test_the_vmm_daemonset_may_take_the_clients_descriptors_and_the_plain_one_may_not():
    # The node's daemon takes descriptors from other pods' processes: the host's PID
    # namespace (hostPID, which the client pods need too) and ptrace rights over them,
    # CAP_SYS_PTRACE as root (Kubernetes gives added capabilities to root containers alone).
    # That root has no other capability, so the socket folder must be its own to write in,
    # with the clients' group.
    vmm_spec = pod_spec(workload("daemonset-vmm"))
    c = wprepd_container(vmm_spec)
    vmm = c["securityContext"]
    assert vmm_spec["hostPID"] is True
    assert vmm["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert vmm["runAsUser"] == 0 and vmm["runAsNonRoot"] is False and vmm["allowPrivilegeEscalation"] is False
    assert vmm["runAsGroup"] == 65532 and vmm["readOnlyRootFilesystem"] is True
    assert vmm["seccompProfile"] == {"type": "RuntimeDefault"}
    (init,) = vmm_spec["initContainers"]
    cmd = init["command"]
    mode = int(cmd[cmd.index("-m") + 1], 8)
    assert cmd[cmd.index("-o") + 1] == "0" and mode & 0o700 == 0o700, cmd  # root's, writable by it
    assert cmd[cmd.index("-g") + 1] == "65532" and mode & 0o050 == 0o050 and mode & 0o007 == 0, cmd
    plain = wprepd_container(pod_spec(workload("daemonset")))["securityContext"]
    assert plain["runAsNonRoot"] is True and plain["capabilities"] == {"drop": ["ALL"]}
    # Everything else is the DaemonSet's.
    base = copy.deepcopy(pod_spec(workload("daemonset")))
    other = copy.deepcopy(vmm_spec)
    for spec in (base, other):
        wprepd_container(spec).pop("securityContext")
        spec["initContainers"][0].pop("command")
    assert base == other
    assert workload("daemonset-vmm")["metadata"] == workload("daemonset")["metadata"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_images_are_the_wprepd_image(variant):
    spec = pod_spec(workload(variant))
    for c in all_containers(spec):
        if c["name"] != "serving":
            assert c["image"].startswith("wprepd:"), c["image"]
