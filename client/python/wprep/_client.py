"""Client: the synchronous (and futures) client of wprepd."""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import os
import sys
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import grpc

from . import _health, _requests, _torch
from ._cuda import ipc as _ipc
from ._cuda.fences import StreamMemOpsError
from ._errors import WprepError, from_rpc_error, make_error
from ._requests import Call, PlanKey
from ._stream import BatchStream, Entry, StreamBroken
from ._spec import Spec
from ._types import BatchResult, Devices, Item, Plan, Result, Source
from .v1 import wprep_pb2 as pb
from .v1 import wprep_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # weights refers to Client; the methods import it, keeping imports one-way
    from . import weights

DEFAULT_TARGET = "unix:///tmp/wprepd.sock"
_COMPLETIONS = ("host", "stream", "async", "auto")

# Messages up to what the daemon allows (--max-message-bytes); no HTTP proxy for a local daemon.
CHANNEL_OPTIONS: List[Tuple[str, Any]] = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.enable_http_proxy", 0),
]


def _open_channel(module: Any, target: str, credentials: Any, options: Sequence[Tuple[str, Any]]) -> Any:
    """A channel of `module` (grpc or grpc.aio) to `target`, over TLS when `credentials`."""
    opts = [*CHANNEL_OPTIONS, *options]
    if credentials is None:
        return module.insecure_channel(target, options=opts)
    return module.secure_channel(target, credentials, options=opts)


# Clients that sent completion='async' batches: at exit, an error no later call raised is
# written to stderr rather than lost.
_async_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()
_async_exit_mu = threading.Lock()
_async_exit_hooked = False


def _report_unraised_async_errors() -> None:
    for c in list(_async_clients):
        while True:
            try:
                c.wait_async(timeout=5.0)
                break
            except TimeoutError as e:
                sys.stderr.write(f"wprep: at exit, {e}\n")
                break
            except BaseException as e:  # noqa: BLE001 - reported, the process is ending
                sys.stderr.write(f"wprep: at exit, a completion='async' batch had failed and no later call "
                                 f"raised it (its outputs were not written): {e}\n")


def _hook_exit_report(client: "Client") -> None:
    global _async_exit_hooked
    _async_clients.add(client)
    if not _async_exit_hooked:
        with _async_exit_mu:
            if not _async_exit_hooked:
                atexit.register(_report_unraised_async_errors)
                _async_exit_hooked = True


def _host_words_refused(e: BaseException) -> bool:
    """Whether an async batch failed because the daemon cannot use this client's host words
    (another /dev/shm, no access to its files), so that "stream" may serve instead."""
    if not isinstance(e, WprepError):
        return False
    return e.code == grpc.StatusCode.FAILED_PRECONDITION or "host_word" in (e.details or "")


def default_target() -> str:
    """$WPREP_TARGET, else unix:///tmp/wprepd.sock (what `make run` listens on)."""
    return os.environ.get("WPREP_TARGET") or DEFAULT_TARGET


def _identity(x: bytes) -> bytes:
    return x


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _answer_error(answer: Any) -> WprepError:
    """The WprepError of a ConvertBatches answer whose code is not OK."""
    return make_error(_CODES.get(answer.code, grpc.StatusCode.UNKNOWN), answer.message, "ConvertBatches")


class _PlanCache:
    """Plans of the outputs the client allocates, by (spec, logical shape); thread-safe, bounded."""

    def __init__(self, capacity: int = 1024) -> None:
        self._mu = threading.Lock()
        self._plans: "collections.OrderedDict[PlanKey, Plan]" = collections.OrderedDict()  # guarded by _mu
        self._capacity = capacity

    def get(self, key: PlanKey) -> Optional[Plan]:
        with self._mu:
            p = self._plans.get(key)
            if p is not None:
                self._plans.move_to_end(key)
            return p

    def put(self, key: PlanKey, plan: Plan) -> None:
        with self._mu:
            self._plans[key] = plan
            while len(self._plans) > self._capacity:
                self._plans.popitem(last=False)


