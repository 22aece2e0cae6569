"""Where a layer's time goes with the drop-in's async completion: host calls next to the GPU.

A gpt-oss-20b-shaped model (24 layers of 32 experts, outputs registered), each layer one
swizzle_mxfp4_batch call. For each variant, 6 runs (the first dropped): the wall time to the
caller's stream being done, when the calls returned, and for each layer the moment its work
was done on the caller's stream (a CUDA event recorded there after each call), so that the
host's pace (time between the calls' returns) and the GPU's (time between the layers'
completions) show which one bounds the run. Variants: completion="async"; the same with
sends not awaited (send() returns once the request is queued for grpc's threads, the
behaviour before prompt sends); that with a 0.1 ms interpreter switch interval; "stream".
Last, one call for the whole model ("stream"), as a floor for the GPU's work.

    WPREPD=.bundle/bin/wprepd LD_LIBRARY_PATH=.bundle/lib python3 client/python/bench/async_layers_bench.py
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import wprep  # noqa: E402
from swizzle_bench import device_copy_ms, import_cuda_torch, make_model  # noqa: E402  (the same model and copy)
from wprep import _stream  # noqa: E402
from wprep.testing import LocalDaemon  # noqa: E402

LAYERS, REPS = 24, 6


def main() -> int:
    torch = import_cuda_torch()
    if torch is None:
        return 3
    d = LocalDaemon(args=sys.argv[1:])
    c = wprep.Client(d.target, timeout=120)
    model = make_model(torch, LAYERS)
    outs = [[wprep.empty_swizzled_mxfp4(v, s, 8, client=c) for v, s in layer] for layer in model]
    c.register([t for layer in model for p in layer for t in p] + [t for lo in outs for p in lo for t in p])
    stream = torch.cuda.current_stream()

    def run(completion: str):
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(LAYERS + 1)]
        host = []
        t0 = time.perf_counter()
        events[0].record()
        for i, (layer, lo) in enumerate(zip(model, outs)):
            wprep.swizzle_mxfp4_batch(layer, 8, client=c, out=lo, completion=completion)
            host.append((time.perf_counter() - t0) * 1e3)
            events[i + 1].record()
        sent = (time.perf_counter() - t0) * 1e3
        stream.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        c.wait_async(60)
        return wall, sent, host, [events[0].elapsed_time(e) for e in events[1:]]

    send = _stream.BatchStream.send

    def unprompted(self, entry):
        entry.prompt = False
        return send(self, entry)

    copy = device_copy_ms(torch, model, outs, 5)
    print(f"{torch.cuda.get_device_name(0)}; {LAYERS} layers; copy of the input bytes {copy:.2f} ms")
    variants = (("async", "async", False, None), ("async, sends not awaited", "async", True, None),
                ("async, not awaited, switch interval 0.1 ms", "async", True, 1e-4), ("stream", "stream", False, None),
                ("async, again", "async", False, None), ("async, not awaited, again", "async", True, None))
    for name, completion, old_send, interval in variants:
        before = sys.getswitchinterval()
        if interval:
            sys.setswitchinterval(interval)
        if old_send:
            _stream.BatchStream.send = unprompted
        try:
            rows = [run(completion) for _ in range(REPS)][1:]
        finally:
            _stream.BatchStream.send = send
            sys.setswitchinterval(before)
        wall = statistics.median(r[0] for r in rows)
        sent = statistics.median(r[1] for r in rows)
        r = sorted(rows, key=lambda r: r[0])[len(rows) // 2]
        host_gaps = [b - a for a, b in zip(r[2], r[2][1:])]
        gpu_gaps = [b - a for a, b in zip(r[3], r[3][1:])]
        lag = [gg - hh for gg, hh in zip(r[3], r[2])]
        print(f"{name:42s} wall {wall:6.2f} ms ({wall / copy:.2f}x), calls done at {sent:6.2f} ms; per layer: host "
              f"{statistics.median(host_gaps) * 1e3:.0f} us, "
              f"GPU completions {statistics.median(gpu_gaps) * 1e3:.0f} us "
              f"apart; GPU behind the call: median {statistics.median(lag):.2f} ms, last {lag[-1]:.2f} ms")
        print("   GPU completion gaps (us): " + " ".join(f"{x * 1e3:.0f}" for x in gpu_gaps))
    torch.cuda.synchronize()
    # Each item of one layer alone (completion "host": the engine's time), next to a device copy of its input.
    from wprep._mxfp4 import _items, mxfp4_specs, scale_align_k

    specs = mxfp4_specs(torch.cuda.get_device_capability(0), 8, scale_align_k(None))
    for (v, s), (vo, so), name in zip(model[0], outs[0], ("w13", "w2")):
        for item, src, what in zip(_items(v, s, specs, (vo, so)), (v, s), ("values", "scales")):
            secs = statistics.median(c.convert_batch([item], completion="host")[0].kernel_seconds for _ in range(7))
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flat = torch.empty(src.numel(), dtype=torch.uint8, device=src.device)
            copies = []
            for _ in range(7):
                a.record()
                flat.copy_(src.reshape(-1))
                b.record()
                b.synchronize()
                copies.append(a.elapsed_time(b))
            copy_us = statistics.median(copies) * 1e3
            print(f"item {name} {what} {list(src.shape)}: kernel {secs * 1e6:.1f} us, copy of its input {copy_us:.1f} us "
                  f"({secs * 1e6 / copy_us:.2f}x)")
    pairs = [p for layer in model for p in layer]
    flat = [o for lo in outs for o in lo]
    for _ in range(2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        wprep.swizzle_mxfp4_batch(pairs, 8, client=c, out=flat, completion="stream")
        t1 = time.perf_counter()
        b.record()
        b.synchronize()
        print(f"one call for the model (stream): the call {1e3 * (t1 - t0):.2f} ms, "
              f"on the GPU {a.elapsed_time(b):.2f} ms")
    c.close()
    d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
