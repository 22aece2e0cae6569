"""The one translation of gRPC failures into the package's exception."""

from __future__ import annotations

from typing import Optional

import grpc


class WprepError(Exception):
    """A call to wprepd failed.

    code: the gRPC status (grpc.StatusCode.INVALID_ARGUMENT for a bad request, UNAVAILABLE
    when no daemon answers at the target, ...). details: the daemon's message, which names the
    offending field and value ("items[3].convert.spec.layout: ..."). str() gives
    "INVALID_ARGUMENT: <details>", the same line the CLI prints.
    """

    def __init__(self, code: grpc.StatusCode, details: str, method: Optional[str] = None) -> None:
        self.code = code
        self.details = details
        self.method = method
        super().__init__(f"{code.name}: {details}")


def from_rpc_error(e: grpc.RpcError, method: str) -> WprepError:
    """The WprepError of a failed call (grpc.RpcError is also a grpc.Call)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = e.details() if hasattr(e, "details") else str(e)  # type: ignore[attr-defined]
    if code is None:
        code = grpc.StatusCode.UNKNOWN
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"{details} (no wprepd answered for {method}: is it running, and is the target right?)"
    err = WprepError(code, details or "", method)
    err.__cause__ = e
    return err
