"""``/metrics`` through HTTP: each series moves as requests go through the gateway (real
sidecar and router in front of the mock engine), and the multi-process exposition merges
workers without double counting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import Counter, Gauge, Histogram, multiprocess
from prometheus_client.parser import text_string_to_metric_families

import rankgate.app.observability.metrics as metrics_module
from tests.support.engines import EngineUnderTest
from tests.support.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]


def value(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def scrape(http: httpx.Client) -> str:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def _stream_usage(http: httpx.Client, body: dict[str, object]) -> dict[str, int]:
    usage: dict[str, int] = {}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
    return usage


def test_request_series_follow_requests(
    mock_vllm: EngineUnderTest, mock_http: httpx.Client
) -> None:
    model = mock_vllm.served_model_name
    before = scrape(mock_http)
    usage = _stream_usage(
        mock_http,
        {
            "model": model,
            "messages": [{"role": "user", "content": "count the metrics for me"}],
            "max_tokens": 12,
            "min_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    plain = mock_http.post(
        "/v1/completions", json={"model": model, "prompt": "metrics please", "max_tokens": 5}
    )
    assert plain.status_code == 200
    plain_usage = plain.json()["usage"]
    bad = mock_http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400
    after = scrape(mock_http)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("rankgate_http_requests_total", endpoint="chat", status="200", model=model) == 1
    assert (
        moved("rankgate_http_requests_total", endpoint="completions", status="200", model=model)
        == 1
    )
    # The refusal came before the model was resolved: no client-chosen label value.
    assert moved("rankgate_http_requests_total", endpoint="completions", status="400") == 1
    assert usage["completion_tokens"] == 12
    assert moved("rankgate_completion_tokens_total", endpoint="chat") == 12
    assert moved("rankgate_prompt_tokens_total", endpoint="chat") == usage["prompt_tokens"]
    assert moved("rankgate_completion_tokens_total", endpoint="completions") == 5
    assert (
        moved("rankgate_prompt_tokens_total", endpoint="completions")
        == plain_usage["prompt_tokens"]
    )
    # Latency, queue and routing are observed for both; TTFT and inter-token for the stream.
    for endpoint in ("chat", "completions"):
        assert moved("rankgate_http_request_duration_seconds_count", endpoint=endpoint) >= 1
        assert moved("rankgate_request_queue_seconds_count", endpoint=endpoint) == 1
    assert moved("rankgate_time_to_first_token_seconds_count", endpoint="chat") == 1
    assert moved("rankgate_inter_token_latency_seconds_count", endpoint="chat") == 1
    assert moved("rankgate_time_to_first_token_seconds_count", endpoint="completions") == 0
    assert moved("rankgate_routing_requests_total") == 2
    assert moved("rankgate_routing_cached_prefix_ratio_count") == 2
    assert value(after, "rankgate_http_requests_in_flight") == 0
    # Per-rank series exist for every served rank.
    for rank in range(mock_vllm.dp_size):
        assert f'rankgate_routing_in_flight_requests{{rank="{rank}"}}' in after
    assert value(after, "rankgate_engine_ready") == 1
    assert value(after, "rankgate_engine_info", model=model, dp_size=str(mock_vllm.dp_size)) == 1


def test_engine_health_goes_down_with_the_engine(
    mock_vllm: EngineUnderTest, mock_http: httpx.Client
) -> None:
    assert mock_vllm.mock is not None
    mock_vllm.mock.faults.set_serving(False)
    try:
        wait_until(
            lambda: value(scrape(mock_http), "rankgate_engine_ready") == 0,
            10,
            "rankgate_engine_ready drops to 0",
        )
    finally:
        mock_vllm.mock.faults.set_serving(True)
    wait_until(lambda: mock_http.get("/ready").status_code == 200, 10, "the gateway ready again")
    assert value(scrape(mock_http), "rankgate_engine_ready") == 1


def test_the_process_own_series_are_exported(mock_http: httpx.Client) -> None:
    """CPU, memory and the cyclic collector's passes, as a standard client exports them."""
    text = scrape(mock_http)
    assert value(text, "process_cpu_seconds_total") > 0
    assert value(text, "process_resident_memory_bytes") > 0
    assert value(text, "process_open_fds") > 0
    for generation in ("0", "1", "2"):
        assert f'python_gc_collections_total{{generation="{generation}"}}' in text
    assert "python_info{" in text


