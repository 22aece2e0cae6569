"""The Dockerfile: linted; every build step is a script CI runs; the final stage holds the
staged runtime files only; and the image's entry point, run as the image's user with the
image's environment, gives a daemon its HEALTHCHECK finds healthy. (No container engine
runs where CI runs, so the image itself is not built here.)"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import time

import pytest

from conftest import (IMAGE_PREFIX, ROOT, dockerfile_final_stage, flag_value, host_port, image_env,
                      need_sandbox, wprepd_flags)

STAGES = dockerfile_final_stage()
BUILD, FINAL = STAGES[0], STAGES[-1]
# What `make test-deploy` runs before these tests (its `deps` runs bootstrap.sh).
CI_STEPS = {"bash scripts/bootstrap.sh", "bash scripts/stage_runtime.sh /stage"}


def instr(stage, kw):
    return [rest for k, rest in stage if k == kw]


def exec_form(rest):
    return json.loads(rest)


def test_dockerfile_lints_clean():
    r = subprocess.run(["node", str(ROOT / "tests" / "deploy" / "lint_dockerfile.js"), str(ROOT / "Dockerfile")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_build_steps_are_the_scripts_ci_runs():
    assert len(STAGES) == 2
    assert re.fullmatch(r"nvidia/cuda:\$\{CUDA_VERSION\}-devel-ubuntu\$\{UBUNTU_VERSION\} AS build",
                        next(r for k, r in BUILD if k == "FROM"))
    assert re.fullmatch(r"nvidia/cuda:\$\{CUDA_VERSION\}-runtime-ubuntu\$\{UBUNTU_VERSION\}",
                        next(r for k, r in FINAL if k == "FROM"))
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_VERSION=13\.", text, re.M), "a CUDA 13 image"
    assert set(instr(BUILD, "RUN")) == CI_STEPS, instr(BUILD, "RUN")
    assert instr(FINAL, "RUN") == [], "the final stage runs nothing: no step CI cannot run"
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test-deploy:.*?\n((?:\t.*\n)+)", make, re.M)
    assert recipe and "bash scripts/stage_runtime.sh" in recipe.group(1), "make test-deploy stages the image files"
    for rest in instr(FINAL, "COPY"):
        assert rest.startswith("--from=build ") and " /stage/" in rest, rest


def test_staged_binaries_need_only_their_libraries_and_the_os():
    need_sandbox()
    env = image_env()
    system = re.compile(r"^(linux-vdso|libc|libm|libdl|librt|libpthread|ld-linux-x86-64|libresolv|libstdc\+\+|libgcc_s)\.so")
    for b in ("wprepd", "wprep"):
        out = subprocess.run(["ldd", str(IMAGE_PREFIX / "bin" / b)], env=env, capture_output=True, text=True).stdout
        for line in out.splitlines():
            name = line.split()[0]
            assert "not found" not in line, line
            if system.match(name) or name.startswith("/"):
                continue
            assert f"=> {IMAGE_PREFIX}/lib/" in line, f"{b}: {line.strip()} is not from the staged libraries"
    assert sorted(p.name for p in (IMAGE_PREFIX / "bin").iterdir()) == ["wprep", "wprepd"]


def test_image_entrypoint_and_healthcheck():
    need_sandbox()
    entry = exec_form(instr(FINAL, "ENTRYPOINT")[0])
    cmd = exec_form(instr(FINAL, "CMD")[0])
    assert entry == ["wprepd"]
    used = {a.split("=", 1)[0] for a in cmd}
    assert used <= wprepd_flags(), f"CMD passes flags wprepd --help lacks: {sorted(used - wprepd_flags())}"
    user, _, group = instr(FINAL, "USER")[0].partition(":")
    uid, gid = int(user), int(group)
    assert uid != 0
    (volume,) = [json.loads(v) for v in instr(FINAL, "VOLUME")]
    sock = flag_value(cmd, "--listen")
    assert volume == [sock[len("unix://"):].rsplit("/", 1)[0]]
    exposed = {int(p) for p in instr(FINAL, "EXPOSE")[0].split()}
    assert exposed == {host_port(flag_value(cmd, "--health-listen"))[1],
                       host_port(flag_value(cmd, "--metrics-address"))[1]}
    hc = instr(FINAL, "HEALTHCHECK")[0]
    hc_cmd = exec_form(hc[hc.index("CMD") + 3:].strip())
    assert hc_cmd[:2] == ["wprep", "health"] and flag_value(hc_cmd, "--target") == sock
    start_period = int(re.search(r"--start-period=(\d+)s", hc).group(1))

    # The socket folder as the image has it (COPY --chown to the image's user).
    run_dir = pathlib.Path(volume[0])
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    os.chown(run_dir, uid, gid)
    env = image_env()
    ids = [f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
    log = open("/tmp/wprepd-image.log", "w+")
    p = subprocess.Popen(["setpriv"] + ids + entry + cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + min(start_period, 120)
        while True:
            assert p.poll() is None, f"the image's ENTRYPOINT + CMD exited:\n{pathlib.Path(log.name).read_text()}"
            r = subprocess.run(["setpriv"] + ids + hc_cmd, env=env, capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                break
            assert time.monotonic() < deadline, r.stdout + r.stderr
            time.sleep(0.1)
        assert r.stdout == "SERVING\n"
        h = subprocess.run(["setpriv"] + ids + entry + ["--help"], env=env, capture_output=True, text=True)
        assert h.returncode == 0 and "--listen" in h.stdout
    finally:
        p.terminate()
        p.wait(40)
        shutil.rmtree(run_dir, ignore_errors=True)
