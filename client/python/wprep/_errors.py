"""The one translation of gRPC failures into the package's exception."""

from __future__ import annotations

from typing import Optional

import grpc

from ._cuda.ipc import VMM_SHARING_HELP, ExpandableSegmentsError


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


class VmmSharingError(WprepError, ExpandableSegmentsError):
    """The daemon refused a CUDA virtual-memory buffer (an expandable-segments tensor, a cuMem
    pool) it cannot take from this process: TCP or TLS instead of its Unix socket, another PID
    namespace, no ptrace rights, or a handle type its GPU cannot import. Both a WprepError
    (code, details: the daemon's status) and an ExpandableSegmentsError; str() adds what to do.
    """

    def __init__(self, code: grpc.StatusCode, details: str, method: Optional[str] = None) -> None:
        super().__init__(code, details, method)
        self.args = (f"{code.name}: {details}. {VMM_SHARING_HELP}",)


# The daemon's refusals of a VMM buffer name its field ("source_ipc.vmm.pid ...").
_VMM_REFUSALS = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION)


def make_error(code: grpc.StatusCode, details: str, method: Optional[str] = None) -> WprepError:
    """The WprepError of a status (a VmmSharingError when it refuses a VMM buffer)."""
    if code in _VMM_REFUSALS and ".vmm" in details:
        return VmmSharingError(code, details, method)
    return WprepError(code, details, method)


def from_rpc_error(e: grpc.RpcError, method: str) -> WprepError:
    """The WprepError of a failed call (grpc.RpcError is also a grpc.Call)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = e.details() if hasattr(e, "details") else str(e)  # type: ignore[attr-defined]
    if code is None:
        code = grpc.StatusCode.UNKNOWN
    if code == grpc.StatusCode.UNAVAILABLE:
        details = f"{details} (no wprepd answered for {method}: is it running, and is the target right?)"
    err = make_error(code, details or "", method)
    err.__cause__ = e
    return err
