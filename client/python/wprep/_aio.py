"""AsyncClient: the asyncio client of wprepd (grpc.aio)."""

from __future__ import annotations

import asyncio
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from . import _health, _requests, _torch
from ._cuda import ipc as _ipc
from ._client import _identity, _open_channel, _PlanCache, default_target
from ._errors import from_rpc_error
from ._requests import Call, PlanKey
from ._spec import Spec
from ._types import BatchResult, Devices, Item, Plan, Result, Source
from .v1 import wprep_pb2 as pb
from .v1 import wprep_pb2_grpc as pb_grpc


class AsyncClient:
    """The asyncio twin of Client: the same calls as coroutines, many in flight on one channel.

    Create and use it inside one event loop (`async with AsyncClient(target) as c:`). With
    CUDA tensors, the stream synchronization before a request blocks the loop until the
    producer's queued work is done.
    """

    def __init__(
        self,
        target: Optional[str] = None,
        *,
        timeout: Optional[float] = 300.0,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Sequence[Tuple[str, Any]] = (),
    ) -> None:
        self.target = target or default_target()
        self.timeout = timeout
        self._channel = _open_channel(grpc.aio, self.target, credentials, options)
        self._stub = pb_grpc.WeightPrepStub(self._channel)
        self._check = self._channel.unary_unary(
            _health.CHECK_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        self._plans = _PlanCache()
        self._registry = _torch.Registry()
        self._events = _torch.EventPool()
        self._ptrace_pid: Optional[int] = -1  # as Client's

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    async def _unary(self, method: str, request: Any, timeout: Optional[float]) -> Any:
        if _ipc.vmm_exported:  # as Client._before_send
            if self._ptrace_pid == -1:
                self._ptrace_pid = _ipc.daemon_needing_ptrace(self.target)
            if self._ptrace_pid is not None:
                _ipc.allow_ptrace(self._ptrace_pid)
        try:
            return await getattr(self._stub, method)(request, timeout=self._timeout(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e, method) from None

    async def _run(self, call: Call, timeout: Optional[float]) -> Any:
        try:
            resp = await self._unary(call.method, call.request, timeout)
        except BaseException:
            call.fail()
            raise
        return call.complete(resp)

    async def _plans_for(self, keys: Iterable[Optional[PlanKey]], timeout: Optional[float]) -> Dict[PlanKey, Plan]:
        plans: Dict[PlanKey, Plan] = {}
        missing = []
        for key in keys:
            if key is None or key in plans or key in missing:
                continue
            cached = self._plans.get(key)
            if cached is not None:
                plans[key] = cached
            else:
                missing.append(key)
        answers = await asyncio.gather(
            *(self._unary("Plan", _requests.plan_request(k[0], k[1]), timeout) for k in missing)
        )
        for key, resp in zip(missing, answers):
            plans[key] = Plan.from_proto(resp)
            self._plans.put(key, plans[key])
        return plans

    async def plan(
        self,
        spec: Spec,
        logical_shape: Sequence[int],
        *,
        input_strides: Optional[Sequence[int]] = None,
        input_buffer_bytes: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> Plan:
        """See Client.plan."""
        req = _requests.plan_request(spec, logical_shape, input_strides, input_buffer_bytes)
        return Plan.from_proto(await self._unary("Plan", req, timeout))

    async def convert(
        self,
        spec: Spec,
        logical_shape: Sequence[int],
        source: Source,
        *,
        out: Any = None,
        strides: Optional[Sequence[int]] = None,
        device_uuid: Union[None, bytes, str] = None,
        stream: Any = None,
        timeout: Optional[float] = None,
    ) -> Result:
        """See Client.convert."""
        plans = await self._plans_for([_requests.needs_plan(spec, logical_shape, source, out)], timeout)
        call = _requests.convert_call(spec, logical_shape, source, out, strides, device_uuid, plans,
                                      self._registry, stream)
        return await self._run(call, timeout)

    async def convert_batch(
        self,
        items: Sequence[Item],
        *,
        device_uuid: Union[None, bytes, str] = None,
        stream: Any = None,
        timeout: Optional[float] = None,
        completion: str = "host",
    ) -> BatchResult:
        """See Client.convert_batch (completion "host" or "stream")."""
        if completion in ("async", "auto"):
            raise ValueError(f"completion={completion!r} is Client's (it returns before the answer); "
                             "use 'stream' from asyncio")
        items = list(items)
        plans = await self._plans_for(
            [_requests.needs_plan(it.spec, it.logical_shape, it.source, it.out) for it in items if isinstance(it, Item)],
            timeout,
        )
        call = _requests.batch_call(items, device_uuid, plans, self._registry, stream, completion, self._events)
        return await self._run(call, timeout)

    async def devices(self, *, timeout: Optional[float] = None) -> Devices:
        """See Client.devices."""
        return Devices.from_proto(await self._unary("ListDevices", pb.ListDevicesRequest(), timeout))

    async def health(self, service: str = "", *, timeout: Optional[float] = 5.0) -> str:
        """See Client.health."""
        try:
            raw = await self._check(_health.encode_request(service), timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "Health/Check") from None
        return _health.decode_response(raw)
