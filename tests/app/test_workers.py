"""``rankgate serve --workers 2`` as an operator runs it, in front of a mock engine with GPU-like
timing: both workers serve one port, each sees the other's in-flight requests through the
shared load board, metrics are merged, and a crashed worker is replaced without leaving its
requests counted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from rankgate.mocker.config import MockEngineConfig
from tests.app.processes import answers_ready, wait_ready
from tests.app.test_metrics import value
from tests.conftest import TINY_TOKENIZER
from tests.multimodal.pictures import data_uri, encode, noise
from tests.support.mock_engine import running_mock_engine
from tests.support.polling import wait_until
from tests.support.ports import free_port, free_port_range

ROOT = Path(__file__).resolve().parents[2]
DP = 2
WORKERS = 2
MODEL = "slow-llama"
# At the mocker's GPU-like 8 ms a step, a stream of this many tokens lasts about 2.5 s.
LONG = 300


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def access_lines(self) -> list[dict[str, object]]:
        lines = []
        for raw in self.log.read_bytes().splitlines():
            if raw.startswith(b"{"):
                line = orjson.loads(raw)
                if line.get("logger") == "rankgate.access":
                    lines.append(line)
        return lines

    def workers(self) -> list[int]:
        """The supervisor's worker processes (not its resource tracker)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        pids = [int(p) for p in children.read_text().split()]
        return [p for p in pids if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]

    def connections(self, pid: int) -> int:
        """Client connections worker ``pid`` holds open."""
        port = int(self.url.rsplit(":", 1)[1])
        established = set()
        for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":
                established.add(fields[9])
        held = 0
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:[") and target[8:-1] in established:
                held += 1
        return held


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=DP,
        model=MODEL,
        tokenizer=str(TINY_TOKENIZER),
        kv_events_port=free_port_range(DP),
        kv_replay_port=free_port_range(DP),
        speed=1.0,
        max_model_len=2048,
    )
    log = tmp_path_factory.mktemp("workers") / "gateway.log"
    port = free_port()
    with running_mock_engine(config) as engine, log.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rankgate.app.cli",
                "serve",
                "--workers",
                str(WORKERS),
                "--engine",
                str(engine.target),
                "--tokenizer",
                str(TINY_TOKENIZER),
                "--port",
                str(port),
                "--policy",
                "load",
                "--log-format",
                "json",
                "--access-log",
            ],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, process, log)
            yield Gateway(url, process, log)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                assert process.wait(60) == 0
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
                raise


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path | None = None) -> None:
    """Until the gateway is ready and, when its ``log`` is given, both workers have said their
    server started (a probe alone may reach the first one only: they share one socket)."""
    if log is not None:
        wait_until(
            lambda: _started(log) >= WORKERS,
            120,
            lambda: f"{_started(log)} of {WORKERS} workers started",
        )
    wait_ready(url, process, 120, log)


def _started(log: Path) -> int:
    """How many workers' servers have started, as uvicorn says in any log format."""
    return log.read_bytes().count(b"Application startup complete.")


class Streams:
    """Long streamed completions, each on its own connection, read to the end in threads."""

    def __init__(self, url: str, count: int, prefix: str) -> None:
        self.ids = [f"{prefix}-{i}" for i in range(count)]
        self.started = threading.Barrier(count + 1, timeout=60)
        self.outcomes: dict[str, str] = {}
        self._threads = [
            threading.Thread(target=self._run, args=(url, rid), daemon=True) for rid in self.ids
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, url: str, rid: str) -> None:
        body = {
            "model": MODEL,
            "prompt": f"stream {rid} " * 8,
            "max_tokens": LONG,
            "min_tokens": LONG,
            "stream": True,
        }
        waiting = True
        try:
            with (
                httpx.Client(timeout=60) as client,
                client.stream(
                    "POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}
                ) as response,
            ):
                if response.status_code != 200:
                    self.outcomes[rid] = f"{response.status_code}: {response.read()!r}"
                    return
                for line in response.iter_lines():
                    if waiting and line.startswith("data: {"):
                        waiting = False
                        self.started.wait()
                    if line == "data: [DONE]":
                        self.outcomes[rid] = "done"
        except httpx.HTTPError as exc:
            self.outcomes[rid] = type(exc).__name__
        finally:
            if waiting:
                self.started.abort()

    def wait_started(self) -> None:
        try:
            self.started.wait()
        except threading.BrokenBarrierError:
            self.join()
            raise AssertionError(f"streams failed to start: {self.outcomes}") from None

    def join(self) -> None:
        for thread in self._threads:
            thread.join(60)
            assert not thread.is_alive()


def _scrape(url: str) -> str:
    # A new connection per scrape, so scrapes land on either worker.
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    return response.text


