#!/usr/bin/env python3
"""The client side of wprep.trtllm.prepare_layers, without a daemon or a GPU.

Times what Python spends on one whole-model batch (gpt-oss-120b: 36 layers, 72 MoE items,
432 CUDA tensors, all registered with the client's registry as Client.register does), split
into the request's construction (prepare_layers' arguments to a ConvertBatchRequest), the
wire work gRPC does (request serialized, answer parsed) and the answer's handling (the
MoeResult objects). The daemon is a stub that answers a synthetic ConvertBatchResponse of the
right outputs and identities, so only the client's work is measured.

    PYTHONPATH=client/python python3 client/python/bench/trtllm_client_bench.py            # fake torch
    PYTHONPATH=client/python python3 client/python/bench/trtllm_client_bench.py --torch real  # CUDA tensors
    ... --profile 25                                   # cProfile of the whole call, top 25 by tottime

--torch fake (the default where torch is not importable) stands in for torch with a small
pure-Python Tensor: its methods cost far less than torch's, so the torch-side share is
understated; the number of tensor method calls per batch (shown) is what carries over.
--torch real needs a CUDA device and allocates the tensors there (registering them exports real
IPC handles); its default is one expert a layer (about 1 GB for 36 layers), since the client's
cost does not depend on the tensors' sizes (--experts 128 is the whole model, about 130 GB).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's wprep


class _Counter:
    calls = 0


def fake_torch() -> types.ModuleType:
    """A stand-in for torch with what the CUDA IPC path of wprep.trtllm uses of a tensor."""
    torch = types.ModuleType("torch")
    torch.__version__ = "fake"

    class DType:
        def __init__(self, name: str, size: int) -> None:
            self.name, self.itemsize = name, size

        def __repr__(self) -> str:
            return f"torch.{self.name}"

    uint8, float32, bfloat16 = DType("uint8", 1), DType("float32", 4), DType("bfloat16", 2)

    class Device:
        type = "cuda"

        def __init__(self, index: int) -> None:
            self.index = index

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Device) and other.index == self.index

        def __hash__(self) -> int:
            return self.index

    class Storage:
        next_base = 1 << 40

        def __init__(self, nbytes: int) -> None:
            self.base, self._nbytes = Storage.next_base, nbytes
            Storage.next_base += (nbytes + (2 << 20)) & ~((2 << 20) - 1)

        def data_ptr(self) -> int:
            _Counter.calls += 1
            return self.base

        def nbytes(self) -> int:
            _Counter.calls += 1
            return self._nbytes

        def _share_cuda_(self) -> Tuple[Any, ...]:
            h = b"\x02c" + self.base.to_bytes(8, "little") * 8
            return (0, h, self._nbytes, 0, None, 0, b"\0" * 64, True)

    @functools.lru_cache(maxsize=None)
    def dense(shape: Tuple[int, ...]) -> Tuple[int, ...]:
        out, n = [], 1
        for d in reversed(shape):
            out.append(n)
            n *= d
        return tuple(reversed(out))

    class Tensor:
        is_cuda = True

        def __init__(self, storage: Storage, shape: Tuple[int, ...], dtype: DType, offset: int = 0,
                     strides: Any = None) -> None:
            self._storage, self._shape, self.dtype, self._offset = storage, tuple(shape), dtype, offset
            self._strides = dense(self._shape) if strides is None else tuple(strides)
            self.device = Device(0)

        @property
        def shape(self) -> Tuple[int, ...]:
            _Counter.calls += 1
            return self._shape

        def stride(self) -> Tuple[int, ...]:
            _Counter.calls += 1
            return self._strides

        def storage_offset(self) -> int:
            _Counter.calls += 1
            return self._offset

        def untyped_storage(self) -> Storage:
            _Counter.calls += 1
            return self._storage

        def element_size(self) -> int:
            _Counter.calls += 1
            return self.dtype.itemsize

        def numel(self) -> int:
            _Counter.calls += 1
            n = 1
            for d in self._shape:
                n *= d
            return n

        def is_contiguous(self) -> bool:
            _Counter.calls += 1
            return self._strides == dense(self._shape)

        def data_ptr(self) -> int:
            _Counter.calls += 1
            return self._storage.base + self._offset * self.dtype.itemsize

        def get_device(self) -> int:
            _Counter.calls += 1
            return self.device.index

        def detach(self) -> "Tensor":
            _Counter.calls += 1
            return Tensor(self._storage, self._shape, self.dtype, self._offset, self._strides)

        def reshape(self, *shape: int) -> "Tensor":
            _Counter.calls += 1
            assert shape == (-1,) and self._strides == dense(self._shape)
            return Tensor(self._storage, (self.numel(),), self.dtype, self._offset)

        def view(self, dtype: DType) -> "Tensor":
            _Counter.calls += 1
            assert len(self._shape) == 1
            k = self.dtype.itemsize // dtype.itemsize
            return Tensor(self._storage, (self._shape[0] * k,), dtype, self._offset * k)

    def empty(*shape: int, dtype: DType = uint8, device: Any = None) -> Tensor:
        n = dtype.itemsize
        for d in shape:
            n *= d
        return Tensor(Storage(n), shape, dtype)

    class Stream:
        def synchronize(self) -> None:
            pass

    torch.Tensor, torch.uint8, torch.float32, torch.bfloat16, torch.empty = Tensor, uint8, float32, bfloat16, empty
    torch.UntypedStorage = types.SimpleNamespace(_release_ipc_counter_cuda=lambda h, o: None)
    torch.cuda = types.SimpleNamespace(
        current_stream=lambda d=None: Stream(),
        get_device_properties=lambda i: types.SimpleNamespace(uuid=types.SimpleNamespace(bytes=list(range(16)))),
    )
    return torch


def gpt_oss_shapes(e: int, h: int, i: int, align: int) -> Tuple[Dict[str, Tuple[int, ...]], Dict[str, Tuple[int, ...]]]:
    ip, hp = -(-i // align) * align, -(-h // align) * align
    ins = {"v13": (e, 2 * i, h // 2), "s13": (e, 2 * i, h // 32), "b13": (e, 2 * i),
           "v2": (e, h, i // 2), "s2": (e, h, i // 32), "b2": (e, h)}
    outs = {"v13": (e, 2 * ip, hp // 2), "s13": (e, 2 * ip, hp // 32), "b13": (e, 2 * ip),
            "v2": (e, hp, ip // 2), "s2": (e, hp, ip // 32), "b2": (e, hp)}
    return ins, outs


KEYS = ("v13", "s13", "b13", "v2", "s2", "b2")


def make_tensor(torch: Any, shape: Tuple[int, ...], dtype: Any, real: bool) -> Any:
    if not real:
        return torch.empty(*shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype, device="cuda")


class StubClient:
    """What trtllm._call needs of a Client: a registry, and _unary answering a synthetic
    ConvertBatchResponse (every output an IPC destination, its identity as the daemon gives
    it). Records when the request arrived and when the answer left, and does gRPC's wire work
    (serialize the request, parse the answer) outside those marks."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry
        self.answer: bytes = b""
        self.marks: List[Tuple[float, float, float]] = []  # (arrived, wire seconds, left)

    def _unary(self, method: str, request: Any, timeout: Any) -> Any:
        from wprep.v1 import wprep_pb2 as pb

        arrived = time.perf_counter()
        wire = time.perf_counter()
        request.SerializeToString()
        if not self.answer:
            self.answer = synthetic_answer(request).SerializeToString()
        resp = pb.ConvertBatchResponse.FromString(self.answer)
        wire = time.perf_counter() - wire
        self.marks.append((arrived, wire, time.perf_counter()))
        return resp


