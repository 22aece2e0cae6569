"""BatchStream: a Client's ordered ConvertBatches stream, for batches sent before earlier answers.

The daemon takes a stream's batches one at a time, queues each one's GPU work before it reads
the next, and answers each in order with its own status (wprep.v1 ConvertBatchesResponse).
That order is what makes completion="async" safe: a batch's ready word is written by the
caller's stream after it waits for the earlier batch's completion word, so if the daemon
queued a later batch's wait ahead of an earlier batch's work (as concurrent ConvertBatch
calls, handled on several threads, can), neither would ever run.

A batch sent here is an Entry: its request, and a callback that gets its answer (code,
message, ConvertBatchResponse) or, when the stream breaks first, the stream's error. The
callbacks run on the stream's reader thread, in send order.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Deque, Optional

import grpc

from ._errors import WprepError, from_rpc_error

# What an Entry's callback gets: (None, answer) when the daemon answered, its status in
# the answer; (error, None) when the stream broke before the answer.
Answer = Callable[[Optional[WprepError], Any], None]

_END = object()  # ends the request iterator, and so the stream


@dataclass
class Entry:
    request: Any  # a wprep.v1.ConvertBatchRequest
    on_answer: Answer
    # send() returns only once grpc has taken the request (see send()).
    prompt: bool = False


class StreamBroken(Exception):
    """The stream ended; its calls in flight got the error, and the next batch opens a new stream."""


class BatchStream:
    """One ConvertBatches call: a request queue feeding it, a thread reading its answers.

    Thread-safe. send() blocks while max_in_flight batches are unanswered. Once the stream
    breaks (the daemon went away, drained, or the channel closed), every unanswered entry gets
    the error and send() raises StreamBroken.
    """

    def __init__(self, open_stream: Callable[[Any], Any], max_in_flight: int = 256) -> None:
        self.max_in_flight = max_in_flight
        self._requests: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._pending: Deque[Entry] = collections.deque()  # guarded by _cv
        self._broken: Optional[WprepError] = None  # guarded by _cv
        self._answered = 0  # guarded by _cv
        self._sent = 0  # guarded by _cv
        self._taken = 0  # requests grpc took from the queue; guarded by _cv
        self._responses = open_stream(self._iterate())
        self._reader = threading.Thread(target=self._read, name="wprep-batch-stream", daemon=True)
        self._reader.start()

    @property
    def broken(self) -> bool:
        with self._cv:
            return self._broken is not None

    def send(self, entry: Entry) -> int:
        """Queues the batch behind the ones sent before; its position in the stream.

        A prompt entry also waits (at most HAND_TIMEOUT seconds) until grpc has taken it.
        grpc sends a stream's requests from threads of its own, a few GIL hand-offs per
        request; a caller that goes straight on to build its next request keeps the GIL, and
        those threads then get it only at the interpreter's switch interval (5 ms), so
        requests would reach the daemon late and in bursts. Waiting here releases the GIL
        until the request is on its way.
        """
        with self._cv:
            while self._broken is None and len(self._pending) >= self.max_in_flight:
                self._cv.wait()
            if self._broken is not None:
                raise StreamBroken(str(self._broken))
            # Under the lock: the order of _pending is the order on the wire.
            self._pending.append(entry)
            self._requests.put(entry.request)
            self._sent += 1
            position = self._sent
            if entry.prompt:
                self._cv.wait_for(lambda: self._taken >= position or self._broken is not None, self.HAND_TIMEOUT)
            return position - 1

    HAND_TIMEOUT = 1.0

    def _iterate(self) -> Any:
        """The request iterator grpc consumes, counting what it took. grpc's thread goes on
        from taking a request to handing it to the transport, and releases the GIL only
        there, so a sender waiting for the count resumes once the request is on its way."""
        while True:
            request = self._requests.get()
            if request is _END:
                return
            with self._cv:
                self._taken += 1
                self._cv.notify_all()
            yield request

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits until every batch sent so far is answered (or the stream broke); False on timeout."""
        with self._cv:
            target = self._sent
            return self._cv.wait_for(lambda: self._answered >= target or self._broken is not None, timeout)

    def close(self, timeout: Optional[float] = 5.0) -> None:
        """Ends the stream once the batches sent are answered (or after `timeout`), then cancels it."""
        self._requests.put(_END)
        self._reader.join(timeout)
        if self._reader.is_alive() and hasattr(self._responses, "cancel"):
            self._responses.cancel()
            self._reader.join(timeout)

    def _read(self) -> None:
        error: Optional[WprepError] = None
        try:
            for answer in self._responses:
                with self._cv:
                    entry = self._pending.popleft() if self._pending else None
                if entry is None:
                    error = WprepError(grpc.StatusCode.INTERNAL,
                                       f"ConvertBatches answered batch {answer.index}, which was never sent")
                    break
                self._deliver(entry, None, answer)
        except grpc.RpcError as e:
            error = from_rpc_error(e, "ConvertBatches")
        except BaseException as e:  # noqa: BLE001 - any end of the reader breaks the stream
            error = WprepError(grpc.StatusCode.UNKNOWN, f"the ConvertBatches reader failed: {e!r}", "ConvertBatches")
        if error is None:
            error = WprepError(grpc.StatusCode.UNAVAILABLE, "the ConvertBatches stream ended", "ConvertBatches")
        with self._cv:
            self._broken = error
            lost = list(self._pending)
            self._pending.clear()
            self._cv.notify_all()
        for entry in lost:
            self._deliver(entry, error, None)
        self._requests.put(_END)  # lets grpc's request consumer end

    def _deliver(self, entry: Entry, lost: Optional[WprepError], answer: Any) -> None:
        try:
            entry.on_answer(lost, answer)
        finally:
            with self._cv:
                self._answered += 1
                self._cv.notify_all()
