"""Round trips through a daemon's Unix socket and its TLS listener, for one or more wprepd
builds side by side: 8 MiB in and 8 MiB out per Convert (hopper_value, CPU engine), the
pairs interleaved in rounds so that drift hits them alike; prints medians.

    PYTHONPATH=client/python /usr/bin/python3 client/python/bench/tls_bench.py \\
        new=build/server/wprepd [old=/path/to/other/wprepd ...] [--rounds=10 --calls=10]

Certificates are made with openssl in a temporary folder."""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import wprep
from wprep import Spec


def make_certs(d):
    def run(*cmd):
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=bench-ca",
        "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem")
    with open(f"{d}/ext", "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", f"{d}/s.key",
        "-out", f"{d}/s.csr")
    run("openssl", "x509", "-req", "-in", f"{d}/s.csr", "-CA", f"{d}/ca.pem", "-CAkey", f"{d}/ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", f"{d}/ext", "-out", f"{d}/s.pem")


def main():
    builds = dict(a.split("=", 1) for a in sys.argv[1:] if not a.startswith("--"))
    flags = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    rounds, calls = int(flags.get("rounds", 10)), int(flags.get("calls", 10))
    d = tempfile.mkdtemp(prefix="wprep-tls-bench-")
    make_certs(d)
    creds = grpc.ssl_channel_credentials(open(f"{d}/ca.pem", "rb").read())
    spec, shape = Spec("hopper_value", mx_axis=-2), [4096, 4096]
    data = os.urandom(4096 * 2048)
    procs, clients = [], {}
    try:
        for label, path in builds.items():
            port_file = f"{d}/{label}.ports"
            procs.append(subprocess.Popen(
                [path, "--devices=cpu", "--cpu-threads=1", f"--listen=unix://{d}/{label}.sock",
                 "--listen=127.0.0.1:0", f"--tls-cert={d}/s.pem", f"--tls-key={d}/s.key", "--metrics-address=",
                 f"--port-file={port_file}"], stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + 60
            while not os.path.exists(port_file) and time.monotonic() < deadline:
                time.sleep(0.01)
            tcp = [line.split()[1] for line in open(port_file) if line.startswith("grpc ") and "unix:" not in line]
            clients[(label, "unix")] = wprep.Client(f"unix://{d}/{label}.sock")
            clients[(label, "tls")] = wprep.Client(tcp[0], credentials=creds)
            clients[(label, "unix")].wait_serving(60)
        times = {k: [] for k in clients}
        for c in clients.values():
            for _ in range(5):
                c.convert(spec, shape, data)
        for _ in range(rounds):
            for k, c in clients.items():
                for _ in range(calls):
                    t = time.perf_counter()
                    c.convert(spec, shape, data)
                    times[k].append(time.perf_counter() - t)
        for label in builds:
            u, t = statistics.median(times[(label, "unix")]), statistics.median(times[(label, "tls")])
            print(f"{label:12s} unix {u * 1e3:7.2f} ms   tls {t * 1e3:7.2f} ms   tls-unix {(t - u) * 1e3:6.2f} ms"
                  f"   tls/unix {t / u:.2f}   (n={len(times[(label, 'tls')])} each)")
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
