"""Gateway-level Prometheus metrics, and the ``/metrics`` exposition in one or many processes.

Per request the gateway observes, once when it ends: the count by endpoint, status and model,
end-to-end latency, time to first token, queue time (arrival until the engine request is
sent: body, tokenization, routing), the mean inter-token latency of the request, and tokens in
and out. Observing each token separately would cost CPU on every token of every stream; the
per-request mean keeps the hot path flat and still shows decode slowing down.
``(status, model)`` series are added on first use, with a ceiling so that no input can grow
the series without bound.

In one process the observations are plain additions to numbers that a collector turns into
the Prometheus families when ``/metrics`` is scraped, instead of locked client-library
increments on every request.

With ``--workers N`` prometheus-client runs in multi-process mode (``PROMETHEUS_MULTIPROC_DIR``
set before it is imported), and any worker's ``/metrics`` reports the whole gateway. The
per-request numbers stay plain additions in each worker too (the library's multi-process
values take a lock and write a memory-mapped file for every increment, several times per
request): a worker writes them to its own snapshot file in that directory at most once a
second and whenever it is scraped, and the scraped worker adds every worker's file up; the
router's per-request tally (``rankgate.sidecar.routing.metrics.RouteTally``) travels in the same
file. The in-flight gauge stays live through the library's files, since it must never lag. Live
views (the router's per-rank load, engine health) are collectors of the scraped worker, added to
the merged families by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from rankgate.sidecar import EngineInfo, PlainHistogram, RouteTally, merge_count, routing_metrics

ENDPOINTS = ("chat", "completions", "responses")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# (endpoint, status, model) series beyond this share the model label "other".
MAX_REQUEST_SERIES = 512
# A worker's per-request numbers reach its snapshot file within this long (--workers).
SNAPSHOT_INTERVAL_S = 1.0
SNAPSHOT_PREFIX = "rankgate_requests_"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    10,
    20,
    40,
    80,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1,
    2.5,
)
QUEUE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
)

EngineProbe = Callable[[], tuple[bool, EngineInfo | None]]


class Observation:
    """What one finished request contributes (seconds; 0 where it never got that far)."""

    __slots__ = (
        "completion_tokens",
        "endpoint",
        "inter_token",
        "model",
        "prompt_tokens",
        "queue",
        "status",
        "total",
        "ttft",
    )

    def __init__(
        self,
        endpoint: str,
        status: int,
        model: str,
        total: float,
        queue: float,
        ttft: float,
        inter_token: float,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        self.endpoint = endpoint
        self.status = status
        self.model = model
        self.total = total
        self.queue = queue
        self.ttft = ttft
        self.inter_token = inter_token
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens


class _EngineCollector(Collector):
    """Engine health as this process sees it, read when scraped."""

    def __init__(self) -> None:
        self.probe: EngineProbe | None = None

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily(
            "rankgate_engine_ready",
            "1 while the engine is discovered and healthy (vLLM's health service says SERVING).",
        )
        info = GaugeMetricFamily(
            "rankgate_engine_info",
            "The engine being served (always 1).",
            labels=["model", "engine_version", "dp_size"],
        )
        probe = self.probe
        healthy, engine = probe() if probe is not None else (False, None)
        ready.add_metric([], 1.0 if healthy else 0.0)
        yield ready
        if engine is not None:
            info.add_metric(
                [engine.served_model_name, engine.engine_version, str(engine.dp_size)], 1.0
            )
            yield info


class _Endpoint:
    """What one endpoint's finished requests add up to."""

    __slots__ = ("completion", "created", "inter_token", "latency", "prompt", "queue", "ttft")

    def __init__(self) -> None:
        self.latency = PlainHistogram(LATENCY_BUCKETS)
        self.ttft = PlainHistogram(TTFT_BUCKETS)
        self.inter_token = PlainHistogram(ITL_BUCKETS)
        self.queue = PlainHistogram(QUEUE_BUCKETS)
        self.prompt = 0
        self.completion = 0
        self.created = time.time()

    def state(self) -> dict[str, Any]:
        return {
            **{attribute: getattr(self, attribute).state() for _, _, attribute in _HISTOGRAMS},
            "prompt": self.prompt,
            "completion": self.completion,
            "created": self.created,
        }

    def merge(self, state: dict[str, Any]) -> None:
        for _, _, attribute in _HISTOGRAMS:
            getattr(self, attribute).merge(state[attribute])
        self.prompt += state["prompt"]
        self.completion += state["completion"]
        self.created = min(self.created, state["created"])


