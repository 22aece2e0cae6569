"""Every reference case of tests/data/golden*, through a real wprepd on the CPU engine, from
Python: Convert (bytes, numpy and strided numpy views) and ConvertBatch."""

import grpc
import numpy as np
import pytest

import golden
from wprep import Item, WprepError

CASES = golden.all_cases()
OK_CASES = [c for c in CASES if not c.error]
ERROR_CASES = [c for c in CASES if c.error]


def test_the_reference_sets_are_all_there():
    # values, scales and checkpoint order; strided inputs and rejected shapes among them
    assert {c.set for c in OK_CASES} == set(golden.SETS)
    assert len(OK_CASES) > 250
    assert sum(bool(c.input_strides) for c in OK_CASES) > 10
    assert len(ERROR_CASES) >= 10


def _check(c, r):
    assert golden.matches(c, r.data), c.name
    assert r.nbytes == c.output_bytes
    assert r.shape == c.output_shape
    assert r.strides == golden.expected_strides(c)
    assert r.identity.layout == golden.expected_identity(c)
    assert r.identity.contract_version == 1
    assert r.engine == "cpu"


@pytest.mark.parametrize("c", OK_CASES, ids=lambda c: f"{c.set}/{c.name}")
def test_convert_matches_the_reference(client, c):
    data = golden.golden_input(c)
    # bytes in memory order, with the view's strides where the case has them
    r = client.convert(c.spec, c.logical_shape, data, strides=c.input_strides or None)
    _check(c, r)
    out = r.numpy()
    assert out.shape == c.output_shape and out.strides == golden.expected_strides(c)


@pytest.mark.parametrize("c", [c for c in OK_CASES if c.input_strides], ids=lambda c: f"{c.set}/{c.name}")
def test_a_strided_numpy_view_is_sent_with_its_strides(client, c):
    # The case's bytes fill the storage in memory order; the view is what a loader holds.
    flat = np.frombuffer(golden.golden_input(c), dtype=np.uint8)
    view = np.lib.stride_tricks.as_strided(flat, shape=c.input_shape, strides=c.input_strides)
    _check(c, client.convert(c.spec, c.logical_shape, view))


@pytest.mark.parametrize("c", ERROR_CASES, ids=lambda c: f"{c.set}/{c.name}")
def test_rejected_cases_are_invalid_argument(client, c):
    with pytest.raises(WprepError) as e:
        client.convert(c.spec, c.logical_shape, b"")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details  # a message a user can act on
    with pytest.raises(WprepError) as e:
        client.plan(c.spec, c.logical_shape)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_one_batch_of_every_small_case_matches_the_reference(client):
    cases = [c for c in OK_CASES if c.input_bytes <= 64 << 10 and c.output_bytes <= 64 << 10]
    assert len({c.spec.layout for c in cases}) == 5  # every layout in one batch
    items = [Item(c.spec, c.logical_shape, golden.golden_input(c), strides=c.input_strides or None) for c in cases]
    r = client.convert_batch(items)
    assert len(r) == len(cases)
    assert r.peak_extra_device_bytes == 0
    for c, res in zip(cases, r):
        _check(c, res)
        assert res.identity.conversion.endswith(golden.expected_identity(c)) or res.identity.conversion.startswith(
            golden.expected_identity(c)
        )