def test_two_workers_serve_one_port_and_share_load(gateway: Gateway) -> None:
    count = 8
    # The workers share one accept queue, and a worker woken by the first connection may
    # accept every one queued behind it: a round can land on one worker alone, so there are
    # up to three. The merged counters count every round.
    served: list[dict[str, object]] = []
    for attempt in range(3):
        streams = Streams(gateway.url, count, f"shared-{attempt}")
        streams.wait_started()
        for _ in range(8):
            text = _scrape(gateway.url)
            # Every worker's router counts all eight, wherever they are served...
            assert value(text, "rankgate_routing_in_flight_requests") == count
            # ...and the merged gauge adds up both workers' requests.
            assert value(text, "rankgate_http_requests_in_flight") == count
        streams.join()
        assert streams.outcomes == dict.fromkeys(streams.ids, "done")
        lines = [line for line in gateway.access_lines() if line["request_id"] in streams.ids]
        assert len(lines) == count
        assert {line["status"] for line in lines} == {200}
        assert {line["completion_tokens"] for line in lines} == {LONG}
        served += lines
        if len({line["pid"] for line in lines}) == 2:
            break
    # Both workers served some of them, so each counted requests it did not serve itself.
    assert len({line["pid"] for line in lines}) == 2
    text = _scrape(gateway.url)
    assert value(text, "rankgate_routing_in_flight_requests") == 0
    # A sibling that answers the scrape's flush request after the scrape stopped waiting for
    # it (a loaded machine) is counted by a later scrape.
    total = len(served)
    scraped = [text]

    def merged() -> float:
        return value(
            scraped[-1], "rankgate_http_requests_total", endpoint="completions", status="200"
        )

    def counted() -> bool:
        if merged() >= total:
            return True
        scraped.append(_scrape(gateway.url))
        return merged() >= total

    wait_until(counted, 10, lambda: f"the merged count has {merged()} of {total} served requests")
    text = scraped[-1]
    # Each worker routed the requests it served; the merged tally has them all.
    assert value(text, "rankgate_routing_requests_total", policy="load") == total
    prompt_tokens = sum(int(str(line["prompt_tokens"])) for line in served)
    assert value(text, "rankgate_routing_prompt_tokens_total") == prompt_tokens


# The system calls ``multiprocessing.connection.wait`` sleeps in, by number as /proc shows
# them (x86-64, then arm64), with the third argument's values that mean no timeout: poll's
# milliseconds (-1), ppoll's pointer to a timespec (NULL).
_NO_TIMEOUT = {0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF}
_POLLS = {"7": ("poll", _NO_TIMEOUT), "271": ("ppoll", {0}), "73": ("ppoll", {0})}


def _syscall(pid: int) -> str:
    """The system call ``pid``'s main thread is blocked in, with its arguments, as /proc says."""
    return Path(f"/proc/{pid}/task/{pid}/syscall").read_text().strip()


def test_an_idle_supervisor_sleeps_until_a_worker_exits(gateway: Gateway) -> None:
    """The supervisor waits on its workers' exits rather than polling them, so an idle one
    costs nothing: it sleeps in a wait with no timeout, which only an exit (or a stop) ends."""
    pid = gateway.process.pid
    calls: list[str] = []

    def waiting() -> bool:
        calls.append(_syscall(pid))
        return calls[-1].split(" ", 1)[0] in _POLLS

    wait_until(waiting, 10, lambda: f"the supervisor is not in a wait: {calls[-1]}")
    number, _, _, timeout, *_ = calls[-1].split()
    name, forever = _POLLS[number]
    assert int(timeout, 16) in forever, f"{name} with a timeout: {calls[-1]}"


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(p) for task in tasks.iterdir() for p in (task / "children").read_text().split()]


def _decoders(pid: int) -> list[int]:
    """The decoder processes among ``pid``'s children."""
    found = []
    for child in _children(pid):
        try:
            if b"rankgate.multimodal.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except FileNotFoundError:
            continue
    return found


def test_each_worker_decodes_media_in_decoder_processes_of_its_own(gateway: Gateway) -> None:
    picture = data_uri(encode(noise(20, 20), "PNG"))
    content = [
        {"type": "text", "text": "what?"},
        {"type": "image_url", "image_url": {"url": picture}},
    ]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    for _ in range(4):
        # A new connection each, so the requests land on either worker.
        response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
    assert any(_decoders(worker) for worker in gateway.workers())
    assert not _decoders(gateway.process.pid)


def test_a_crashed_worker_is_replaced_and_its_load_forgotten(gateway: Gateway) -> None:
    before = gateway.workers()
    assert len(before) == 2
    streams = Streams(gateway.url, 6, "crash")
    streams.wait_started()
    assert value(_scrape(gateway.url), "rankgate_routing_in_flight_requests") == 6
    held = {pid: gateway.connections(pid) for pid in before}
    assert sum(held.values()) == 6
    victim = max(before, key=held.__getitem__)
    os.kill(victim, signal.SIGKILL)
    streams.join()
    cut = [rid for rid, outcome in streams.outcomes.items() if outcome != "done"]
    # The victim's streams were cut; the other worker's finished.
    assert len(cut) == held[victim]

    def replaced() -> bool:
        now = gateway.workers()
        return len(now) == WORKERS and victim not in now and answers_ready(http, gateway.url)

    with httpx.Client(timeout=5) as http:
        wait_until(replaced, 90, lambda: f"no replacement worker: {gateway.workers()}")
    # The dead worker's requests no longer count against any rank.
    for _ in range(4):
        assert value(_scrape(gateway.url), "rankgate_routing_in_flight_requests") == 0
    response = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": MODEL, "prompt": "after the crash", "max_tokens": 3},
        timeout=30,
    )
    assert response.status_code == 200
