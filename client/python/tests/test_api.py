"""The rest of the bytes path against a real wprepd (CPU engine): Plan, ListDevices, health,
bad input, and many calls at once (futures, threads, asyncio)."""

import asyncio
import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

import golden
from wprep import AsyncClient, Client, Item, Spec, WprepError
from wprep.testing import LocalDaemon

HOPPER_MX2 = Spec("hopper_value", mx_axis=-2, mma_version=3)
PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


def _case(name):
    return next(c for c in golden.all_cases() if c.name == name)


def _cases_for_concurrency(n):
    return [c for c in golden.all_cases() if not c.error and c.input_bytes <= 32 << 10][:n]


def test_plan_describes_a_conversion_without_doing_it(client):
    # gpt-oss's 32 experts of w2, [E, K, N] = [32, 2880, 2880], from checkpoint order
    spec = Spec("hopper_value", mx_axis=-2, mma_version=3, packing_axis=-2)
    p = client.plan(spec, [32, 2880, 2880])
    assert p.input_shape == (32, 2880, 1440)
    assert p.input_bytes == 32 * 2880 * 1440
    # rows = D1 = 2880 -> R = 3072, cols = D0/2 = 1440 -> C = 1472; reported transposed
    assert p.output_shape == (32, 4 * 1472, 3072 // 4)
    assert p.output_strides == (3072 * 1472, 1, 4 * 1472)
    assert p.output_bytes == 32 * 3072 * 1472
    assert p.identity.layout == "HopperMXValueLayout(mx_axis=-2, mma_version=3)"
    assert p.identity.conversion == "canonical(packing_axis=-2) -> HopperMXValueLayout(mx_axis=-2, mma_version=3)"
    assert p.identity.contract_version == 1
    assert p.description


def test_plan_takes_a_strided_view_and_checks_its_buffer(client):
    # the checkpoint's [E, N, K/32] scales seen as [E, K/32, N]
    e, n, k32 = 4, 256, 90
    spec = Spec("hopper_scale", mx_axis=-2, num_warps=8)
    strides = [n * k32, 1, k32]
    p = client.plan(spec, [e, k32, n], input_strides=strides, input_buffer_bytes=e * n * k32)
    assert p.input_strides == tuple(strides)
    assert p.input_bytes == e * n * k32
    with pytest.raises(WprepError) as err:
        client.plan(spec, [e, k32, n], input_strides=strides, input_buffer_bytes=e * n * k32 - 1)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_devices_of_a_cpu_engine_daemon(client):
    d = client.devices()
    assert d.devices == []
    assert d.cpu_engine is True
    assert d.cpu_threads == 2


def test_health(client):
    assert client.health() == "SERVING"
    assert client.health("wprep.v1.WeightPrep") == "SERVING"
    with pytest.raises(WprepError) as e:
        client.health("no.such.Service")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_no_daemon_is_unavailable_with_a_clear_message(tmp_path):
    with Client(f"unix://{tmp_path}/none.sock", timeout=5) as c:
        with pytest.raises(WprepError) as e:
            c.devices()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert "is it running" in str(e.value)
        with pytest.raises(TimeoutError):
            c.wait_serving(timeout=0.2)


def test_wrong_byte_count_is_invalid_argument_naming_the_size(client):
    with pytest.raises(WprepError) as e:
        client.convert(HOPPER_MX2, [256, 128], bytes(100))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(e.value).startswith("INVALID_ARGUMENT: ")
    assert "100" in e.value.details and str(256 * 64) in e.value.details


def test_an_odd_packing_dimension_is_invalid_argument(client):
    with pytest.raises(WprepError) as e:
        client.convert(Spec("hopper_value", mx_axis=-2), [7, 64], bytes(7 * 32))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "even" in e.value.details


def test_a_bad_item_fails_the_batch_naming_it(client):
    c = _case("hopper_swizzle_256x128_mx1_mma2")
    good = Item(c.spec, c.logical_shape, golden.golden_input(c))
    bad = Item(c.spec, c.logical_shape, b"x")
    with pytest.raises(WprepError) as e:
        client.convert_batch([good, good, bad])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[2]" in e.value.details


def test_convert_batches_answers_every_batch_in_order_on_one_stream(daemon):
    # Each batch is sent before the answers of those before it; the results are each batch's
    # own, in order, the same as convert_batch gives; the daemon logs one request per batch.
    cases = _cases_for_concurrency(40)
    batches = [[Item(c.spec, c.logical_shape, golden.golden_input(c), strides=c.input_strides or None)
                for c in cases[i:i + 4]] for i in range(0, len(cases), 4)]
    with Client(daemon.target, timeout=60) as c:
        before = daemon.log().count("method=ConvertBatches ")
        results = c.convert_batches(batches)
        assert len(results) == len(batches)
        for i, (batch, result) in enumerate(zip(batches, results)):
            assert len(result) == len(batch)
            for case, r in zip(cases[4 * i:4 * i + 4], result):
                assert golden.matches(case, r.data), case.name
        one = c.convert_batch(batches[3])
        assert [r.data for r in one] == [r.data for r in results[3]]
        assert [(r.shape, r.strides, r.identity) for r in one] == [(r.shape, r.strides, r.identity) for r in results[3]]
        assert daemon.log().count("method=ConvertBatches ") - before == len(batches)


def test_a_prompt_batch_is_with_grpc_when_send_returns(daemon):
    # completion='async' batches are prompt: grpc sends a stream's requests from threads of
    # its own, which need the GIL, and a caller that goes on building its next request keeps
    # it, so send() of a prompt entry waits until grpc has taken the request (measured on a
    # 2-vCPU VM, the daemon got such batches 28-30 ms late without it, 0.4 ms with it).
    from wprep._stream import BatchStream, Entry

    c0 = _case("hopper_swizzle_256x128_mx1_mma2")
    with Client(daemon.target, timeout=60) as c:
        call = c._batch_call([Item(c0.spec, c0.logical_shape, golden.golden_input(c0))], None, None, None, "host")
        stream = BatchStream(c._stub.ConvertBatches)
        answers = []
        try:
            for i in range(4):
                assert stream.send(Entry(call.request, lambda lost, a: answers.append((lost, a)), prompt=True)) == i
                assert stream._taken == i + 1  # no GIL released since the send: grpc took it in send()
            assert stream.wait(30)
        finally:
            stream.close()
        assert [(lost, a.code, a.index) for lost, a in answers] == [(None, 0, i) for i in range(4)]


def test_convert_batches_names_a_failed_batch_and_runs_the_others(daemon):
    c0 = _case("hopper_swizzle_256x128_mx1_mma2")
    good = Item(c0.spec, c0.logical_shape, golden.golden_input(c0))
    bad = Item(c0.spec, c0.logical_shape, b"x")
    with Client(daemon.target, timeout=60) as c:
        before = daemon.log().count("method=ConvertBatches ")
        with pytest.raises(WprepError) as e:
            c.convert_batches([[good], [good, bad], [good]])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details.startswith("batches[1]: "), e.value.details
        assert "items[1]" in e.value.details
        lines = [ln for ln in daemon.log().splitlines() if "method=ConvertBatches " in ln][before:]
        assert [("code=OK" in ln, "code=INVALID_ARGUMENT" in ln) for ln in lines] == [
            (True, False), (False, True), (True, False)]  # the third batch ran too
        # The stream goes on: the same Client's next batches are served.
        (r,), = c.convert_batches([[good]])
        assert golden.matches(c0, r.data)


def test_convert_batches_on_a_daemon_gone_is_unavailable(tmp_path):
    with Client(f"unix://{tmp_path}/none.sock", timeout=5) as c:
        with pytest.raises(WprepError) as e:
            c.convert_batches([[Item(HOPPER_MX2, [256, 128], bytes(256 * 64))]])
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_client_side_mistakes_are_python_errors(client):
    with pytest.raises(ValueError, match="layout must be one of"):
        Spec("hopper")
    with pytest.raises(ValueError, match="num_warps applies to hopper_scale"):
        Spec("hopper_value", num_warps=4)
    with pytest.raises(ValueError, match="retile"):
        Spec("blackwell_shuffled_value", to_block_k=64)
    with pytest.raises(TypeError, match="one-byte dtype"):
        client.convert(HOPPER_MX2, [256, 128], np.zeros((256, 32), dtype=np.uint16))
    with pytest.raises(ValueError, match="negative strides"):
        client.convert(HOPPER_MX2, [256, 128], np.zeros((128, 256), dtype=np.uint8)[::-1].T)
    with pytest.raises(ValueError, match="negative dim"):
        client.plan(HOPPER_MX2, [-1, 128])
    with pytest.raises(TypeError, match="wprep.Item"):
        client.convert_batch([("not", "an item")])
    with pytest.raises(TypeError, match="CUDA torch tensor"):
        client.convert(HOPPER_MX2, [256, 128], bytes(256 * 64), out=np.zeros(256 * 64, dtype=np.uint8))


def test_an_unswizzle_takes_a_swizzle_output_view_back(client):
    # The Hopper mx_axis=-2 output is a transposed view of row-major memory; handed back as a
    # numpy view, it goes with its strides, and the round trip gives the input again.
    c = _case("hopper_swizzle_256x128_mx1_mma2")
    spec = Spec("hopper_value", mx_axis=-2, mma_version=3)
    data = golden.golden_input(c)
    fwd = client.convert(spec, c.logical_shape, data)
    view = fwd.numpy()
    assert view.strides[-2] == 1  # transposed
    back = client.convert(Spec("hopper_value", "unswizzle", mx_axis=-2, mma_version=3), c.logical_shape, view)
    assert back.data == data


def test_many_futures_in_flight(client):
    cases = _cases_for_concurrency(48)
    futures = [client.convert_future(c.spec, c.logical_shape, golden.golden_input(c),
                                     strides=c.input_strides or None) for c in cases]
    batches = [client.convert_batch_future([Item(c.spec, c.logical_shape, golden.golden_input(c),
                                                 strides=c.input_strides or None) for c in cases[i::4]])
               for i in range(4)]
    for c, f in zip(cases, futures):
        assert golden.matches(c, f.result(60).data), c.name
    for i, f in enumerate(batches):
        for c, r in zip(cases[i::4], f.result(60)):
            assert golden.matches(c, r.data), c.name


def test_a_failed_future_raises_the_daemons_status(client):
    f = client.convert_future(HOPPER_MX2, [256, 128], bytes(3))
    with pytest.raises(WprepError) as e:
        f.result(30)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_one_client_from_many_threads(client):
    cases = _cases_for_concurrency(32)

    def one(c):
        return golden.matches(c, client.convert(c.spec, c.logical_shape, golden.golden_input(c),
                                                strides=c.input_strides or None).data)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, cases * 2))


