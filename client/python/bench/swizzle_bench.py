"""What a Python loader pays to prepare a gpt-oss-20b-shaped model through wprep.swizzle_mxfp4.

Per layer (24 by default), random bytes in checkpoint order, on one GPU:
    w13: values [32, 5760, 1440], scales [32, 5760, 90]
    w2:  values [32, 2880, 1440], scales [32, 2880, 90]
converted to the layouts the loaders use on this GPU (sm_90: HopperMXValueLayout(mx_axis=-2,
mma_version=3) and HopperMXScaleLayout(mx_axis=-2, num_warps=8)), read and written in place
through CUDA IPC. Variants, each timed over --reps runs after one untimed warm-up (medians):

  layer batch, registered   swizzle_mxfp4_batch(..., completion="host"): one ConvertBatch per
                            layer (both projections' values and scales), each answered once its
                            work is done, into outputs preallocated with empty_swizzled_mxfp4 and
                            registered once with the inputs (Client.register), as a loader
                            converting through its buffers does. Its engine times are the kernel
                            sum of every row (the same work).
  layer batch, registered, answered when queued
                            the same with completion="stream": each call returns once the
                            daemon has queued the layer, the current stream waits on its event;
                            the run ends when that stream is done.
  layer batch, registered, returns before the answer
                            the same with completion="async": each call returns once its
                            batch is sent on the client's ordered ConvertBatches stream; the
                            current stream writes a ready word and waits for the daemon's done
                            word (shared host memory), no event; errors come at wait_async().
  layer batch, registered, default completion
                            the same with the drop-in's default, completion="auto": "async"
                            once the client's first call has been answered (else "stream").
  projection, registered    swizzle_mxfp4 per projection (two round trips per layer), as the
                            loaders call _swizzle_mxfp4 today (its default completion); same
                            buffers.
  model batch, registered   swizzle_mxfp4_batch over every layer at once: one round trip for the
                            model, so its wall time is the GPU work plus one call; the layer
                            batch's wall time minus this one, per layer, is what a round trip
                            per layer adds (the daemon's items overlap on its streams, so the
                            sum of their engine times counts overlapped time more than once).
  layer batch, fresh        the drop-in allocates every output (torch's caching allocator);
                            the memory goes back to CUDA between runs, so each run's outputs are
                            new allocations whose handles the daemon opens on first use.

Reported: wall time from the first call to the last completion, the sum of the daemon's
engine times (BatchItemResult.kernel_seconds of the host-completion layer batches), their
difference per layer, and a device copy of the same input bytes (torch copy_, CUDA events) for
scale. With several streams per GPU a layer's items overlap, so the engine times overstate the
GPU's work; --daemon-arg=--streams-per-device=1 makes them sum to it. Correctness is the GPU tests' job
(client/python/tests/test_gpu.py); this script only times.

    WPREPD=.bundle/bin/wprepd LD_LIBRARY_PATH=.bundle/lib PYTHONPATH=client/python \
        python3 client/python/bench/swizzle_bench.py [--layers 24] [--reps 5] [--target ADDR] [--json FILE]
        [--unpadded-scales]

Without --target it starts its own wprepd ($WPREPD) on the GPUs. Exits 3 without a GPU.
"""

import argparse
import datetime
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import wprep  # noqa: E402
from wprep.testing import LocalDaemon  # noqa: E402

E, K = 32, 2880
PROJECTIONS = {"w13": 5760, "w2": 2880}  # N
DEFAULT_LIMIT, ASYNC_LIMIT = 2.0, 1.6  # wall time over the device copy of the input bytes
QUEUED = "layer batch, registered, answered when queued"
ASYNC = "layer batch, registered, returns before the answer"
DEFAULT = "layer batch, registered, default completion"


def import_cuda_torch():
    """torch, with a GPU; None (having said why) where either is missing: the benches exit 3."""
    try:
        import torch
    except ImportError as e:
        print(f"no torch: {e}")
        return None
    if not torch.cuda.is_available():
        print("no GPU")
        return None
    return torch


