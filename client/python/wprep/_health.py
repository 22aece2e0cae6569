"""grpc.health.v1.Health/Check, with its two messages encoded by hand.

The messages are too small to need generated code, and generated code for them would register
the grpc.health.v1 names in protobuf's default descriptor pool, where they collide with the
copy of any other package that ships them (grpcio-health-checking): importing both fails with
"duplicate symbol". The wire format of the two messages:
  HealthCheckRequest  { string service = 1; }
  HealthCheckResponse { ServingStatus status = 1; }   (an enum, a varint)
"""

from __future__ import annotations

CHECK_METHOD = "/grpc.health.v1.Health/Check"

# grpc.health.v1.HealthCheckResponse.ServingStatus
STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_request(service: str) -> bytes:
    """A serialized HealthCheckRequest."""
    s = service.encode("utf-8")
    return b"\x0a" + _varint(len(s)) + s if s else b""


def _read_varint(data: bytes, i: int) -> "tuple[int, int]":
    shift = 0
    value = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint in HealthCheckResponse")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("overlong varint in HealthCheckResponse")


def decode_response(data: bytes) -> str:
    """The status name (SERVING, NOT_SERVING, ...) of a serialized HealthCheckResponse."""
    status = 0
    i = 0
    while i < len(data):
        key, i = _read_varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(data, i)
            if field == 1:
                status = value
        elif wire == 1:
            i += 8
        elif wire == 2:
            n, i = _read_varint(data, i)
            i += n
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unexpected wire type {wire} in HealthCheckResponse")
        if i > len(data):
            raise ValueError("truncated HealthCheckResponse")
    return STATUS_NAMES.get(status, f"STATUS_{status}")
