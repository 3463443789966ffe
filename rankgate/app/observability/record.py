"""One OpenAI request's story, from arrival to its last byte, told to metrics and the access log.

A route opens a :class:`RequestRecord` when the request arrives, wraps the engine's delta
stream in :class:`Tracked` (which notes the first and last token, the token counts, and the
rank and cached prefix the sidecar reports on each choice's first delta), and closes it with
the response's status. Everything is read off values the stream already carries, so a token
costs two clock reads and a few attribute stores.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from time import perf_counter
from typing import TYPE_CHECKING

from rankgate.app.observability.logs import AccessLog
from rankgate.app.observability.metrics import GatewayMetrics, Observation
from rankgate.app.respond.primed import close_stream
from rankgate.sidecar import Delta

if TYPE_CHECKING:
    from rankgate.app.observability.tracing import RequestSpans


class RequestRecord:
    __slots__ = (
        "cached_tokens",
        "client_named",
        "completion_tokens",
        "endpoint",
        "finished",
        "first_token",
        "last_token",
        "model",
        "n",
        "prompt_tokens",
        "rank",
        "ranks",
        "request_id",
        "started",
        "stream",
        "submitted",
        "trace",
    )

    def __init__(self, endpoint: str, request_id: str, client_named: bool = False) -> None:
        self.endpoint = endpoint
        self.request_id = request_id
        # Whether the client chose the id (X-Request-Id) rather than the gateway.
        self.client_named = client_named
        self.started = perf_counter()
        self.model = ""
        self.stream = False
        self.n = 1
        self.submitted = 0.0
        self.first_token = 0.0
        self.last_token = 0.0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        # The first choice's rank; ``ranks`` lists every prompt's when they differ.
        self.rank: int | None = None
        self.ranks: list[int | None] | None = None
        self.finished = False
        # The request's spans when tracing is on.
        self.trace: RequestSpans | None = None

    def on_first_delta(self, delta: Delta) -> None:
        """A choice's first delta: count its prompt once per prompt (choice 0 of each)."""
        if delta.index % self.n:
            return
        self.prompt_tokens += delta.prompt_tokens or 0
        self.cached_tokens += delta.cached_tokens or 0
        if delta.index == 0:
            self.rank = delta.rank
        elif self.ranks is not None:
            self.ranks.append(delta.rank)
        elif delta.rank != self.rank:
            self.ranks = [self.rank, delta.rank]

    def timings(self) -> tuple[float, float, float, float]:
        """Seconds: total, queue, time to first token (0 when not measured) and mean
        inter-token latency (-1 when not measured; 0 is real: tokens that arrived together)."""
        end = perf_counter()
        started = self.started
        queue = self.submitted - started if self.submitted else 0.0
        if not self.stream or not self.first_token:
            # A request that does not stream gets its whole output at once (vLLM's unary
            # Generate): there is no first token to time.
            return end - started, queue, 0.0, -1.0
        ttft = self.first_token - started
        inter = -1.0
        per_choice = self.completion_tokens // max(1, self.n)
        if per_choice > 1:
            inter = (self.last_token - self.first_token) / (per_choice - 1)
        return end - started, queue, ttft, inter


class Tracked:
    """The engine's delta stream, unchanged, with its timings and counts noted on the record.

    A plain iterator, not an async generator: a generator costs its first step (the event
    loop's first-iteration hook and a weak set entry) and an ``aclose`` per request, more
    than a non-streaming answer spends iterating. A long stream is read through
    :meth:`unwrap` instead, with no wrapper per delta at all.
    """

    __slots__ = ("_inner", "_record")

    def __init__(self, inner: AsyncIterator[Delta], record: RequestRecord) -> None:
        self._inner = inner
        self._record = record
        record.submitted = perf_counter()

    def __aiter__(self) -> Tracked:
        return self

    async def __anext__(self) -> Delta:
        delta = await self._inner.__anext__()
        self.note(delta)
        return delta

    def note(self, delta: Delta) -> None:
        """Note ``delta`` on the record, as iterating this stream does for each delta."""
        record = self._record
        if delta.token_ids:
            now = perf_counter()
            if not record.first_token:
                record.first_token = now
            record.last_token = now
        if delta.prompt_tokens is not None:
            record.on_first_delta(delta)
        if delta.completion_tokens is not None:
            record.completion_tokens += delta.completion_tokens

    def unwrap(self) -> tuple[AsyncIterator[Delta], Callable[[Delta], None]]:
        """The stream under this one and :meth:`note`, for a consumer that iterates the
        stream itself and notes each delta. Closing this object still closes the inner
        stream."""
        return self._inner, self.note

    async def aclose(self) -> None:
        await close_stream(self._inner)


class RequestObserver:
    """Turns finished records into metrics and (when enabled) one access-log line each."""

    __slots__ = ("access_log", "metrics")

    def __init__(self, metrics: GatewayMetrics, access_log: AccessLog | None) -> None:
        self.metrics = metrics
        self.access_log = access_log

    def begin(self, endpoint: str, request_id: str, client_named: bool = False) -> RequestRecord:
        self.metrics.in_flight.inc()
        return RequestRecord(endpoint, request_id, client_named)

    def finish(self, record: RequestRecord, status: int) -> None:
        """Close ``record`` with the status the client saw; a second call does nothing."""
        if record.finished:
            return
        record.finished = True
        trace = record.trace
        if trace is not None:
            trace.end(status)
        self.metrics.in_flight.dec()
        total, queue, ttft, inter = record.timings()
        self.metrics.observe(
            Observation(
                record.endpoint,
                status,
                record.model,
                total,
                queue,
                ttft,
                inter,
                record.prompt_tokens,
                record.completion_tokens,
            )
        )
        if self.access_log is not None:
            self.access_log.request(record, status, total, queue, ttft)