class _Count:
    """A gauge that is only ever stepped by one, from the event loop."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1


class _LocalRecorder(Collector):
    """Per-request metrics as plain counters, turned into Prometheus families when scraped.

    prometheus-client takes a lock for every increment and observation (about fourteen per
    request); a single process that records from its event loop alone needs none of that.
    The families, names, labels, buckets and ``_created`` samples are those the client
    library would expose for the same metrics.
    """

    def __init__(self, in_flight: bool = True, routing: RouteTally | None = None) -> None:
        self.in_flight = _Count()
        self._has_in_flight = in_flight
        # The router's per-request numbers travel with these between workers (see
        # GatewayMetrics); in one process the router's registry shows them itself.
        self.routing = routing
        self.endpoints = {e: _Endpoint() for e in ENDPOINTS}
        # (endpoint, status, model) -> [count, created]
        self.requests: dict[tuple[str, str, str], list[float]] = {}
        self._bound: dict[tuple[str, int, str], list[float]] = {}

    def observe(self, done: Observation) -> None:
        key = (done.endpoint, done.status, done.model)
        counter = self._bound.get(key)
        if counter is None:
            counter = self._bind(key)
        counter[0] += 1
        series = self.endpoints[done.endpoint]
        series.latency.observe(done.total)
        if done.queue > 0.0:
            series.queue.observe(done.queue)
        if done.ttft > 0.0:
            series.ttft.observe(done.ttft)
        if done.inter_token >= 0.0:
            series.inter_token.observe(done.inter_token)
        series.prompt += done.prompt_tokens
        series.completion += done.completion_tokens

    def _bind(self, key: tuple[str, int, str]) -> list[float]:
        endpoint, status, model = key
        if len(self._bound) >= MAX_REQUEST_SERIES:
            model = "other"
        labels = (endpoint, str(status), model)
        counter = self.requests.get(labels)
        if counter is None:
            counter = self.requests[labels] = [0, time.time()]
        if len(self._bound) < 2 * MAX_REQUEST_SERIES:
            self._bound[key] = counter
        return counter

    def collect(self) -> Iterator[Metric]:
        name, doc, labels = _REQUESTS
        requests = CounterMetricFamily(name, doc, labels=labels)
        for values, (count, created) in list(self.requests.items()):
            requests.add_metric(list(values), count, created=created)
        yield requests
        endpoints = list(self.endpoints.items())
        for name, doc, attribute in _HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=["endpoint"])
            for endpoint, series in endpoints:
                getattr(series, attribute).add_to(family, {"endpoint": endpoint})
            yield family
        for name, doc, attribute in _TOKEN_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["endpoint"])
            for endpoint, series in endpoints:
                counter.add_metric([endpoint], getattr(series, attribute), created=series.created)
            yield counter
        if self._has_in_flight:
            gauge = GaugeMetricFamily(_IN_FLIGHT[0], _IN_FLIGHT[1])
            gauge.add_metric([], float(self.in_flight.value))
            yield gauge
        if self.routing is not None:
            yield from self.routing.collect()

    def state(self) -> dict[str, Any]:
        # Copied first: a scrape reads this from a thread while the loop may add a series.
        state = {
            "requests": [[*labels, *value] for labels, value in list(self.requests.items())],
            "endpoints": {e: series.state() for e, series in self.endpoints.items()},
        }
        if self.routing is not None:
            state["routing"] = self.routing.state()
        return state

    def merge(self, state: dict[str, Any]) -> None:
        for endpoint, status, model, count, created in state["requests"]:
            merge_count(self.requests, (endpoint, status, model), count, created)
        for endpoint, series in state["endpoints"].items():
            if endpoint in self.endpoints:
                self.endpoints[endpoint].merge(series)
        if self.routing is not None and "routing" in state:
            self.routing.merge(state["routing"])


class _SnapshotRecorder(_LocalRecorder):
    """The per-request numbers of one of several workers: plain additions, written to this
    worker's snapshot file in the multi-process directory (see the module docstring), with
    the in-flight gauge in the library's files. A scrape of another worker asks for a fresh
    file with :data:`FLUSH_SIGNAL`."""

    def __init__(self, registry: CollectorRegistry, directory: str, routing: RouteTally) -> None:
        super().__init__(in_flight=False, routing=routing)
        self.in_flight = Gauge(  # type: ignore[assignment]
            _IN_FLIGHT[0], _IN_FLIGHT[1], registry=registry, multiprocess_mode="livesum"
        )
        self._path = Path(directory) / f"{SNAPSHOT_PREFIX}{os.getpid()}.json"
        self._start = _start_time(os.getpid())
        self._due = False

    def observe(self, done: Observation) -> None:
        super().observe(done)
        if self._due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.write()  # no event loop to wait on: write now
            return
        self._due = True
        loop.call_later(SNAPSHOT_INTERVAL_S, self._scheduled)

    def _scheduled(self) -> None:
        self._due = False
        self.write()

    def write(self) -> None:
        """This worker's numbers to its file, replaced whole so a reader never sees half."""
        state = {"start": self._start, "written": time.time(), **self.state()}
        temporary = self._path.with_suffix(f".{threading.get_ident()}.tmp")
        temporary.write_bytes(orjson.dumps(state))
        os.replace(temporary, self._path)


