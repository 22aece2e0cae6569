"""Where a drop-in layer call's Python time goes, step by step, with real torch on a GPU.

One gpt-oss-20b-shaped layer (w13 and w2 values and scales, outputs registered), each step
of swizzle_mxfp4_batch timed on its own: median microseconds of a few hundred calls.
Usage: WPREPD=build/server/wprepd python3 client/python/bench/call_steps.py [daemon flags...]
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch, wprep
from wprep import _torch, _requests, _mxfp4
from wprep.testing import LocalDaemon

def t(fn, n=400):
    xs = []
    for _ in range(n):
        a = time.perf_counter(); fn(); xs.append((time.perf_counter() - a) * 1e6)
    return statistics.median(xs)

d = LocalDaemon(args=sys.argv[1:])
c = wprep.Client(d.target, timeout=60)
E, K = 32, 2880
layer = []
for n in (5760, 2880):
    v = torch.randint(0, 256, (E, n, K // 2), dtype=torch.uint8, device="cuda")
    s = torch.randint(0, 256, (E, n, K // 32), dtype=torch.uint8, device="cuda")
    layer.append((v, s))
outs = [wprep.empty_swizzled_mxfp4(v, s, 8, client=c) for v, s in layer]
c.register([x for p in layer for x in p] + [x for p in outs for x in p])
for _ in range(20):
    wprep.swizzle_mxfp4_batch(layer, 8, client=c, out=outs)
torch.cuda.synchronize()
specs = _mxfp4.mxfp4_specs((9, 0), 8, _mxfp4.scale_align_k(None))  # the default: padded scale groups
items = []
for (v, s), o in zip(layer, outs):
    items += _mxfp4._items(v, s, specs, o)
rows = {}
rows["swizzle_mxfp4_batch, stream (full call)"] = t(lambda: wprep.swizzle_mxfp4_batch(layer, 8, client=c, out=outs))
torch.cuda.synchronize()
rows["swizzle_mxfp4_batch, host (full call)"] = t(lambda: wprep.swizzle_mxfp4_batch(layer, 8, client=c, out=outs, completion="host"), 200)
rows["swizzle_mxfp4_batch, stream, fresh outputs (full call)"] = t(lambda: wprep.swizzle_mxfp4_batch(layer, 8, client=c), 200)
torch.cuda.synchronize()
rows["_check_pair x2"] = t(lambda: [_mxfp4._check_pair(i, v, s) for i, (v, s) in enumerate(layer)])
rows["_capability"] = t(lambda: _mxfp4._capability(0))
rows["_items x2"] = t(lambda: [_mxfp4._items(v, s, specs, o) for (v, s), o in zip(layer, outs)])
rows["_plans_for (4 items)"] = t(lambda: c._plans_for([_requests.needs_plan(it.spec, it.logical_shape, it.source, it.out) for it in items], None))
pool = c._events
calls = []
def one():
    call = _requests.batch_call(items, None, {}, c._registry, None, "stream", pool)
    calls.append(call)
rows["batch_call build, stream (event record)"] = t(one)
for call in calls:
    call.release(True)
rows["batch_call build, host (stream sync)"] = t(lambda: _requests.batch_call(items, None, {}, c._registry, None, "host", pool))
call = _requests.batch_call(items, None, {}, c._registry, None, "host", pool)
rows["_Side x1 (src+dst)"] = t(lambda: _requests._Side(items[0].spec, items[0].logical_shape, items[0].source, items[0].out, None, {}, c._registry, "x"))
v0 = layer[0][0]
rows["source_view (registered)"] = t(lambda: _torch.source_view(v0, c._registry))
fresh = [torch.randint(0, 256, (4096,), dtype=torch.uint8, device="cuda") for _ in range(2)]
wprep._torch.source_view(fresh[0], wprep._torch.Registry())  # the allocation, exported once
rows["source_view (unregistered, allocation exported)"] = t(lambda: _torch.source_view(fresh[1], wprep._torch.Registry()))
rows["share_storage (torch's _share_cuda_)"] = t(lambda: wprep._torch.share_storage(fresh[1].untyped_storage(), 0))
rows["destination_view (registered)"] = t(lambda: _torch.destination_view(outs[0][0], c._registry))
rows["event take+record+give"] = t(lambda: (lambda e: (e[0].record(torch.cuda.current_stream(0)), pool.give(0, e)))(pool.take(0)))
rows["torch.cuda.current_stream(0)"] = t(lambda: torch.cuda.current_stream(0))
rows["current_stream().synchronize() idle"] = t(lambda: torch.cuda.current_stream(0).synchronize())
rows["SerializeToString"] = t(lambda: call.request.SerializeToString())
resp = c._stub.ConvertBatch(call.request, timeout=60)
rows["stub.ConvertBatch host, back to back"] = t(lambda: c._stub.ConvertBatch(call.request, timeout=60), 200)
rows["finish(resp)"] = t(lambda: call.finish(resp))
br = call.finish(resp)
rows["_result x2"] = t(lambda: [_mxfp4._result(v, s, br, i, 8, None) for i, (v, s) in enumerate(layer)])
rows["ListDevices back to back"] = t(lambda: c.devices())
for k, v in rows.items():
    print(f"{k:44s} {v:9.1f} us")
c.close(); d.stop()
