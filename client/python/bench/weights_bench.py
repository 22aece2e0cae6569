#!/usr/bin/env python3
"""Resident weight sets on a GPU: load a gpt-oss-shaped checkpoint into a set on cuda:0, attach
it from a fresh process, and check it against convert-safetensors, in one run.

    WPREPD=.bundle/bin/wprepd WPREP_CLI=.bundle/bin/wprep WPREP_FAKE_CHECKPOINT=.bundle/bin/wprep_fake_checkpoint \\
        PYTHONPATH=client/python python3 client/python/bench/weights_bench.py --dir /tmp/wb

Steps (each timed with the wall clock):
  checkpoint  wprep_fake_checkpoint writes a gpt-oss-20b-shaped checkpoint (24 layers of 32
              MXFP4 experts, H = I = 2880, vocab 201088, 3 shards: 12.9 GB) unless one is there;
              its files are then read once so that every step below reads the page cache.
  baseline    the plain way to put the same files on the GPU: read them in 64 MiB pieces into
              two pinned buffers (a reader thread per buffer's piece half, as many as wprepd
              uses) and copy each piece into one device buffer of the whole size, the copy of a
              piece overlapping the read of the next. Its GB/s is the reference.
  load        LoadWeights into a set on cuda:0 with the gpt-oss rules (*_blocks -> hopper_value,
              *_scales -> hopper_scale, both read as the checkpoint stores them), converting on
              the GPU; GB/s of the checkpoint's bytes.
  attach      a fresh Python process imports torch and wprep, then (timed) attaches to the set
              and makes every tensor a CUDA view, and synchronizes; repeated --attach-reps times.
              The same for a second set of the same checkpoint loaded with vmm (CUDA virtual
              memory, its descriptor fetched over the handle socket), whose bytes must equal
              the first set's.
  restart     what an engine does without a resident set, in a fresh process too (imports
              excluded): every shard read from the page cache onto cuda:0 with safetensors'
              safe_open, then every *_blocks / *_scales pair prepared by the drop-in
              (wprep.swizzle_mxfp4_batch, one ConvertBatch, through the same daemon), and a
              synchronize.
  identical   convert-safetensors of the same checkpoint (the same daemon, --layout
              hopper_value), then every tensor of its output compared on the GPU with the
              set's bytes (exit 1 on a difference).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's wprep

from wprep import Client  # noqa: E402
from wprep.testing import LocalDaemon  # noqa: E402

RULES = "*_blocks=hopper_value:checkpoint;*_scales=hopper_scale:checkpoint"
PIECE = 64 << 20
READERS = 4


def shards(ckpt: Path):
    return sorted(p for p in ckpt.iterdir() if p.suffix == ".safetensors")


def baseline(files, device) -> float:
    """Seconds to read `files` through two pinned buffers into one device buffer."""
    total = sum(f.stat().st_size for f in files)
    dst = torch.empty(total, dtype=torch.uint8, device=device)
    bufs = [torch.empty(PIECE, dtype=torch.uint8).pin_memory() for _ in range(2)]
    events = [torch.cuda.Event() for _ in range(2)]
    busy = [False, False]
    stream = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    at, k = 0, 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        size, pos = path.stat().st_size, 0
        while pos < size:
            n = min(PIECE, size - pos)
            b = k % 2
            if busy[b]:
                events[b].synchronize()
            view = memoryview(bufs[b].numpy())
            part = (n + READERS - 1) // READERS

            def read(i):
                lo, hi = i * part, min(n, (i + 1) * part)
                got = lo
                while got < hi:
                    got += os.preadv(fd, [view[got:hi]], pos + got)

            threads = [threading.Thread(target=read, args=(i,)) for i in range(1, READERS) if i * part < n]
            for t in threads:
                t.start()
            read(0)
            for t in threads:
                t.join()
            with torch.cuda.stream(stream):
                dst[at:at + n].copy_(bufs[b][:n], non_blocking=True)
                events[b].record(stream)
            busy[b] = True
            at, pos, k = at + n, pos + n, k + 1
        os.close(fd)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    del dst
    torch.cuda.empty_cache()
    return seconds


RESTART = """
import sys, time, json
import torch, wprep
from safetensors import safe_open
torch.cuda.init(); torch.cuda.synchronize(0)
c = wprep.Client(sys.argv[1])
t0 = time.perf_counter()
tensors = {}
for f in sys.argv[2:]:
    with safe_open(f, framework="pt", device="cuda:0") as st:
        for k in st.keys():
            tensors[k] = st.get_tensor(k)
