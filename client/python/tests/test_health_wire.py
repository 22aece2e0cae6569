"""grpc.health.v1 and grpc.reflection.v1 of a real wprepd as grpcio sees them, with raw bytes
(identity serializers), so nothing here depends on generated stubs: a body that is not a
HealthCheckRequest, a Watch, and reflection v1's service list."""

import grpc
import pytest

IDENTITY = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
# HealthCheckResponse{status: SERVING}: field 1, varint 1.
SERVING = b"\x08\x01"


@pytest.fixture()
def channel(daemon):
    with grpc.insecure_channel(daemon.target) as ch:
        yield ch


def test_malformed_check_is_invalid_argument(channel):
    check = channel.unary_unary("/grpc.health.v1.Health/Check", **IDENTITY)
    with pytest.raises(grpc.RpcError) as e:
        check(b"\x7f\xff\xff", timeout=30)  # wire type 7 does not exist: no message parses
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "HealthCheckRequest" in e.value.details()
    # The daemon serves on; an empty body is a valid request for service "".
    assert check(b"", timeout=30) == SERVING


def test_malformed_watch_is_invalid_argument(channel):
    watch = channel.unary_stream("/grpc.health.v1.Health/Watch", **IDENTITY)
    with pytest.raises(grpc.RpcError) as e:
        list(watch(b"\x7f\xff\xff", timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


def test_watch_says_serving_first(channel):
    watch = channel.unary_stream("/grpc.health.v1.Health/Watch", **IDENTITY)
    call = watch(b"", timeout=30)
    try:
        assert next(call) == SERVING
    finally:
        call.cancel()


def _strings(message: bytes, field: int) -> list:
    """The length-delimited values of `field` in a protobuf message (no nesting decoded)."""
    out, i = [], 0
    while i < len(message):
        key, i = _varint(message, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _varint(message, i)
        elif wire == 2:
            n, i = _varint(message, i)
            if number == field:
                out.append(message[i:i + n])
            i += n
        else:
            raise AssertionError(f"unexpected wire type {wire} in {message!r}")
    return out


def _varint(b: bytes, i: int):
    value = shift = 0
    while True:
        byte = b[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_services(channel, version):
    info = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo", **IDENTITY)
    # ServerReflectionRequest{list_services: ""}: field 7, length 0.
    answers = list(info(iter([b"\x3a\x00"]), timeout=30))
    assert len(answers) == 1
    # ServerReflectionResponse.list_services_response (6) -> service (1) -> name (1).
    (listing,) = _strings(answers[0], 6)
    names = {_strings(service, 1)[0].decode() for service in _strings(listing, 1)}
    assert {"wprep.v1.WeightPrep", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names, names