def synthetic_answer(req: Any) -> Any:
    from wprep.v1 import wprep_pb2 as pb

    resp = pb.ConvertBatchResponse()
    for it in req.items:
        m = it.moe
        r = resp.items.add(engine="cuda:GPU-00010203-0405-0607-0809-0a0b0c0d0e0f", kernel_seconds=0.001)
        fmt = m.params.format if m.params.HasField("format") else "mxfp4"
        for o, x in zip(m.outputs, m.inputs):
            t = r.outputs.add(name=o.name, shape=list(x.shape), bytes=o.destination.ipc.size, dtype=x.dtype)
            t.strides.extend([1] * len(x.shape))
            t.moe_identity.format = fmt
            t.moe_identity.op = m.op
            t.moe_identity.params.CopyFrom(m.params)
            t.moe_identity.params.format = fmt
            if m.op == "prepare_w13" and not t.moe_identity.params.HasField("align"):
                t.moe_identity.params.align = 256
            t.moe_identity.contract_version = 1
            t.moe_identity.description = f"trtllm-gen {m.op} format={fmt} align=256 contract=1"
    return resp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch", choices=("fake", "real"), default=None,
                    help="fake: a pure-Python stand-in (default without torch); real: CUDA tensors")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--experts", type=int, default=None, help="default: 128 (fake), 1 (real)")
    ap.add_argument("--hidden", type=int, default=2880, help="H = I (gpt-oss-120b: 2880)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile: print the top N functions")
    a = ap.parse_args()

    kind = a.torch
    if kind is None:
        try:
            import torch  # noqa: F401

            kind = "real"
        except ImportError:
            kind = "fake"
    if kind == "fake":
        sys.modules["torch"] = fake_torch()
    try:
        import torch
    except ImportError as e:
        print(f"--torch real: {e}", file=sys.stderr)
        return 2

    if kind == "real" and not torch.cuda.is_available():
        print("--torch real needs a CUDA device", file=sys.stderr)
        return 2

    import wprep.trtllm as tg
    from wprep import _torch

    experts = a.experts or (1 if kind == "real" else 128)
    ins, outs = gpt_oss_shapes(experts, a.hidden, a.hidden, 256)
    dt = {"v": torch.uint8, "s": torch.uint8, "b": torch.float32}
    real = kind == "real"
    layers = [{k: make_tensor(torch, ins[k], dt[k[0]], real) for k in KEYS} for _ in range(a.layers)]
    outputs = [{k: make_tensor(torch, outs[k], dt[k[0]], real) for k in KEYS} for _ in range(a.layers)]
    registry = _torch.Registry()
    _torch.handle_refs([t for d in layers + outputs for t in d.values()], registry, register=True)
    client = StubClient(registry)
    args = [((x["v13"], x["s13"], x["b13"]), (x["v2"], x["s2"], x["b2"])) for x in layers]
    out = [((o["v13"], o["s13"], o["b13"]), (o["v2"], o["s2"], o["b2"])) for o in outputs]

    def once() -> Tuple[float, float, float, float]:
        t0 = time.perf_counter()
        r = tg.prepare_layers(args, out=out, client=client)
        t1 = time.perf_counter()
        assert len(r) == a.layers and r[-1][1].outputs["bias"] is outputs[-1]["b2"]
        arrived, wire, left = client.marks[-1]
        return (t1 - t0) * 1e3, (arrived - t0) * 1e3, wire * 1e3, (t1 - left) * 1e3

    for _ in range(a.warmup):
        once()
    _Counter.calls = 0
    runs = [once() for _ in range(a.reps)]
    calls = _Counter.calls / a.reps
    med = [statistics.median(r[k] for r in runs) for k in range(4)]
    low = [min(r[k] for r in runs) for k in range(4)]
    n_tensors = 12 * a.layers
    print(f"torch {kind}: {a.layers} layers, {2 * a.layers} MoE items, {n_tensors} CUDA tensors, registered; "
          f"ms, median (min) of {a.reps}")
    client_side = [r[0] - r[2] for r in runs]
    print(f"  prepare_layers, client side   {statistics.median(client_side):8.3f} ({min(client_side):.3f})  "
          f"all {med[0]:.3f} ({low[0]:.3f}) with the wire work")
    print(f"    request built               {med[1]:8.3f} ({low[1]:.3f})  {med[1] / n_tensors * 1e3:.2f} us a tensor")
    print(f"    answer handled              {med[3]:8.3f} ({low[3]:.3f})  {med[3] / (2 * a.layers) * 1e3:.2f} us an item")
    print(f"  wire (serialize + parse)      {med[2]:8.3f} ({low[2]:.3f})  gRPC's work, outside the client code")
    if kind == "fake":
        print(f"  tensor method calls a batch   {calls:8.0f}  {calls / n_tensors:.1f} a tensor")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            tg.prepare_layers(args, out=out, client=client)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