class Client:
    """A connection to one wprepd. Thread-safe; share one per process.

    target: "unix:///path.sock" or "HOST:PORT" (default: $WPREP_TARGET, else
    unix:///tmp/wprepd.sock). timeout: seconds per call (None: no deadline).
    credentials: for a TLS listener, e.g. grpc.ssl_channel_credentials(root_certificates=ca)
    (with private_key and certificate_chain for mutual TLS). channel: a channel of your own
    instead (then options and credentials are not used).

    Sources and outputs:
    - bytes, numpy arrays (uint8) and CPU tensors are sent inline; their output comes back
      as bytes (Result.data, Result.numpy()). A non-contiguous numpy view is sent with its
      byte strides (source_strides / inline_strides), e.g. the transposed [E, K/32, N] view
      of [E, N, K/32] scales; bytes take `strides=` for that.
    - CUDA tensors are read and written in place through CUDA IPC: slices, views (strides)
      and tensors at any offset inside torch's caching-allocator blocks. The output goes to
      `out` (dense, on the source's GPU) or to a tensor the client allocates there with
      the size the daemon's Plan gives (Result.tensor).

    Ordering with CUDA tensors: before sending, the client synchronizes `stream` (default:
    the current stream of each GPU involved), so the producer's writes are complete when
    the daemon reads. When a call returns, the daemon has synchronized its own stream:
    every output byte is written and any stream of the caller may use it, no wait needed.
    A batch with completion="stream" is ordered on the GPU instead, both ways, like a
    kernel launched on `stream`: the daemon's work waits for the work queued on `stream`
    before the call (an interprocess event the client records there), and work queued on
    `stream` after the call waits for the daemon's; the host waits for neither.
    """

    def __init__(
        self,
        target: Optional[str] = None,
        *,
        timeout: Optional[float] = 300.0,
        channel: Optional[grpc.Channel] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Sequence[Tuple[str, Any]] = (),
    ) -> None:
        self.target = target or default_target()
        self.timeout = timeout
        self._channel = channel or _open_channel(grpc, self.target, credentials, options)
        self._stub = pb_grpc.WeightPrepStub(self._channel)
        self._weights = pb_grpc.WeightSetsStub(self._channel)
        self._check = self._channel.unary_unary(
            _health.CHECK_METHOD, request_serializer=_identity, response_deserializer=_identity
        )
        self._plans = _PlanCache()
        self._registry = _torch.Registry()
        self._events = _torch.EventPool()
        self._flags = _torch.FlagPool()
        # The ordered ConvertBatches stream (completion='async', convert_batches), opened on
        # first use and again after it breaks; the errors of async batches not raised yet.
        self._stream_mu = threading.Lock()
        self._stream: Optional[BatchStream] = None  # guarded by _stream_mu
        self._async_mu = threading.Lock()
        self._async_errors: List[BaseException] = []  # guarded by _async_mu
        # An async call's stream operations and its send, one call at a time: two threads
        # queueing on one CUDA stream must send in the order they queued, or the later
        # batch's wait could stand ahead of the earlier batch's work in the daemon.
        self._async_order = threading.Lock()
        self.max_async_in_flight = 256
        # completion='auto': None until an auto call's answer has shown whether the daemon takes
        # this client's host words ("async" from then on) or cannot ("stream").
        self._auto_mu = threading.Lock()
        self._auto: Optional[str] = None
        # The daemon's pid to name as this process's tracer before VMM memory is sent
        # (_before_send); -1 until asked.
        self._ptrace_pid: Optional[int] = -1

    def close(self) -> None:
        """Closes the channel; calls in flight fail (completion='async' ones release their
        streams, their outputs unwritten)."""
        with self._stream_mu:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close(timeout=1.0)
        self._channel.close()
        self._flags.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls ------------------------------------------------------------------------------

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def _before_send(self) -> None:
        """Once this process sends CUDA virtual memory, the daemon may need ptrace rights over
        it (yama ptrace_scope 1) to take the descriptors: its pid is looked up once, and named
        the process's tracer whenever another Client's daemon was named since."""
        if not _ipc.vmm_exported:
            return
        if self._ptrace_pid == -1:
            self._ptrace_pid = _ipc.daemon_needing_ptrace(self.target)
        if self._ptrace_pid is not None:
            _ipc.allow_ptrace(self._ptrace_pid)

    def _unary(self, method: str, request: Any, timeout: Optional[float]) -> Any:
        self._before_send()
        try:
            return getattr(self._stub, method)(request, timeout=self._timeout(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e, method) from None

    def _unary_weights(self, method: str, request: Any, timeout: Optional[float]) -> Any:
        """A unary call of the WeightSets service; failures as WprepError."""
        try:
            return getattr(self._weights, method)(request, timeout=self._timeout(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e, method) from None

    def _run(self, call: Call, timeout: Optional[float]) -> Any:
        try:
            resp = self._unary(call.method, call.request, timeout)
        except BaseException:
            call.fail()
            raise
        return call.complete(resp)

    def _submit(self, call: Call, timeout: Optional[float]) -> "concurrent.futures.Future[Any]":
        out: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
        out.set_running_or_notify_cancel()
        self._before_send()
        try:
            pending = getattr(self._stub, call.method).future(call.request, timeout=self._timeout(timeout))
        except grpc.RpcError as e:
            call.fail()
            out.set_exception(from_rpc_error(e, call.method))
            return out

        def done(f: Any) -> None:
            # `call` (and so every tensor the daemon touches) stays alive until here.
            try:
                resp = f.result()
            except grpc.RpcError as e:
                call.fail()
                out.set_exception(from_rpc_error(e, call.method))
                return
            except BaseException as e:  # cancelled or failed inside grpc
                call.fail()
                out.set_exception(e)
                return
            try:
                out.set_result(call.complete(resp))
            except BaseException as e:
                out.set_exception(e)

        pending.add_done_callback(done)
        return out

    # -- plans ------------------------------------------------------------------------------

    def plan(
        self,
        spec: Spec,
        logical_shape: Sequence[int],
        *,
        input_strides: Optional[Sequence[int]] = None,
        input_buffer_bytes: Optional[int] = None,
        timeout: Optional[float] = None,
    ) -> Plan:
        """Validates a conversion and returns its input and output shapes and sizes; no work is done."""
        req = _requests.plan_request(spec, logical_shape, input_strides, input_buffer_bytes)
        return Plan.from_proto(self._unary("Plan", req, timeout))

    def _plans_for(self, keys: Iterable[Optional[PlanKey]], timeout: Optional[float]) -> Dict[PlanKey, Plan]:
        plans: Dict[PlanKey, Plan] = {}
        missing: Dict[PlanKey, Any] = {}
        for key in keys:
            if key is None or key in plans or key in missing:
                continue
            cached = self._plans.get(key)
            if cached is not None:
                plans[key] = cached
            else:
                req = _requests.plan_request(key[0], key[1])
                missing[key] = self._stub.Plan.future(req, timeout=self._timeout(timeout))
        for key, f in missing.items():
            try:
                plans[key] = Plan.from_proto(f.result())
            except grpc.RpcError as e:
                raise from_rpc_error(e, "Plan") from None
            self._plans.put(key, plans[key])
        return plans

    # -- conversions --------------------------------------------------------------------------

    def _convert_call(self, spec: Spec, logical_shape: Sequence[int], source: Source, out: Any,
                      strides: Optional[Sequence[int]], device_uuid: Union[None, bytes, str], stream: Any,
                      timeout: Optional[float]) -> Call:
        self._raise_async_error()
        plans = self._plans_for([_requests.needs_plan(spec, logical_shape, source, out)], timeout)
        return _requests.convert_call(spec, logical_shape, source, out, strides, device_uuid, plans,
                                      self._registry, stream)

    def convert(
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
        """Converts one tensor (Convert). See the class for sources, `out` and ordering.

        device_uuid: the GPU for a bytes-to-bytes conversion (16 bytes or "GPU-..."); None
        lets the daemon pick. stream: the CUDA stream whose work must finish first.
        Raises WprepError with the daemon's status (INVALID_ARGUMENT names the bad field).
        """
        call = self._convert_call(spec, logical_shape, source, out, strides, device_uuid, stream, timeout)
        return self._run(call, timeout)

    def convert_future(
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
    ) -> "concurrent.futures.Future[Result]":
        """convert() without waiting: a Future of the Result (or of the WprepError).

        The request is sent before this returns (the stream is synchronized first); many may
        be in flight at once. Keep nothing alive yourself: the future holds the tensors.
        """
        call = self._convert_call(spec, logical_shape, source, out, strides, device_uuid, stream, timeout)
        return self._submit(call, timeout)

    def _batch_call(self, items: Sequence[Item], device_uuid: Union[None, bytes, str], stream: Any,
                    timeout: Optional[float], completion: str) -> Call:
        """The request of a batch; first raises an earlier async batch's error not raised yet."""
        self._raise_async_error()
        items = list(items)
        plans = self._plans_for(
            [_requests.needs_plan(it.spec, it.logical_shape, it.source, it.out, completion)
             for it in items if isinstance(it, Item)],
            timeout,
        )
        return _requests.batch_call(items, device_uuid, plans, self._registry, stream, completion, self._events,
                                    self._flags)

    # -- the ordered ConvertBatches stream ---------------------------------------------------

    def _send_ordered(self, entry: Entry) -> None:
        """Sends a batch on the Client's ConvertBatches stream, opening one if none is live."""
        self._before_send()
        for _ in range(2):
            with self._stream_mu:
                if self._stream is None or self._stream.broken:
                    self._stream = BatchStream(self._stub.ConvertBatches, self.max_async_in_flight)
                stream = self._stream
            try:
                stream.send(entry)
                return
            except StreamBroken:
                continue  # it broke between the check and the send: once more on a new one
        raise WprepError(grpc.StatusCode.UNAVAILABLE, "the ConvertBatches stream broke twice while sending",
                         "ConvertBatches")

    def _raise_async_error(self) -> None:
        with self._async_mu:
            if not self._async_errors:
                return
            e = self._async_errors.pop(0)
        if hasattr(e, "add_note"):
            e.add_note("(raised by a later call: an earlier completion='async' batch of this Client failed; "
                       "its outputs were not written)")
        raise e

    def _send_async(self, call: Call,
                    probe: "Optional[concurrent.futures.Future[Optional[BaseException]]]" = None) -> Any:
        """Sends an async batch. probe: a Future that takes the batch's error (None when it
        succeeded) instead of the later-call queue, unless cancelled by then."""
        ready, done = call.words  # type: ignore[misc]
        flags = self._flags
        _hook_exit_report(self)

        def on_answer(lost: Optional[WprepError], answer: Any) -> None:
            # On the stream's reader thread, in send order; `call` keeps the tensors alive until here.
            error: Optional[BaseException] = lost
            if lost is None and answer.code == 0:
                try:
                    call.complete(answer.batch)
                except BaseException as e:  # noqa: BLE001 - raised by a later call
                    error = e
                flags.finish(ready, reusable=True)
                flags.finish(done, reusable=True)
            else:
                if error is None:
                    error = _answer_error(answer)
                # Refused (nothing queued, nothing will be written) or lost (the daemon may
                # still write): the CPU releases the caller's stream; lost words never return.
                flags.release(done)
                flags.finish(ready, reusable=lost is None)
                flags.finish(done, reusable=lost is None)
            if probe is not None and probe.set_running_or_notify_cancel():
                probe.set_result(error)
                return
            if error is not None:
                with self._async_mu:
                    self._async_errors.append(error)

        try:
            self._send_ordered(Entry(call.request, on_answer, prompt=True))
        except BaseException:
            flags.release(done)
            flags.finish(ready, reusable=False)
            flags.finish(done, reusable=False)
            raise
        return call.early

    def wait_async(self, timeout: Optional[float] = None) -> None:
        """Waits for the answers of every completion='async' batch sent so far, then raises the
        first error among them (a WprepError, as the call itself would have raised), if any.

        TimeoutError when some answer has not come within `timeout` seconds.
        """
        with self._stream_mu:
            stream = self._stream
        if stream is not None and not stream.wait(timeout):
            raise TimeoutError(f"completion='async' batches not all answered after {timeout} s")
        self._raise_async_error()

    def convert_batches(self, batches: Iterable[Sequence[Item]], *, device_uuid: Union[None, bytes, str] = None,
                        stream: Any = None, timeout: Optional[float] = None) -> List[BatchResult]:
        """Many batches on one ordered ConvertBatches stream, each sent without waiting for the
        answers before it, each answered once its work is done (completion "host"). Returns
        their results in order; the first failed batch raises its WprepError, with
        "batches[i]: " before the daemon's message, once every batch is answered (a failed batch
        writes nothing; the others run). TimeoutError when the answers take longer than
        `timeout` (default: the Client's).
        """
        futures: List["concurrent.futures.Future[BatchResult]"] = []
        for i, items in enumerate(batches):
            call = self._batch_call(items, device_uuid, stream, timeout, "host")
            fut: "concurrent.futures.Future[BatchResult]" = concurrent.futures.Future()

            def on_answer(lost: Optional[WprepError], answer: Any, call: Call = call, fut: Any = fut,
                          i: int = i) -> None:
                if lost is not None:
                    call.fail()
                    fut.set_exception(lost)
                elif answer.code != 0:
                    call.fail()
                    e = _answer_error(answer)
                    fut.set_exception(make_error(e.code, f"batches[{i}]: {e.details}", "ConvertBatches"))
                else:
                    try:
                        fut.set_result(call.complete(answer.batch))
                    except BaseException as e:  # noqa: BLE001 - the caller gets it
                        fut.set_exception(e)

            self._send_ordered(Entry(call.request, on_answer))
            futures.append(fut)
        _, not_done = concurrent.futures.wait(futures, self._timeout(timeout))
        if not_done:
            raise TimeoutError(f"{len(not_done)} of {len(futures)} batches not answered after "
                               f"{self._timeout(timeout)} s")
        return [f.result() for f in futures]

    def convert_batch(
        self,
        items: Sequence[Item],
        *,
        device_uuid: Union[None, bytes, str] = None,
        stream: Any = None,
        timeout: Optional[float] = None,
        completion: str = "host",
    ) -> BatchResult:
        """Converts many tensors in one round trip (ConvertBatch): a projection's values and
        scales, a layer, a model. Every item is validated before any work starts; one bad item
        fails the call with INVALID_ARGUMENT naming it ("items[3]...") and nothing is written.

        completion: "host" (default) synchronizes `stream` first and returns once the work is
        done; "stream" (CUDA tensors in and out, one GPU) is ordered on the GPU like a kernel
        launched on `stream` (default: the device's current stream): the daemon's work runs
        after the work queued there before the call, the outputs are ready for work queued
        there after it, and the call returns as soon as the daemon has queued its work, with
        no host wait either side; the results' kernel_seconds are then 0.

        completion="async" is "stream" without waiting for the answer, like a kernel launch: it
        returns once the batch is sent, with the results the daemon's Plans give. The batch goes
        on the Client's ordered ConvertBatches stream and is ordered with words of shared host
        memory (a file of /dev/shm the client maps and registers with CUDA; wait_for and
        signal_when_done as words), not events: `stream` writes the ready word after the
        work queued there before the call, and waits for the done word the daemon's GPU writes
        after the batch. An error comes later, like a CUDA kernel's: it is raised by the next
        conversion call of this Client (any completion), or by wait_async(); the outputs of a
        failed batch are undefined, and the client's CPU writes the done word itself, so
        `stream` goes on all the same. An error no call raised is written to stderr at exit.
        The tensors are held until the answer. The daemon must share the client's /dev/shm
        and be able to open its files (the same user, root, or the group).
        Async calls of one process that share a CUDA stream (or order their streams with each
        other) must go through one Client, whose single stream keeps their order.

        completion="auto" (the drop-in's default) is "async" where it works and "stream" where
        it cannot: the Client's auto calls are sent async and each waits for its own answer
        until one succeeds; from then on they return before the answer. Where the driver has
        no stream memory operations on host memory, or the daemon cannot open the client's
        /dev/shm files (another container's /dev/shm, another user), the Client takes
        "stream" for good, with a RuntimeWarning saying why.
        """
        if completion not in _COMPLETIONS:
            raise ValueError(f"completion must be one of {_COMPLETIONS}; got {completion!r}")
        if completion == "auto":
            return self._convert_auto(items, device_uuid, stream, timeout)
        if completion == "async":
            with self._async_order:
                return self._send_async(self._batch_call(items, device_uuid, stream, timeout, completion))
        return self._run(self._batch_call(items, device_uuid, stream, timeout, completion), timeout)

    def _convert_auto(self, items: Sequence[Item], device_uuid: Union[None, bytes, str], stream: Any,
                      timeout: Optional[float]) -> BatchResult:
        """completion='auto': "async" once an auto call's answer showed that the daemon takes
        this client's host words; until then each auto call is sent async and waits for its
        own answer (raising its error, as "stream" would); "stream" for good where the driver
        or the daemon cannot use host words."""
        mode = self._auto
        if mode is None:
            with self._auto_mu:
                mode = self._auto
                if mode is None:
                    return self._probe_auto(items, device_uuid, stream, timeout)
        return self.convert_batch(items, device_uuid=device_uuid, stream=stream, timeout=timeout, completion=mode)

    def _probe_auto(self, items: Sequence[Item], device_uuid: Union[None, bytes, str], stream: Any,
                    timeout: Optional[float]) -> BatchResult:
        probe: "concurrent.futures.Future[Optional[BaseException]]" = concurrent.futures.Future()
        try:
            with self._async_order:
                early = self._send_async(self._batch_call(items, device_uuid, stream, timeout, "async"), probe)
        except StreamMemOpsError as e:  # this driver cannot order streams with host words
            return self._auto_falls_back(e, items, device_uuid, stream, timeout)
        try:
            error = probe.result(self._timeout(timeout))
        except concurrent.futures.TimeoutError:
            if probe.cancel():  # its answer, when it comes, goes to the later-call queue
                raise TimeoutError(f"completion='auto': the first batch was not answered after "
                                   f"{self._timeout(timeout)} s") from None
            error = probe.result()
        if error is None:
            self._auto = "async"
            return early
        if _host_words_refused(error):  # refused before any work: nothing was written
            return self._auto_falls_back(error, items, device_uuid, stream, timeout)
        raise error

    def _auto_falls_back(self, why: BaseException, items: Sequence[Item], device_uuid: Union[None, bytes, str],
                         stream: Any, timeout: Optional[float]) -> BatchResult:
        self._auto = "stream"
        warnings.warn(f"wprep: completion='auto' takes 'stream' for this Client ({self.target}): host words "
                      f"cannot order its batches: {why}", RuntimeWarning, stacklevel=4)
        return self.convert_batch(items, device_uuid=device_uuid, stream=stream, timeout=timeout,
                                  completion="stream")

    def convert_batch_future(
        self,
        items: Sequence[Item],
        *,
        device_uuid: Union[None, bytes, str] = None,
        stream: Any = None,
        timeout: Optional[float] = None,
        completion: str = "host",
    ) -> "concurrent.futures.Future[BatchResult]":
        """convert_batch() without waiting: a Future of the BatchResult (completion "host" or "stream")."""
        if completion in ("async", "auto"):
            raise ValueError(f"completion={completion!r} returns before the answer already: call convert_batch")
        return self._submit(self._batch_call(items, device_uuid, stream, timeout, completion), timeout)

    # -- devices and health -------------------------------------------------------------------

    def devices(self, *, timeout: Optional[float] = None) -> Devices:
        """The GPUs the daemon uses, and whether its CPU engine serves bytes requests."""
        return Devices.from_proto(self._unary("ListDevices", pb.ListDevicesRequest(), timeout))

    def health(self, service: str = "", *, timeout: Optional[float] = 5.0) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING" (warming up, draining) or "UNKNOWN".

        An unknown service raises WprepError(NOT_FOUND); no daemon, WprepError(UNAVAILABLE).
        """
        try:
            raw = self._check(_health.encode_request(service), timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "Health/Check") from None
        return _health.decode_response(raw)

    def wait_serving(self, timeout: float = 60.0, service: str = "") -> None:
        """Waits until health() is SERVING; raises TimeoutError with the last answer after `timeout` s."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                last = self.health(service, timeout=max(0.05, min(5.0, deadline - time.monotonic())))
                if last == "SERVING":
                    return
            except WprepError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE and e.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                last = str(e)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"wprepd at {self.target} not SERVING after {timeout} s: {last}")
            time.sleep(0.02)

    # -- CUDA IPC registration ----------------------------------------------------------------

    def register(self, tensors: Iterable[Any], *, timeout: Optional[float] = None) -> List[int]:
        """Registers the allocations of these CUDA tensors with the daemon (RegisterIpcHandles).

        For a loader's buffer pool: call once, then no conversion through the pool pays for
        opening its handles (0.5-1 ms each), and the client exports each storage once instead
        of on every call. The client holds the tensors' storages until release(). Returns, per
        distinct allocation, its size in bytes as the daemon sees it (for CUDA virtual memory:
        the bytes of the chunks around the storage).
        """
        refs = _torch.handle_refs(list(tensors), self._registry, register=True)
        resp = self._unary("RegisterIpcHandles", pb.RegisterIpcHandlesRequest(handles=refs), timeout)
        return list(resp.allocation_bytes)

    def release(self, tensors: Iterable[Any], *, timeout: Optional[float] = None) -> int:
        """Lets the daemon drop its mappings of these tensors' allocations (ReleaseIpcHandles).

        Call it before memory the daemon has seen goes back to CUDA (torch.cuda.empty_cache(),
        the end of a pool): until then, or its idle expiry, the daemon's mapping keeps the
        allocation's memory in use. Returns the mappings closed now. With CUDA virtual memory
        (expandable segments) this matters as much: the daemon's mapping holds the chunks'
        physical memory after torch has unmapped them.
        """
        refs = _torch.handle_refs(list(tensors), self._registry, register=False)
        resp = self._unary("ReleaseIpcHandles", pb.ReleaseIpcHandlesRequest(handles=refs), timeout)
        return int(resp.released)

    # -- resident weight sets (wprep.weights) -------------------------------------------------

    def load_weights(self, name: str, path: str, *, rules: "weights.Rules" = None, device: Any = None,
                     device_uuid: Union[None, bytes, str] = None, vmm: bool = False, progress: Any = "auto",
                     timeout: Optional[float] = None) -> "weights.LoadedWeights":
        """wprep.weights.load with this client: the daemon loads `path` (under its
        --weights-root), prepares what `rules` name, and keeps the set as `name` (on GPU
        `device` / `device_uuid`, in CUDA virtual memory with `vmm`, or in host memory)."""
        from . import weights
        return weights.load(name, path, rules=rules, client=self, device=device, device_uuid=device_uuid,
                            vmm=vmm, progress=progress, timeout=timeout)

    def list_weights(self, *, with_tensors: bool = False, timeout: Optional[float] = None) -> "weights.WeightSets":
        """wprep.weights.list_sets with this client: the resident sets, budget and attachments."""
        from . import weights
        return weights.list_sets(with_tensors=with_tensors, client=self, timeout=timeout)

    def attach_weights(self, name: str) -> "weights.AttachedWeights":
        """wprep.weights.attach with this client: zero-copy read-only views of set `name`,
        attached until close() (a context manager)."""
        from . import weights
        return weights.attach(name, client=self)

    def drop_weights(self, name: str, *, force: bool = False, timeout: Optional[float] = None) -> int:
        """wprep.weights.drop with this client: frees set `name`; returns the bytes freed."""
        from . import weights
        return weights.drop(name, force=force, client=self, timeout=timeout)
