"""How late a batch on the ordered ConvertBatches stream reaches the daemon while the caller
goes on computing in Python (as a loader building its next layer's request does).

grpc sends a stream's requests from threads of its own, and each request needs the GIL a few
times on the way; a caller busy in Python holds it, so those threads get it only at the
interpreter's switch interval. A prompt send (what completion="async" uses) waits in send()
until grpc has taken the request. For each mode: 20 batches, each sent and then 3 ms of pure
Python; reported: the daemon's start of each batch (its request log: end time minus seconds)
minus the client's send time, and the cost of send() itself. CPU engine, bytes items: no GPU.

    WPREPD=build/server/wprepd python3 client/python/bench/stream_send_bench.py
"""

import datetime
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import wprep  # noqa: E402
from wprep._stream import BatchStream, Entry  # noqa: E402
from wprep.testing import LocalDaemon  # noqa: E402


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def main() -> int:
    with LocalDaemon(os.environ.get("WPREPD"), ["--devices=cpu", "--cpu-threads=1"]) as d:
        c = wprep.Client(d.target, timeout=30)
        spec = wprep.Spec("hopper_value", mx_axis=-2, mma_version=3, packing_axis=-2)
        shape = [1, 64, 64]
        call = c._batch_call([wprep.Item(spec, shape, bytes(c.plan(spec, shape).input_bytes))], None, None, None,
                             "host")
        print("| send | daemon start - send, median ms | max ms | send() median us |")
        print("|---|---:|---:|---:|")
        for prompt in (False, True, False, True):
            stream = BatchStream(c._stub.ConvertBatches)
            stream.send(Entry(call.request, lambda lost, a: None))
            stream.wait(30)
            seen = d.log().count("method=ConvertBatches ")
            sends, costs = [], []
            for _ in range(20):
                sends.append(time.time())
                t0 = time.perf_counter()
                stream.send(Entry(call.request, lambda lost, a: None, prompt=prompt))
                costs.append((time.perf_counter() - t0) * 1e6)
                spin(3)
            stream.wait(30)
            stream.close()
            time.sleep(0.1)
            lines = [ln for ln in d.log().splitlines() if "method=ConvertBatches " in ln][seen:seen + 20]
            lags = []
            for sent, line in zip(sends, lines):
                end = datetime.datetime.fromisoformat(line.split(" ", 1)[0][3:].rstrip("Z"))
                start = end.replace(tzinfo=datetime.timezone.utc).timestamp() - float(
                    line.split(" seconds=")[1].split()[0])
                lags.append((start - sent) * 1e3)
            print(f"| {'prompt' if prompt else 'queued only'} | {statistics.median(lags):.2f} | {max(lags):.2f} | "
                  f"{statistics.median(costs):.0f} |")
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