def make_model(torch, layers):
    g = torch.Generator(device="cuda").manual_seed(1234)
    model = []
    for _ in range(layers):
        layer = []
        for n in PROJECTIONS.values():
            v = torch.randint(0, 256, (E, n, K // 2), dtype=torch.uint8, device="cuda", generator=g)
            s = torch.randint(0, 256, (E, n, K // 32), dtype=torch.uint8, device="cuda", generator=g)
            layer.append((v, s))
        model.append(layer)
    torch.cuda.synchronize()
    return model


def device_copy_ms(torch, model, outs, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(reps + 1):
        start.record()
        for layer, layer_out in zip(model, outs):
            for (v, s), (vo, so) in zip(layer, layer_out):
                vo.as_strided((v.numel(),), (1,)).copy_(v.view(-1))
                so.as_strided((s.numel(),), (1,)).copy_(s.view(-1))
        end.record()
        end.synchronize()
        if r:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def timed(torch, reps, run, before=None):
    """Median wall ms and kernel ms of `run` (which returns kernel seconds, or None when its
    answers carry none) over reps, after a warm-up."""
    walls, kernels = [], []
    for r in range(reps + 1):
        if before is not None:
            before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        k = run()
        wall = (time.perf_counter() - t0) * 1e3
        if r:
            walls.append(wall)
            if k is not None:
                kernels.append(k * 1e3)
    return statistics.median(walls), statistics.median(kernels) if kernels else None, walls


def _log_time(line):
    """The ts= of a daemon log line, as seconds since the epoch."""
    ts = line.split(" ", 1)[0][3:].rstrip("Z")
    return datetime.datetime.fromisoformat(ts).replace(tzinfo=datetime.timezone.utc).timestamp()


def call_split(client, daemon, model, outs, nw, completion):
    """One more run of the registered layer batches, each call cut at the gRPC call's send and
    answer (time.time(), the clock of the daemon's log) and at the handler's start and end (its
    request log): the Python before the call, the way in, the handler, the way out, the Python after."""
    import torch

    torch_sync = torch.cuda.synchronize
    marks = []
    unary = client._unary

    def timed_unary(method, request, timeout):
        marks[-1].append(time.time())
        try:
            return unary(method, request, timeout)
        finally:
            marks[-1].append(time.time())

    client._unary = timed_unary
    try:
        for layer, lo in zip(model, outs):
            marks.append([time.time()])
            wprep.swizzle_mxfp4_batch(layer, nw, client=client, out=lo, completion=completion)
            marks[-1].append(time.time())
        torch_sync()
    finally:
        del client._unary
    lines = [ln for ln in daemon.log().splitlines() if "method=ConvertBatch " in ln and " seconds=" in ln]
    if len(lines) < len(marks) or any(len(m) != 4 for m in marks):
        return None
    parts = {"python before": [], "in": [], "handler": [], "out": [], "python after": []}
    for (t0, t1, t2, t3), line in zip(marks, lines[-len(marks):]):
        end = _log_time(line)
        seconds = float(line.split(" seconds=")[1].split()[0])
        for k, v in (("python before", t1 - t0), ("in", end - seconds - t1), ("handler", seconds),
                     ("out", t2 - end), ("python after", t3 - t2)):
            parts[k].append(v * 1e6)
    return {k: statistics.median(v) for k, v in parts.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--num-warps", type=int, default=8)
    ap.add_argument("--target", help="a running wprepd (default: start one from $WPREPD)")
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="a flag for the wprepd this script starts (repeatable), e.g. --daemon-arg=--streams-per-device=1")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--profile", help="also profile the registered async layer batches (cProfile) into this text file")
    ap.add_argument("--unpadded-scales", action="store_true",
                    help="pad_scales=False: the unpadded sm_90 scale layout, to compare with clients older than "
                         "the padded default")
    args = ap.parse_args()
    if args.unpadded_scales:
        pad = functools.partial
        wprep.swizzle_mxfp4_batch = pad(wprep.swizzle_mxfp4_batch, pad_scales=False)
        wprep.swizzle_mxfp4 = pad(wprep.swizzle_mxfp4, pad_scales=False)
        wprep.empty_swizzled_mxfp4 = pad(wprep.empty_swizzled_mxfp4, pad_scales=False)

    torch = import_cuda_torch()
    if torch is None:
        return 3
    daemon = None if args.target else LocalDaemon(args=args.daemon_arg)
    target = args.target or daemon.target
    client = wprep.Client(target, timeout=600)
    try:
        props = torch.cuda.get_device_properties(0)
        cap = torch.cuda.get_device_capability(0)
        model = make_model(torch, args.layers)
        in_bytes = sum(v.numel() + s.numel() for layer in model for v, s in layer)
        nw = args.num_warps

        outs = [[wprep.empty_swizzled_mxfp4(v, s, nw, client=client) for v, s in layer] for layer in model]
        out_bytes = sum(vo.untyped_storage().nbytes() + so.untyped_storage().nbytes() for lo in outs for vo, so in lo)
        allocations = client.register([t for layer in model for pair in layer for t in pair] +
                                      [t for lo in outs for pair in lo for t in pair])
        first = wprep.swizzle_mxfp4_batch(model[0], nw, client=client, out=outs[0])
        print(f"GPU {props.name} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}, wprep {wprep.__version__}; "
              f"{args.layers} layers, {in_bytes / 1e9:.2f} GB in, {out_bytes / 1e9:.2f} GB out, "
              f"{len(allocations)} allocations registered")
        print(f"layouts: {first[0].value_identity.layout}, {first[0].scale_identity.layout}; "
              f"triton_kernels objects: {'yes' if first[0].triton_values is not None else first[0].triton_error}")

        def layer_batches():
            k = 0.0
            for layer, lo in zip(model, outs):
                for r in wprep.swizzle_mxfp4_batch(layer, nw, client=client, out=lo, completion="host"):
                    k += r.kernel_seconds
            return k

        def layer_batches_queued():
            for layer, lo in zip(model, outs):
                wprep.swizzle_mxfp4_batch(layer, nw, client=client, out=lo, completion="stream")
            torch.cuda.current_stream().synchronize()  # the last completion
            return None

        def layer_batches_default():
            for layer, lo in zip(model, outs):
                wprep.swizzle_mxfp4_batch(layer, nw, client=client, out=lo)
            torch.cuda.current_stream().synchronize()  # the last completion
            client.wait_async(60)
            return None

        def layer_batches_async():
            for layer, lo in zip(model, outs):
                wprep.swizzle_mxfp4_batch(layer, nw, client=client, out=lo, completion="async")
            torch.cuda.current_stream().synchronize()  # the last completion
            client.wait_async(60)
            return None

        def model_batch():
            pairs = [p for layer in model for p in layer]
            rs = wprep.swizzle_mxfp4_batch(pairs, nw, client=client, out=[o for lo in outs for o in lo],
                                           completion="host")
            return sum(r.kernel_seconds for r in rs)

        def projections():
            for layer, lo in zip(model, outs):
                for (v, s), o in zip(layer, lo):
                    wprep.swizzle_mxfp4(v, s, nw, client=client, out=o)
            torch.cuda.current_stream().synchronize()
            return None

        fresh_outs = []

        def give_back():
            if fresh_outs:
                client.release([t for r in fresh_outs for t in (r.values, r.scales)])
                fresh_outs.clear()
            torch.cuda.empty_cache()

        def fresh():
            for layer in model:
                fresh_outs.extend(wprep.swizzle_mxfp4_batch(layer, nw, client=client))
            torch.cuda.current_stream().synchronize()
            return None

        rows = []
        handler = {}  # variant -> the daemon's ConvertBatch handler times (ms), from its request log

        def logged_batches(text):
            out = []
            for line in text.splitlines():
                if "method=ConvertBatch" in line and " seconds=" in line:
                    out.append(1e3 * float(line.split(" seconds=")[1].split()[0]))
            return out

        for name, run, before in (("layer batch, registered", layer_batches, None),
                                  (QUEUED, layer_batches_queued, None),
                                  (ASYNC, layer_batches_async, None),
                                  (DEFAULT, layer_batches_default, None),
                                  ("model batch, registered", model_batch, None),
                                  ("projection, registered", projections, None)):
            seen = len(logged_batches(daemon.log())) if daemon is not None else 0
            rows.append((name,) + timed(torch, args.reps, run, before))
            if daemon is not None:
                handler[name] = logged_batches(daemon.log())[seen:]
        splits = {}
        if daemon is not None:
            for name, completion in (("layer batch, registered", "host"), (QUEUED, "stream")):
                splits[name] = call_split(client, daemon, model, outs, nw, completion)
        if args.profile:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.reps):
                layer_batches_async()
            prof.disable()
            text = io.StringIO()
            st = pstats.Stats(prof, stream=text)
            st.sort_stats("tottime").print_stats(30)
            st.sort_stats("cumulative").print_stats(30)
            Path(args.profile).write_text(text.getvalue())
        copy_ms = device_copy_ms(torch, model, outs, args.reps)
        client.release([t for lo in outs for pair in lo for t in pair])  # room in the daemon's IPC cache
        outs.clear()  # the registered outputs go back to the allocator
        rows.append(("layer batch, fresh",) + timed(torch, args.reps, fresh, give_back))
        give_back()

        print(f"\n{args.layers} layers, median of {args.reps} runs (first run dropped); "
              f"device copy of the input bytes: {copy_ms:.2f} ms")
        print("| variant | wall ms | sum of kernel ms | overhead ms per layer | wall / copy |")
        print("|---|---|---|---|---|")
        figures = {"unpadded_scales": args.unpadded_scales, "gpu": props.name, "capability": list(cap), "layers": args.layers, "reps": args.reps,
                   "device_copy_ms": copy_ms, "variants": {}}
        work_ms = rows[0][2]  # the host-completion layer batches' engine times: every row's work
        for name, wall, kern, walls in rows:
            shown = f"{kern:.2f}" if kern is not None else f"({work_ms:.2f})"
            kern = work_ms if kern is None else kern
            per_layer = (wall - kern) / args.layers
            print(f"| {name} | {wall:.2f} | {shown} | {per_layer:.3f} | {wall / copy_ms:.2f} |")
            figures["variants"][name] = {"wall_ms": wall, "kernel_ms": kern, "overhead_ms_per_layer": per_layer,
                                         "wall_ms_runs": walls}
        print(f"(a kernel sum in parentheses: the answers carry none, so it is the first row's, the same work)")
        lb, mb = figures["variants"]["layer batch, registered"], figures["variants"]["model batch, registered"]
        per_round_trip = (lb["wall_ms"] - mb["wall_ms"]) / max(1, args.layers - 1)
        print(f"a round trip per layer adds {per_round_trip:.3f} ms a layer "
              f"(layer batches {lb['wall_ms']:.2f} ms, one model batch {mb['wall_ms']:.2f} ms)")
        figures["round_trip_ms_per_layer"] = per_round_trip
        for name, times in handler.items():
            if times:
                print(f"daemon's ConvertBatch handler, {name}: median {statistics.median(times):.3f} ms "
                      f"of {len(times)} calls")
                figures["variants"][name]["handler_ms_median"] = statistics.median(times)
        for name, split in splits.items():
            if split:
                print(f"{name}, where a call's time goes (median us a layer): " +
                      ", ".join(f"{k} {v:.0f}" for k, v in split.items()))
                figures["variants"][name]["call_split_us"] = split
        accept = {}
        for name, limit in ((DEFAULT, DEFAULT_LIMIT), (ASYNC, ASYNC_LIMIT)):
            ratio = figures["variants"][name]["wall_ms"] / copy_ms
            accept[name] = {"wall_over_copy": ratio, "limit": limit, "verdict": "PASS" if ratio <= limit else "FAIL"}
            print(f"goal: {name} <= {limit}x the copy: {ratio:.2f}x, {accept[name]['verdict']}")
        if "--streams-per-device=1" not in args.daemon_arg:
            print("note: a layer's items run on several streams at once, so their kernel times overlap and "
                  "their sum overstates the GPU's work; --daemon-arg=--streams-per-device=1 gives kernel "
                  "times that sum to it")
        figures["acceptance"] = accept
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
        return 0
    finally:
        client.close()
        if daemon is not None:
            daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