def test_asyncio_client(daemon):
    cases = _cases_for_concurrency(32)

    async def main():
        async with AsyncClient(daemon.target) as c:
            assert await c.health() == "SERVING"
            assert (await c.devices()).cpu_engine
            p = await c.plan(cases[0].spec, cases[0].logical_shape)
            assert p.output_bytes == cases[0].output_bytes
            results = await asyncio.gather(*(
                c.convert(x.spec, x.logical_shape, golden.golden_input(x), strides=x.input_strides or None)
                for x in cases))
            batch = await c.convert_batch([Item(x.spec, x.logical_shape, golden.golden_input(x),
                                                strides=x.input_strides or None) for x in cases])
            with pytest.raises(WprepError) as e:
                await c.convert(HOPPER_MX2, [256, 128], b"")
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            return results, batch

    results, batch = asyncio.run(main())
    for c, r, b in zip(cases, results, batch):
        assert golden.matches(c, r.data) and golden.matches(c, b.data), c.name


def test_the_bytes_path_needs_no_torch():
    code = (
        "import sys, wprep; "
        "assert 'torch' not in sys.modules and 'triton_kernels' not in sys.modules; "
        "print(wprep.__version__)"
    )
    env = dict(os.environ, PYTHONPATH=PACKAGE_DIR)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_the_drop_in_without_torch_says_what_is_missing():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import wprep\n"
        "try:\n"
        "    wprep.swizzle_mxfp4(b'', b'', 8)\n"
        "except ImportError as e:\n"
        "    print('ImportError', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=PACKAGE_DIR)
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True)
    assert out.stdout.startswith("ImportError") and "torch is not importable" in out.stdout


def test_a_local_daemon_that_cannot_start_says_why(tmp_path):
    with pytest.raises(FileNotFoundError, match="WPREPD"):
        LocalDaemon(str(tmp_path / "missing"))


def test_a_local_daemon_reads_its_metrics_when_they_are_on():
    with LocalDaemon(args=["--devices=cpu", "--cpu-threads=1", "--metrics-address=127.0.0.1:0"]) as d:
        assert d.metrics_address.startswith("127.0.0.1:")
        before = d.metric("wprep_requests_total")
        with Client(d.target) as c:
            c.convert(HOPPER_MX2, [2, 64, 64], bytes(2 * 64 * 32))
        assert d.metric("wprep_requests_total") == before + 1
        assert d.metric("wprep_no_such_metric") == 0
    with LocalDaemon(args=["--devices=cpu", "--cpu-threads=1"]) as d:
        assert d.metrics_address == ""
        with pytest.raises(RuntimeError, match="--metrics-address"):
            d.metric("wprep_requests_total")