def test_several_workers_leave_one_process_series_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client import CollectorRegistry

    from rankgate.app.observability.metrics import MULTIPROC_ENV, GatewayMetrics

    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    registry = CollectorRegistry()
    GatewayMetrics(registry).expose_process()
    names = {family.name for family in registry.collect()}
    assert not any(name.startswith(("process_", "python_")) for name in names)


_MULTIPROCESS = """
import sys
from prometheus_client import CollectorRegistry
from rankgate.app.observability.metrics import GatewayMetrics, Observation
from rankgate.sidecar.routing.metrics import routing_metrics

registry = CollectorRegistry()
metrics = GatewayMetrics(registry)
routing_metrics(registry).set_view(None)
metrics.observe(Observation("chat", 200, "m", 0.5, 0.001, 0.1, 0.01, 7, int(sys.argv[1])))
metrics.in_flight.inc(int(sys.argv[1]))
if sys.argv[1] == "3":
    sys.stdout.write(metrics.exposition()[0].decode())
"""


def test_workers_metrics_merge_without_double_counting(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    first = subprocess.Popen([sys.executable, "-c", _MULTIPROCESS, "2"], cwd=ROOT, env=env)
    assert first.wait(60) == 0
    # What the --workers supervisor does when a worker exits.
    multiprocess.mark_process_dead(first.pid, str(tmp_path))  # type: ignore[no-untyped-call]
    out = subprocess.run(
        [sys.executable, "-c", _MULTIPROCESS, "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
        check=True,
    )
    text = out.stdout
    # Two processes' counters and histograms are summed once each...
    assert value(text, "rankgate_http_requests_total", endpoint="chat", status="200") == 2
    assert value(text, "rankgate_completion_tokens_total", endpoint="chat") == 5
    assert value(text, "rankgate_prompt_tokens_total", endpoint="chat") == 14
    assert value(text, "rankgate_time_to_first_token_seconds_count", endpoint="chat") == 2
    # ...the in-flight gauge counts live processes only (the first one has exited)...
    assert value(text, "rankgate_http_requests_in_flight") == 3
    # ...and the scraped worker's own live views are added once.
    assert text.count("# TYPE rankgate_engine_ready gauge") == 1
    assert text.count("# TYPE rankgate_http_requests_total counter") == 1


Series = tuple[str, tuple[tuple[str, str], ...]]


def _samples(text: str) -> tuple[dict[str, str], set[Series], dict[Series, float]]:
    types: dict[str, str] = {}
    created: set[Series] = set()
    values: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("rankgate_engine_"):
            continue  # the engine's live view, not a request metric
        types[family.name] = family.type
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            if sample.name.endswith("_created"):
                created.add((sample.name, labels))
            else:
                values[(sample.name, labels)] = sample.value
    return types, created, values


_BUCKETS = (
    metrics_module.LATENCY_BUCKETS,
    metrics_module.TTFT_BUCKETS,
    metrics_module.ITL_BUCKETS,
    metrics_module.QUEUE_BUCKETS,
)


class _LibraryRecorder:
    """The same per-request metrics as prometheus-client's own objects: the reference the
    plain counters are held to."""

    def __init__(self, registry: Any) -> None:
        name, doc, labels = metrics_module._REQUESTS
        self.requests = Counter(name, doc, labels, registry=registry)
        histograms = {
            attribute: Histogram(name, doc, ("endpoint",), registry=registry, buckets=buckets)
            for (name, doc, attribute), buckets in zip(
                metrics_module._HISTOGRAMS, _BUCKETS, strict=True
            )
        }
        tokens = {
            attribute: Counter(name, doc, ("endpoint",), registry=registry)
            for name, doc, attribute in metrics_module._TOKEN_COUNTERS
        }
        self.in_flight = Gauge(
            metrics_module._IN_FLIGHT[0],
            metrics_module._IN_FLIGHT[1],
            registry=registry,
            multiprocess_mode="livesum",
        )
        # Label children bound once; (status, model) pairs on first use, with a ceiling.
        self._series = {
            e: (
                histograms["latency"].labels(e),
                histograms["queue"].labels(e),
                histograms["ttft"].labels(e),
                histograms["inter_token"].labels(e),
                tokens["prompt"].labels(e),
                tokens["completion"].labels(e),
            )
            for e in metrics_module.ENDPOINTS
        }
        self._requests: dict[tuple[str, int, str], Any] = {}

    def observe(self, done: Any) -> None:
        key = (done.endpoint, done.status, done.model)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._bind(key)
        counter.inc()
        latency, queue, ttft, inter_token, prompt, completion = self._series[done.endpoint]
        latency.observe(done.total)
        if done.queue > 0.0:
            queue.observe(done.queue)
        if done.ttft > 0.0:
            ttft.observe(done.ttft)
        if done.inter_token >= 0.0:
            inter_token.observe(done.inter_token)
        if done.prompt_tokens:
            prompt.inc(done.prompt_tokens)
        if done.completion_tokens:
            completion.inc(done.completion_tokens)

    def _bind(self, key: tuple[str, int, str]) -> Any:
        endpoint, status, model = key
        if len(self._requests) >= metrics_module.MAX_REQUEST_SERIES:
            model = "other"
        counter = self.requests.labels(endpoint, str(status), model)
        if len(self._requests) < 2 * metrics_module.MAX_REQUEST_SERIES:
            self._requests[key] = counter
        return counter


def test_one_process_exposes_what_the_client_library_would() -> None:
    """The plain counters behind ``/metrics`` in one process expose the same families, types,
    series, buckets and values as prometheus-client's own objects fed the same requests."""
    from prometheus_client import CollectorRegistry, generate_latest

    from rankgate.app.observability.metrics import MAX_REQUEST_SERIES, GatewayMetrics, Observation

    ours = GatewayMetrics(CollectorRegistry())
    reference_registry = CollectorRegistry()
    reference = _LibraryRecorder(reference_registry)
    observations = [
        Observation("chat", 200, "m", 0.5, 0.001, 0.1, 0.01, 7, 5),
        Observation("chat", 200, "m", 0.005, 0.0001, 0.005, 0.0, 3, 1),
        Observation("completions", 400, "", 0.0004, 0.0, 0.0, -1.0, 0, 0),
        Observation("chat", 499, "m", 130.0, 2.0, 100.0, 3.0, 9, 2),
        *(Observation("chat", 200, f"model-{i}", 0.02, 0.0, 0.0, -1.0, 1, 1) for i in range(600)),
    ]
    for done in observations:
        ours.observe(done)
        reference.observe(done)
    ours.in_flight.inc()
    reference.in_flight.inc()
    text = ours.exposition()[0].decode()
    expected = generate_latest(reference_registry).decode()
    ours_types, ours_created, ours_values = _samples(text)
    ref_types, ref_created, ref_values = _samples(expected)
    for name, kind in ref_types.items():
        assert ours_types[name] == kind
    assert ours_created == ref_created
    assert ours_values == ref_values

    def heads(exposition: str) -> set[str]:
        return {
            line
            for line in exposition.splitlines()
            if line.startswith("# ") and "rankgate_engine_" not in line
        }

    assert heads(text) == heads(expected)
    # The series ceiling folds the rest into "other", as before.
    # Three series came first; the ceiling folds the models past it into "other".
    assert value(text, "rankgate_http_requests_total", model="other") == (
        600 + 3 - MAX_REQUEST_SERIES
    )


@pytest.mark.parametrize(
    ("path", "endpoint", "body"),
    [
        ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", "completions", {"prompt": "hi"}),
    ],
)
def test_a_stream_that_fails_midway_is_counted_with_its_error_status(
    scripted: Any,
    scripted_http: httpx.Client,
    path: str,
    endpoint: str,
    body: dict[str, Any],
) -> None:
    from rankgate.app.errors import as_api_error
    from rankgate.sidecar.errors import EngineFailure
    from tests.app.scripted import SCRIPTED_MODEL

    failure = EngineFailure("engine died mid-stream")
    status = str(as_api_error(failure).status)
    scripted.outputs = ["one two three four five"]
    scripted.fail_after = (3, failure)
    before = scrape(scripted_http)
    request = {"model": SCRIPTED_MODEL, **body, "stream": True}
    with scripted_http.stream("POST", path, json=request) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert "engine died mid-stream" in events[-2]
    assert len(events) >= 4  # the chunks before the failure came first
    after = scrape(scripted_http)
    labels = {"endpoint": endpoint, "status": status, "model": SCRIPTED_MODEL}
    moved = value(after, "rankgate_http_requests_total", **labels)
    assert moved - value(before, "rankgate_http_requests_total", **labels) == 1
    assert value(after, "rankgate_http_requests_in_flight") == 0