# Sent by the scraped worker to its sibling workers: write your snapshot now.
FLUSH_SIGNAL = signal.SIGUSR1
# How long a scrape waits for the siblings' fresh snapshots.
FLUSH_WAIT_S = 0.25


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), so a reused pid is never mistaken."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _siblings(directory: str) -> dict[int, Path]:
    """The other live workers with a snapshot: children of this worker's supervisor that are
    the very processes that wrote those files."""
    parent = os.getppid()
    try:
        children = {
            int(pid) for pid in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        }
    except (OSError, ValueError):
        return {}
    found: dict[int, Path] = {}
    for path in Path(directory).glob(f"{SNAPSHOT_PREFIX}*.json"):
        pid = int(path.stem.removeprefix(SNAPSHOT_PREFIX) or 0)
        if pid == os.getpid() or pid not in children:
            continue
        with contextlib.suppress(OSError, orjson.JSONDecodeError, TypeError):
            if orjson.loads(path.read_bytes()).get("start") == _start_time(pid):
                found[pid] = path
    return found


def refresh_siblings(directory: str) -> None:
    """Ask every sibling worker for a fresh snapshot and wait (briefly) until each has
    written one; run off the event loop."""
    asked = time.time()
    waiting = _siblings(directory)
    for pid in list(waiting):
        try:
            os.kill(pid, FLUSH_SIGNAL)
        except OSError:
            waiting.pop(pid)
    deadline = time.monotonic() + FLUSH_WAIT_S
    while waiting and time.monotonic() < deadline:
        time.sleep(0.002)
        for pid, path in list(waiting.items()):
            with contextlib.suppress(OSError, orjson.JSONDecodeError, TypeError):
                if orjson.loads(path.read_bytes()).get("written", 0) >= asked:
                    waiting.pop(pid)