torch.cuda.synchronize(0)
t1 = time.perf_counter()
names = [k[:-len("_blocks")] for k in tensors if k.endswith("_blocks")]
pairs = [(tensors[n + "_blocks"].flatten(-2), tensors[n + "_scales"]) for n in names]
out = wprep.swizzle_mxfp4_batch(pairs, client=c, triton=False)
for n, r in zip(names, out):
    tensors[n + "_blocks"], tensors[n + "_scales"] = r.values, r.scales
torch.cuda.synchronize(0)
t2 = time.perf_counter()
print(json.dumps({"read_s": t1 - t0, "prepare_s": t2 - t1, "total_s": t2 - t0, "pairs": len(pairs),
                  "tensors": len(tensors)}))
"""

ATTACH = """
import sys, time, json
import torch, wprep, wprep.weights
torch.cuda.init(); torch.cuda.synchronize(0)
c = wprep.Client(sys.argv[1])
t0 = time.perf_counter()
w = c.attach_weights(sys.argv[2])
ts = w.torch_tensors()
torch.cuda.synchronize(0)
t1 = time.perf_counter()
print(json.dumps({"attach_s": t1 - t0, "tensors": len(ts), "bytes": w.manifest.total_bytes}))
w.close()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir() + "/wprep-weights-bench")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=201088)
    ap.add_argument("--attach-reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    wprepd = os.environ.get("WPREPD", "build/server/wprepd")
    cli = os.environ.get("WPREP_CLI", "build/client/cli/wprep")
    fake = os.environ.get("WPREP_FAKE_CHECKPOINT", "build/tests/client/wprep_fake_checkpoint")
    root = Path(args.dir)
    ckpt = root / "root" / "gptoss"
    (root / "root").mkdir(parents=True, exist_ok=True)
    out: dict = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    t = time.perf_counter()
    if not (ckpt / "model.safetensors.index.json").exists():
        subprocess.run([fake, str(ckpt), f"--layers={args.layers}", f"--experts={args.experts}", "--hidden=2880",
                        "--intermediate=2880", f"--vocab={args.vocab}", "--shards=3"], check=True)
    files = shards(ckpt)
    size = sum(f.stat().st_size for f in files)
    for f in files:  # into the page cache
        with open(f, "rb") as fh:
            while fh.read(256 << 20):
                pass
    out["checkpoint_bytes"] = size
    print(f"checkpoint {ckpt}: {size / 1e9:.2f} GB in {len(files)} shards ({time.perf_counter() - t:.1f} s)", flush=True)

    base_s = min(baseline(files, 0) for _ in range(2))
    out["baseline_s"] = base_s
    print(f"baseline read + host-to-device copy: {base_s:.3f} s, {size / base_s / 1e9:.2f} GB/s", flush=True)

    with LocalDaemon(wprepd, [f"--weights-root={root / 'root'}"]) as d:
        with Client(d.target, timeout=600) as c:
            t = time.perf_counter()
            r = c.load_weights("gptoss", "gptoss", rules=RULES, device="cuda:0", progress=None)
            load_s = time.perf_counter() - t
            out.update(load_s=load_s, load_daemon_s=r.load_seconds, set_bytes=r.manifest.total_bytes,
                       tensors=len(r.manifest.tensors))
            print(f"load into a set on cuda:0: {load_s:.3f} s wall ({r.load_seconds:.3f} s in the daemon), "
                  f"{size / load_s / 1e9:.2f} GB/s = {base_s / load_s * 100:.0f}% of the baseline's rate; "
                  f"{len(r.manifest.tensors)} tensors, {r.manifest.total_bytes / 1e9:.2f} GB", flush=True)

            env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

            def fresh(code: str, *argv: str) -> dict:
                p = subprocess.run([sys.executable, "-c", code, d.target, *argv], capture_output=True, text=True,
                                   env=env)
                if p.returncode != 0:
                    raise RuntimeError(p.stderr)
                return json.loads(p.stdout.strip().splitlines()[-1])

            attach = [fresh(ATTACH, "gptoss") for _ in range(args.attach_reps)]
            out["attach_s"] = [a["attach_s"] for a in attach]
            print("attach in a fresh process (imports excluded): " +
                  ", ".join(f"{a['attach_s'] * 1e3:.1f} ms" for a in attach) + f" ({attach[0]['tensors']} tensors)",
                  flush=True)

            t = time.perf_counter()
            rv = c.load_weights("gptoss_vmm", "gptoss", rules=RULES, device="cuda:0", vmm=True, progress=None)
            out["load_vmm_s"] = time.perf_counter() - t
            attach_vmm = [fresh(ATTACH, "gptoss_vmm") for _ in range(args.attach_reps)]
            out["attach_vmm_s"] = [a["attach_s"] for a in attach_vmm]
            with c.attach_weights("gptoss") as w, c.attach_weights("gptoss_vmm") as wv:
                vmm_differ = [t.name for t in w.manifest.tensors if not torch.equal(w.raw(t.name), wv.raw(t.name))]
            out["vmm_differ"] = vmm_differ
            c.drop_weights("gptoss_vmm")
            print(f"the same as a vmm set: load {out['load_vmm_s']:.3f} s, {rv.manifest.total_bytes / 1e9:.2f} GB; "
                  "attach in a fresh process: " + ", ".join(f"{a['attach_s'] * 1e3:.1f} ms" for a in attach_vmm) +
                  f"; {len(vmm_differ)} tensors differ from the cudaMalloc set", flush=True)

            restart = [fresh(RESTART, *[str(f) for f in files]) for _ in range(2)]
            out["restart"] = restart
            print("without a resident set, a fresh process reads the shards onto cuda:0 and prepares them: " +
                  ", ".join(f"{r['total_s']:.3f} s (read {r['read_s']:.3f}, prepare {r['prepare_s']:.3f})"
                            for r in restart) + f" ({restart[0]['pairs']} pairs prepared)", flush=True)

            conv = root / "converted"
            t = time.perf_counter()
            subprocess.run([cli, "convert-safetensors", str(ckpt / "model.safetensors.index.json"), str(conv),
                            "--layout", "hopper_value", "--target", d.target, "--progress", "none"], check=True)
            out["convert_safetensors_s"] = time.perf_counter() - t
            from safetensors import safe_open

            differ, compared = [], 0
            with c.attach_weights("gptoss") as w:
                for f in sorted(conv.glob("*.safetensors")):
                    with safe_open(str(f), framework="pt", device="cuda:0") as st:
                        for name in st.keys():
                            want = st.get_tensor(name).contiguous().view(torch.uint8).reshape(-1)
                            got = w.raw(name)
                            compared += 1
                            if want.numel() != got.numel() or not torch.equal(want, got):
                                differ.append(name)
            out.update(compared=compared, differ=differ)
            print(f"convert-safetensors ({out['convert_safetensors_s']:.1f} s) vs the set: {compared} tensors compared, "
                  f"{len(differ)} differ{(': ' + ', '.join(differ[:5])) if differ else ''}", flush=True)
            c.drop_weights("gptoss")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if differ or vmm_differ or compared != out["tensors"] else 0


if __name__ == "__main__":
    sys.exit(main())
