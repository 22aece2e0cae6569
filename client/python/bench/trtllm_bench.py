#!/usr/bin/env python3
"""trtllm-gen MXFP4 MoE weight preparation: the upstream way (vLLM's sequence in torch) vs wprep.

One gpt-oss-120b MoE layer (128 experts, H = I = 2880, MXFP4, random bytes) is prepared for
FlashInfer's trtllm-gen fused MoE (docs/TRTLLM_GEN.md, sections 0-8) three ways, in one run:

  upstream    torch, as vLLM's TRTLLM MXFP4 backends do it (Mxfp4MoEMethod.process_weights_
              after_loading): load-time zero padding to rup(., 256), swap_every_two_rows of
              w1/w3, per-expert gathers through permute-index tables built as FlashInfer builds
              them (get_shuffle_matrix_a_row_indices / get_shuffle_matrix_sf_a_row_indices,
              bias as an [R, 1] matrix) and cached once per shape (vLLM's
              _cache_permute_indices), the 128x4 block_scale_interleave per expert, torch.stack.
              Timed with CUDA events (median of --reps after warm-up); its peak extra
              allocation is torch.cuda.max_memory_allocated() minus what was allocated before.
  wprep       wprep.trtllm.prepare_layer(...) through a wprepd this script starts, out= into
              preallocated CUDA tensors (CUDA IPC, in place), timed the same way, next to a
              device copy of the inputs' bytes (each input copied into an output buffer).
              The outputs must equal the upstream way's byte for byte (else exit 1).
  whole model --layers layers (36 = all of gpt-oss-120b), one prepare_layer per layer, and all of
              them in one prepare_layers batch, into
              preallocated outputs, then torch.cuda.synchronize(); vs the copy of all layers.
              --sources N keeps N distinct input layers that layer l reads as input l mod N, the
              way a loader stages the checkpoint's layers through a few buffers: the outputs of
              all 36 layers (69.5 GB) and two sources fit an 80 GB card, 36 of each do not.

    WPREPD=build/server/wprepd PYTHONPATH=client/python python3 client/python/bench/trtllm_bench.py
    ... --device cpu --experts 4 --hidden 256 --layers 2 --reps 3     # CPU smoke run (bytes, no IPC)

On --device cpu the daemon runs with --devices=cpu, tensors travel inline and the times are
wall-clock; the byte equality is checked all the same. Works with torch 1.13 and 2.x.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's wprep

import wprep.trtllm as tg  # noqa: E402
from wprep import Client  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
EPILOGUE_TILE_M = 128
ALIGN = 256  # vLLM/SGLang round H and I up to 256 for the TRTLLM backends
GIB = float(1 << 30)


def rup(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# ------------------------------------------------------------------------------------------
# The upstream way: FlashInfer's index builders and vLLM's sequence, restated in torch.

def shuffle_block_size(epilogue_tile_m: int) -> int:
    """FlashInfer get_shuffle_block_size."""
    return 32 if epilogue_tile_m % 128 == 0 else 16


def get_shuffle_matrix_a_row_indices(x: torch.Tensor, epilogue_tile_m: int) -> torch.Tensor:
    """FlashInfer get_shuffle_matrix_a_row_indices (the vectorised edition, #2935): a CPU int64
    tensor `row_indices` with row_indices[new_row] = old_row, from the srcToDstBlk{16,32}RowMap
    table dst(r) = 8*(r % (B/8)) + r // (B/8) inside each block of B rows."""
    m = x.shape[0]
    b = shuffle_block_size(epilogue_tile_m)
    assert m % b == 0, f"rows {m} not a multiple of the shuffle block {b}"
    row_map = torch.tensor([8 * (r % (b // 8)) + r // (b // 8) for r in range(b)], dtype=torch.long)
    old = torch.arange(m, dtype=torch.long)
    new = (old // b) * b + row_map[old % b]
    row_indices = torch.empty(m, dtype=torch.long)
    row_indices[new] = old
    return row_indices


def get_shuffle_matrix_sf_a_row_indices(x: torch.Tensor, epilogue_tile_m: int, num_elts_per_sf: int = 16) -> torch.Tensor:
    """FlashInfer get_shuffle_matrix_sf_a_row_indices: the same rows, uint8 scales, M % 128 == 0."""
    assert x.dtype == torch.uint8, x.dtype
    assert num_elts_per_sf in (16, 32), num_elts_per_sf
    assert x.shape[0] % 128 == 0, x.shape
    return get_shuffle_matrix_a_row_indices(x, epilogue_tile_m)


def get_w2_permute_indices_with_cache(cache: Dict[Any, torch.Tensor], w: torch.Tensor, epilogue_tile_m: int,
                                      num_elts_per_sf: Optional[int] = None) -> torch.Tensor:
    """FlashInfer get_w2_permute_indices_with_cache: built on the host once per key, kept on the
    tensor's device (keyed by every parameter, as since FlashInfer #4320)."""
    key = ("w2", tuple(w.shape), epilogue_tile_m, num_elts_per_sf)
    if key not in cache:
        if num_elts_per_sf is None:
            idx = get_shuffle_matrix_a_row_indices(w, epilogue_tile_m)
        else:
            idx = get_shuffle_matrix_sf_a_row_indices(w, epilogue_tile_m, num_elts_per_sf)
        cache[key] = idx.to(w.device)
    return cache[key]


def block_scale_interleave(sf: torch.Tensor) -> torch.Tensor:
    """nvfp4_block_scale_interleave of one expert's [M, C] uint8 scales: the flat 128x4 layout
    (contract S5), as FlashInfer's torch reference swizzle_sf writes it: pad to [Mp, Cp] with
    zeros, view [Mp/128, 4, 32, Cp/4, 4], permute to [Mp/128, Cp/4, 32, 4, 4]. (FlashInfer runs
    one CUDA kernel here; this is one copy kernel when no padding is needed.)"""
    m, c = sf.shape
    mp, cp = rup(m, 128), rup(c, 4)
    if (mp, cp) != (m, c):
        p = torch.zeros((mp, cp), dtype=sf.dtype, device=sf.device)
        p[:m, :c] = sf
        sf = p
    return sf.reshape(mp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4).contiguous().reshape(-1)


def swap_every_two_rows(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """vLLM/SGLang swap_every_two_rows: reshape to pairs, flip each pair, reshape back."""
    shape = x.shape
    if axis < 0:
        axis = len(shape) + axis
    new_shape = list(shape)
    new_shape[axis] = shape[axis] // 2
    new_shape.insert(axis + 1, 2)
    x = x.reshape(*new_shape)
    x = x.flip(axis + 1)
    return x.reshape(*list(shape))


def load_padded(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """vLLM create_weights + FusedMoE.weight_loader: torch.zeros of the padded shape, the
    checkpoint tensor copied into its corner."""
    p = torch.zeros(tuple(shape), dtype=x.dtype, device=x.device)
    p[tuple(slice(0, s) for s in x.shape)].copy_(x)
    return p


def upstream_layer(w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], cache: Dict[Any, torch.Tensor],
                   align: int = ALIGN) -> Tuple[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]:
    """vLLM's TRTLLM MXFP4 preparation of one layer: ((values, scales, bias) of w13, of w2)."""
    v13, s13, b13 = w13
    v2, s2, b2 = w2
    e, r13, hb = v13.shape
    i, h = r13 // 2, 2 * hb
    ip, hp = rup(i, align), rup(h, align)
    sf_block = 32
    # Load time: the parameters are allocated padded and zero-filled; the shards go in the corner.
    # (Held for the whole call, as vLLM's layer parameters are until they are replaced.)
    p_v13 = load_padded(v13, (e, 2 * ip, hp // 2))
    p_s13 = load_padded(s13, (e, 2 * ip, hp // sf_block))
    p_b13 = load_padded(b13, (e, 2 * ip))
    p_v2 = load_padded(v2, (e, hp, ip // 2))
    p_s2 = load_padded(s2, (e, hp, ip // sf_block))
    p_b2 = load_padded(b2, (e, hp))

    w13_weight_scale = p_s13
    w2_weight_scale = p_s2
    w13_weight = p_v13
    w2_weight = p_v2
    w13_bias = p_b13.to(torch.float32)
    w2_bias = p_b2.to(torch.float32)

    # Swap w1 and w3: the definition of swiglu differs in trtllm-gen.
    w13_weight_scale = swap_every_two_rows(w13_weight_scale, -2)
    w13_weight = swap_every_two_rows(w13_weight, -2)
    w13_bias = swap_every_two_rows(w13_bias, -1)

    g1w: List[torch.Tensor] = []
    g1s: List[torch.Tensor] = []
    g2w: List[torch.Tensor] = []
    g2s: List[torch.Tensor] = []
    g1b: List[torch.Tensor] = []
    g2b: List[torch.Tensor] = []
    tile = EPILOGUE_TILE_M
    for k in range(e):
        idx = get_w2_permute_indices_with_cache(cache, w13_weight[k].view(torch.uint8), tile)
        g1w.append(w13_weight[k].view(torch.uint8)[idx.to(w13_weight.device)].contiguous())
        idx = get_w2_permute_indices_with_cache(cache, w13_weight_scale[k].view(torch.uint8), tile, num_elts_per_sf=16)
        g1s.append(block_scale_interleave(
            w13_weight_scale[k].view(torch.uint8)[idx.to(w13_weight_scale.device)].contiguous()))
        idx = get_w2_permute_indices_with_cache(cache, w13_bias[k].clone().reshape(-1, 1), tile)
        g1b.append(w13_bias[k].clone().reshape(-1, 1)[idx.to(w13_bias.device)].contiguous())

        idx = get_w2_permute_indices_with_cache(cache, w2_weight[k].view(torch.uint8), tile)
        g2w.append(w2_weight[k].view(torch.uint8)[idx.to(w2_weight.device)].contiguous())
        idx = get_w2_permute_indices_with_cache(cache, w2_weight_scale[k].view(torch.uint8), tile, num_elts_per_sf=16)
        g2s.append(block_scale_interleave(
            w2_weight_scale[k].view(torch.uint8)[idx.to(w2_weight_scale.device)].contiguous()))
        idx = get_w2_permute_indices_with_cache(cache, w2_bias[k].clone().reshape(-1, 1), tile)
        g2b.append(w2_bias[k].clone().reshape(-1, 1)[idx.to(w2_bias.device)].contiguous())

    out_v13 = torch.stack(g1w)
    out_s13 = torch.stack(g1s).reshape(e, 2 * ip, hp // sf_block)  # vLLM then .view(float8_e4m3fn)
    out_v2 = torch.stack(g2w)
    out_s2 = torch.stack(g2s).reshape(e, hp, ip // sf_block)
    out_b13 = torch.stack(g1b).reshape(e, -1)
    out_b2 = torch.stack(g2b).reshape(e, -1)
    return (out_v13, out_s13, out_b13), (out_v2, out_s2, out_b2)


# ------------------------------------------------------------------------------------------
# Shapes, buffers, timing

def in_shapes(e: int, h: int, i: int) -> Dict[str, Tuple[int, ...]]:
    return {"v13": (e, 2 * i, h // 2), "s13": (e, 2 * i, h // 32), "b13": (e, 2 * i),
            "v2": (e, h, i // 2), "s2": (e, h, i // 32), "b2": (e, h)}


def out_shapes(e: int, h: int, i: int, align: int = ALIGN) -> Dict[str, Tuple[int, ...]]:
    ip, hp = rup(i, align), rup(h, align)
    return {"v13": (e, 2 * ip, hp // 2), "s13": (e, 2 * ip, hp // 32), "b13": (e, 2 * ip),
            "v2": (e, hp, ip // 2), "s2": (e, hp, ip // 32), "b2": (e, hp)}


KEYS = ("v13", "s13", "b13", "v2", "s2", "b2")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def random_bytes(shape: Sequence[int], dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as `dtype` (float32/bfloat16 biases: raw bit patterns, NaNs included)."""
    size = torch.empty((), dtype=dtype).element_size()
    shape = list(shape)
    raw = torch.randint(0, 256, shape[:-1] + [shape[-1] * size], dtype=torch.uint8, device=device, generator=gen)
    return raw if dtype == torch.uint8 else raw.view(dtype)


def make_layer(e: int, h: int, i: int, bias_dtype: torch.dtype, device: str,
               gen: torch.Generator) -> Dict[str, torch.Tensor]:
    return {k: random_bytes(s, bias_dtype if k.startswith("b") else torch.uint8, device, gen)
            for k, s in in_shapes(e, h, i).items()}


def make_outputs(e: int, h: int, i: int, device: str) -> Dict[str, torch.Tensor]:
    return {k: torch.empty(s, dtype=torch.float32 if k.startswith("b") else torch.uint8, device=device)
            for k, s in out_shapes(e, h, i).items()}


class Timer:
    """CUDA events on a GPU (the work of the call lies between the two events), else wall clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn: Callable[[], Any]) -> Tuple[float, Any]:
        """ms of fn(), and its result."""
        self.sync()
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            r = fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b), r
        t0 = time.perf_counter()
        r = fn()
        return (time.perf_counter() - t0) * 1e3, r

    def median(self, fn: Callable[[], Any], reps: int, warmup: int) -> Tuple[float, List[float]]:
        for _ in range(warmup):
            self.once(fn)
        ts = [self.once(fn)[0] for _ in range(reps)]
        return statistics.median(ts), ts


def copy_inputs_into(layer: Dict[str, torch.Tensor], outs: Dict[str, torch.Tensor]) -> None:
    """The device copy: each input's bytes into the front of an output-sized buffer."""
    for k in KEYS:
        src = byte_view(layer[k])
        byte_view(outs[k])[: src.numel()].copy_(src)


def equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (NaN biases compare by their bits, not as floats)."""
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and torch.equal(byte_view(a), byte_view(b))


# ------------------------------------------------------------------------------------------
def call_split(client: Any, daemon: Optional["Daemon"], run: Callable[[], None], timer: Any) -> Dict[str, float]:
    """One more run of `run` (one prepare_layers call and a synchronize), cut at the gRPC call's
    send and answer and at the daemon's handler (its request log's seconds=): the Python before
    the call, the way in (the call's start to the handler's), the handler (checks, mappings,
    launches and the wait for the GPU), the way out (the handler's end to the answer in Python),
    and the Python after. {} without a daemon of ours."""
    if daemon is None:
        return {}
    import datetime

    marks: List[float] = []
    unary = client._unary

    def timed_unary(method: str, request: Any, timeout: Optional[float]) -> Any:
        marks.append(time.time())
        try:
            return unary(method, request, timeout)
        finally:
            marks.append(time.time())

    client._unary = timed_unary
    timer.sync()
    t0 = time.time()
    try:
        run()
    finally:
        del client._unary
    t3 = time.time()
    lines = [ln for ln in daemon.read_log().splitlines() if "method=ConvertBatch " in ln and " seconds=" in ln]
    if len(marks) != 2 or not lines:
        return {}
    handler = float(lines[-1].split(" seconds=")[1].split()[0])
    # The log line's ts= is when the handler ended, on the same clock as time.time().
    ts = lines[-1].split(" ", 1)[0][3:].rstrip("Z")
    end = datetime.datetime.fromisoformat(ts).replace(tzinfo=datetime.timezone.utc).timestamp()
    t1, t2 = marks
    return {"wall": (t3 - t0) * 1e3, "python before": (t1 - t0) * 1e3, "in": (end - handler - t1) * 1e3,
            "handler": handler * 1e3, "out": (t2 - end) * 1e3, "python after": (t3 - t2) * 1e3}


# The daemon

class Daemon:
    """$WPREPD --listen=unix://SOCK --metrics-address= [--devices=cpu], waited for as the tests do."""

    def __init__(self, binary: str, socket: str, cpu: bool, extra: Sequence[str], timeout: float = 120.0) -> None:
        if not binary or not os.access(binary, os.X_OK):
            raise SystemExit(f"no wprepd binary at {binary!r}: set $WPREPD or --wprepd")
        if os.path.exists(socket):
            os.unlink(socket)
        self.log = tempfile.NamedTemporaryFile(prefix="wprep-bench-", suffix=".log", delete=False)
        self.port_file = self.log.name + ".ports"
        cmd = [binary, f"--listen=unix://{socket}", "--metrics-address=", f"--port-file={self.port_file}"]
        if cpu:
            cmd.append("--devices=cpu")
        cmd += list(extra)
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        self.target = f"unix://{socket}"
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None:
                raise SystemExit(f"wprepd exited with {self.proc.returncode} during start-up:\n{self.read_log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"wprepd did not start in {timeout} s:\n{self.read_log()}")
            time.sleep(0.01)
        with Client(self.target) as c:
            c.wait_serving(max(1.0, deadline - time.monotonic()))

    def read_log(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in (self.port_file,):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


# ------------------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2880, help="H = I (gpt-oss-120b: 2880)")
    ap.add_argument("--intermediate", type=int, default=None, help="I when it differs from H")
    ap.add_argument("--bias-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="checkpoint bias dtype (gpt-oss ships bfloat16; vLLM widens to float32 first)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=36, help="layers of the whole-model part (gpt-oss-120b: 36)")
    ap.add_argument("--sources", type=int, default=0,
                    help="distinct input layers, reused in turn (0: one per layer; 2 fits gpt-oss-120b on 80 GB)")
    ap.add_argument("--wprepd", default=os.environ.get("WPREPD") or str(REPO / "build" / "server" / "wprepd"))
    ap.add_argument("--socket", default="/tmp/wprep-bench.sock")
    ap.add_argument("--target", default=None, help="use this running daemon instead of starting one")
    ap.add_argument("--daemon-arg", action="append", default=[], help="extra wprepd flag (repeatable)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, metavar="PATH")
    a = ap.parse_args(argv)

    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda but torch finds no CUDA device", file=sys.stderr)
        return 2
    if cuda and "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", ""):
        print("note: expandable_segments allocations cannot be shared by CUDA IPC; unset it", file=sys.stderr)
    dev = "cuda" if cuda else "cpu"
    e, h = a.experts, a.hidden
    i = a.intermediate or a.hidden
    assert h % 32 == 0 and i % 32 == 0, "H and I must be multiples of 32"
    bias_dtype = torch.float32 if a.bias_dtype == "float32" else torch.bfloat16
    L = max(1, a.layers)
    S = L if a.sources <= 0 else min(L, a.sources)
    timer = Timer(cuda)
    res: Dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "experts": e, "hidden": h, "intermediate": i, "bias_dtype": a.bias_dtype, "align": ALIGN,
        "reps": a.reps, "warmup": a.warmup, "layers": L, "sources": S, "timing": "cuda events" if cuda else "wall clock",
    }
    failures: List[str] = []

    # Every buffer allocated once: S layers of inputs and L of outputs (gpt-oss-120b: 1.70 GB in
    # and 1.93 GB out per layer, 130 GB for 36 of each), plus the upstream way's transient peak
    # (~7 GB).
    if cuda:
        bsize = torch.empty((), dtype=bias_dtype).element_size()
        in_layer = sum(math.prod(sh) * (bsize if k.startswith("b") else 1) for k, sh in in_shapes(e, h, i).items())
        out_layer = sum(math.prod(sh) * (4 if k.startswith("b") else 1) for k, sh in out_shapes(e, h, i).items())
        free, _ = torch.cuda.mem_get_info()
        need = S * in_layer + L * out_layer + 2 * (in_layer + out_layer)
        if need > free:
            print(f"warning: {L} layers from {S} sources need about {need / GIB:.1f} GiB with the upstream way's "
                  f"peak, {free / GIB:.1f} GiB free; try --sources 2 or fewer --layers",
                  file=sys.stderr, flush=True)
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed)
    sources = [make_layer(e, h, i, bias_dtype, dev, gen) for _ in range(S)]
    layers = [sources[li % S] for li in range(L)]
    outs = [make_outputs(e, h, i, dev) for _ in range(L)]
    in_bytes = sum(nbytes(t) for t in layers[0].values())
    out_bytes = sum(nbytes(t) for t in outs[0].values())
    res["layer_in_bytes"], res["layer_out_bytes"] = in_bytes, out_bytes
    timer.sync()
    print(f"{res['device']}, torch {torch.__version__}: {e} experts, H {h}, I {i}, bias {a.bias_dtype}; "
          f"one layer {in_bytes / 1e6:.3f} MB in, {out_bytes / 1e6:.3f} MB out; {L} layers allocated"
          + ("" if S == L else f" (inputs: {S} distinct layers, layer l reads input l mod {S})")
          + (f" ({torch.cuda.memory_allocated() / GIB:.1f} GiB)" if cuda else ""), flush=True)

    x0 = layers[0]
    w13_in = (x0["v13"], x0["s13"], x0["b13"])
    w2_in = (x0["v2"], x0["s2"], x0["b2"])

    # 1. The upstream way.
    cache: Dict[Any, torch.Tensor] = {}
    t_cold, up = timer.once(lambda: upstream_layer(w13_in, w2_in, cache))  # builds the index tables
    up = None
    up_ms, up_all = timer.median(lambda: upstream_layer(w13_in, w2_in, cache), a.reps, a.warmup)
    peak_extra = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        up = upstream_layer(w13_in, w2_in, cache)
        torch.cuda.synchronize()
        peak_extra = torch.cuda.max_memory_allocated() - base
    else:
        up = upstream_layer(w13_in, w2_in, cache)
    res["upstream"] = {"ms": up_ms, "all_ms": up_all, "first_call_ms_with_tables": t_cold,
                       "peak_extra_bytes": peak_extra,
                       "peak_note": "max_memory_allocated() - memory_allocated() before the call; includes the "
                                    "padded copies of the inputs (vLLM's padded parameters) and the outputs"}
    print(f"upstream: {up_ms:.3f} ms median (first call with index tables {t_cold:.3f} ms)"
          + (f", peak extra {peak_extra / GIB:.3f} GiB" if peak_extra is not None else ""), flush=True)

    # 2. wprep, one layer, and the copy of the same bytes.
    o0 = outs[0]
    copy_ms, copy_all = timer.median(lambda: copy_inputs_into(x0, o0), a.reps, a.warmup)
    res["copy"] = {"ms": copy_ms, "all_ms": copy_all, "bytes": in_bytes,
                   "what": "each input's bytes copied into an output-sized buffer (6 copies)"}
    print(f"copy: {copy_ms:.3f} ms median ({in_bytes / copy_ms / 1e6:.1f} GB/s)", flush=True)

    if a.target:
        daemon = None
        target = a.target
    else:
        daemon = Daemon(a.wprepd, a.socket, not cuda, a.daemon_arg)
        target = daemon.target
    rc = 0
    try:
        with Client(target, timeout=600) as client:
            def wprep_layer(x: Dict[str, torch.Tensor], o: Dict[str, torch.Tensor]) -> Any:
                return tg.prepare_layer((x["v13"], x["s13"], x["b13"]), (x["v2"], x["s2"], x["b2"]),
                                        out13=(o["v13"], o["s13"], o["b13"]), out2=(o["v2"], o["s2"], o["b2"]),
                                        client=client)

            ptrs = [o0[k].data_ptr() for k in KEYS]
            r13, r2 = wprep_layer(x0, o0)  # first call: IPC handles exported and opened
            res["engine"] = r13.engine
            res["identity"] = r13.identity.description
            if cuda and not r13.engine.startswith("cuda"):
                failures.append(f"wprep ran on engine {r13.engine!r}, not in place on the GPU")
            wp_ms, wp_all = timer.median(lambda: wprep_layer(x0, o0), a.reps, a.warmup)
            res["wprep_layer"] = {"ms": wp_ms, "all_ms": wp_all, "ratio_to_copy": wp_ms / copy_ms,
                                  "upstream_ratio_to_copy": up_ms / copy_ms}
            print(f"wprep layer: {wp_ms:.3f} ms median, {wp_ms / copy_ms:.2f}x the copy; engine {r13.engine}",
                  flush=True)
            if [o0[k].data_ptr() for k in KEYS] != ptrs:
                failures.append("an out= tensor's data_ptr() changed")
            timer.sync()
            up_d = dict(zip(KEYS, up[0] + up[1]))
            for k in KEYS:
                if not equal_bytes(o0[k], up_d[k]):
                    failures.append(f"layer 0 {k}: wprep output {tuple(o0[k].shape)} {o0[k].dtype} differs from the "
                                    f"upstream way's {tuple(up_d[k].shape)} {up_d[k].dtype}")
            up = up_d = None
            if cuda:
                torch.cuda.empty_cache()

            # 3. The whole model: copy of every layer's bytes, then every layer through wprep.
            def copy_all_layers() -> None:
                for x, o in zip(layers, outs):
                    copy_inputs_into(x, o)

            def wprep_all_layers() -> None:
                for x, o in zip(layers, outs):
                    wprep_layer(x, o)
                timer.sync()

            def wprep_model_one_batch() -> None:
                tg.prepare_layers([((x["v13"], x["s13"], x["b13"]), (x["v2"], x["s2"], x["b2"])) for x in layers],
                                  out=[((o["v13"], o["s13"], o["b13"]), (o["v2"], o["s2"], o["b2"])) for o in outs],
                                  client=client)
                timer.sync()

            mreps = max(1, min(a.reps, 3))
            wprep_all_layers()  # first sight of the other layers' tensors (IPC handles)
            mcopy_ms, _ = timer.median(copy_all_layers, mreps, 1)
            model_ms, model_all = timer.median(wprep_all_layers, mreps, 1)
            batch_ms, batch_all = timer.median(wprep_model_one_batch, mreps, 1)
            # A loader's parameter tensors are fixed for the model's life: registered once
            # (Client.register), no call exports or opens a handle again.
            reg_ms = reg_all = None
            split = {}
            if cuda:
                client.register([t for d in sources + outs for t in d.values()])
                reg_ms, reg_all = timer.median(wprep_model_one_batch, mreps, 1)
                splits = [call_split(client, daemon, wprep_model_one_batch, timer) for _ in range(3)]
                if all(splits):
                    split = {k: statistics.median(sp[k] for sp in splits) for k in splits[0]}
            res["whole_model"] = {"layers": L, "sources": S, "ms": model_ms, "all_ms": model_all, "copy_ms": mcopy_ms,
                                  "ratio_to_copy": model_ms / mcopy_ms, "bytes_in": L * in_bytes,
                                  "bytes_out": L * out_bytes, "one_batch_ms": batch_ms, "one_batch_all_ms": batch_all,
                                  "one_batch_ratio_to_copy": batch_ms / mcopy_ms,
                                  "one_batch_registered_ms": reg_ms, "one_batch_registered_all_ms": reg_all,
                                  "one_batch_registered_ratio_to_copy": None if reg_ms is None else reg_ms / mcopy_ms}
            print(f"whole model: {L} layers in {model_ms:.2f} ms (a call per layer), {batch_ms:.2f} ms "
                  f"(prepare_layers, one batch), copy {mcopy_ms:.2f} ms: {model_ms / mcopy_ms:.2f}x, "
                  f"{batch_ms / mcopy_ms:.2f}x", flush=True)
            if reg_ms is not None:
                print(f"whole model, one batch, tensors registered: {reg_ms:.2f} ms, {reg_ms / mcopy_ms:.2f}x the copy",
                      flush=True)
            if split:
                res["whole_model"]["registered_call_split_ms"] = split
                print("whole model, one batch, registered, where the call's time goes (ms, median of 3 more runs): " +
                      ", ".join(f"{k} {v:.2f}" for k, v in split.items()), flush=True)
            # Every layer again byte-equal to the upstream way? Layer 0 and the last one, spot-checked.
            for li in sorted({0, L - 1}):
                u13, u2 = upstream_layer((layers[li]["v13"], layers[li]["s13"], layers[li]["b13"]),
                                         (layers[li]["v2"], layers[li]["s2"], layers[li]["b2"]), cache)
                for k, u in zip(KEYS, u13 + u2):
                    if not equal_bytes(outs[li][k], u):
                        failures.append(f"whole model, layer {li} {k}: wprep output differs from the upstream way")
                u13 = u2 = None
    finally:
        if daemon is not None:
            daemon.stop()
            if failures:
                print(f"wprepd log ({daemon.log.name}):\n{daemon.read_log()[-4000:]}", file=sys.stderr)
            else:
                os.unlink(daemon.log.name)

    res["equal"] = not failures
    res["failures"] = failures
    if failures:
        rc = 1
        print("\n" + "!" * 72, file=sys.stderr)
        for f in failures:
            print(f"MISMATCH: {f}", file=sys.stderr)
        print("!" * 72 + "\n", file=sys.stderr, flush=True)

    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")

    u, w, c, m = res["upstream"], res["wprep_layer"], res["copy"], res["whole_model"]
    peak = "n/a" if u["peak_extra_bytes"] is None else f"{u['peak_extra_bytes'] / GIB:.3f}"
    print(f"\n{'':14}{'ms':>11}  {'peak extra GiB':>14}  {'x copy':>7}  layers   ({res['timing']}, "
          f"{e} experts, H {h}, I {i}; bytes {'equal' if not failures else 'DIFFER'})")
    print(f"{'upstream':14}{u['ms']:11.3f}  {peak:>14}  {u['ms'] / c['ms']:7.2f}")
    print(f"{'wprep layer':14}{w['ms']:11.3f}  {'':>14}  {w['ratio_to_copy']:7.2f}")
    print(f"{'copy':14}{c['ms']:11.3f}  {'':>14}  {1.0:7.2f}")
    print(f"{'whole model':14}{m['ms']:11.3f}  {'':>14}  {m['ratio_to_copy']:7.2f}  {m['layers']:>6}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