def merged_snapshots(directory: str) -> _LocalRecorder:
    """Every worker's per-request numbers, added up (a file that cannot be read is skipped:
    it is replaced whole, so that only happens while its worker is being removed)."""
    merged = _LocalRecorder(in_flight=False, routing=RouteTally())
    for path in sorted(Path(directory).glob(f"{SNAPSHOT_PREFIX}*.json")):
        with contextlib.suppress(OSError, orjson.JSONDecodeError, ValueError, KeyError):
            merged.merge(orjson.loads(path.read_bytes()))
    return merged


_REQUESTS = (
    "rankgate_http_requests",
    "OpenAI requests by endpoint, HTTP status and model.",
    ["endpoint", "status", "model"],
)
_HISTOGRAMS = (
    (
        "rankgate_http_request_duration_seconds",
        "Time from request to the last byte of the response.",
        "latency",
    ),
    (
        "rankgate_time_to_first_token_seconds",
        "Time from request to the engine's first token (streamed requests).",
        "ttft",
    ),
    (
        "rankgate_inter_token_latency_seconds",
        "Mean time between tokens after the first, one observation per streamed request.",
        "inter_token",
    ),
    (
        "rankgate_request_queue_seconds",
        "Time from request to the engine request being sent (decoding, admission, "
        "tokenization, routing).",
        "queue",
    ),
)
_TOKEN_COUNTERS = (
    (
        "rankgate_prompt_tokens",
        "Prompt tokens of finished requests (vLLM's count, images expanded).",
        "prompt",
    ),
    ("rankgate_completion_tokens", "Tokens generated for finished requests.", "completion"),
)
_IN_FLIGHT = ("rankgate_http_requests_in_flight", "OpenAI requests being served.")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.multiproc_dir = os.environ.get(MULTIPROC_ENV) or None
        self._engine = _EngineCollector()
        recorder: _LocalRecorder
        if self.multiproc_dir is None:
            recorder = _LocalRecorder()
            registry.register(recorder)
        else:
            recorder = _SnapshotRecorder(
                registry, self.multiproc_dir, routing_metrics(registry).tally
            )
        registry.register(self._engine)
        self._recorder = recorder
        self.in_flight: _Count | Gauge = recorder.in_flight
        self.observe = recorder.observe

    def expose_process(self) -> None:
        """The process's CPU, memory, file descriptors and collector passes, the series a
        standard Prometheus client exports: how an operator sees a gateway's own cost grow.
        With several workers each is one process's, so they are left out there."""
        if self.multiproc_dir is None:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)

    def watch_engine(self, probe: EngineProbe | None) -> None:
        """Report engine health from ``probe`` (None: no engine yet)."""
        self._engine.probe = probe

    def flush(self) -> None:
        """Write what this worker has counted to its snapshot file now (at shutdown)."""
        if isinstance(self._recorder, _SnapshotRecorder):
            self._recorder.write()

    def answer_flushes(self, loop: asyncio.AbstractEventLoop) -> None:
        """With several workers: write a fresh snapshot whenever a sibling asks."""
        if isinstance(self._recorder, _SnapshotRecorder):
            loop.add_signal_handler(FLUSH_SIGNAL, self._recorder.write)

    def exposition(self) -> tuple[bytes, str]:
        """The ``/metrics`` body and content type."""
        if self.multiproc_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        recorder = self._recorder
        if isinstance(recorder, _SnapshotRecorder):
            recorder.write()
            refresh_siblings(self.multiproc_dir)
        merged = CollectorRegistry()
        collector = MultiProcessCollector(None, self.multiproc_dir)  # type: ignore[no-untyped-call]
        shared: list[Metric] = list(collector.collect())  # type: ignore[no-untyped-call]
        shared += merged_snapshots(self.multiproc_dir).collect()
        names = {family.name for family in shared}
        local = [f for f in self.registry.collect() if f.name not in names and f.samples]
        merged.register(_Families(shared + local))
        return generate_latest(merged), CONTENT_TYPE_LATEST


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
