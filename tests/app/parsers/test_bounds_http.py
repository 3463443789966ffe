"""Through HTTP, the worst flood of each parser's own markers costs the gateway CPU time linear
in its length, streamed and not, and ``/health`` answers while the flood is being served.

Each parser runs behind a gateway whose engine answers with the flood, one marker per delta.
The flood is the format's call with one of its markers left out (a closer or a separator,
repeated with no end), the one that grows worst when driven in-process; the gateway's
event-loop thread is measured at one and sixteen times its length.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.gateway import Gateway, ServingOptions
from rankgate.app.server import create_app
from rankgate.sidecar.types import Delta, PreparedRequest
from tests.app.parsers import floods
from tests.app.parsers.vocab import build_tokenizer
from tests.app.scripted import SCRIPTED_MODEL, ScriptedEngine, scripted_info
from tests.app.serving import serve_app
from tests.conftest import TINY_TOKENIZER
from tests.support.polling import until

pytestmark = pytest.mark.timeout(120)

# Characters of the smaller flood (an HTTP request carries more fixed cost than a parser run).
SIZE = 512
SUBJECTS = floods.subjects()


class FloodEngine(ScriptedEngine):
    """Answers with ``pieces``, one delta each, and holds the last one until ``/health`` has
    answered while the answer was being served."""

    def __init__(self) -> None:
        info = msgspec.structs.replace(scripted_info(TINY_TOKENIZER), max_model_len=1 << 20)
        super().__init__(info, TINY_TOKENIZER)
        self.pieces: list[str] = []
        self.started = threading.Event()
        self.answered = threading.Event()

    async def generate(self, request: PreparedRequest) -> AsyncIterator[Delta]:
        self.requests.append(request)
        last = len(self.pieces) - 1
        for position, piece in enumerate(self.pieces):
            delta = Delta(index=0, text=piece, token_ids=(position % 97,))
            if position == 0:
                delta.prompt_tokens = len(request.prompt_token_ids)
                self.started.set()
            if position == last:
                await until(self.answered.is_set, 30, "a /health answer while the flood streamed")
                delta.finish_reason = "stop"
                delta.completion_tokens = len(self.pieces)
            yield delta
            if position % 64 == 63:
                await asyncio.sleep(0)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, FloodEngine, httpx.Client, httpx.Client]]:
    """The app, its engine, a client for the floods and one for ``/health`` probes."""
    engine = FloodEngine()
    app = create_app(GatewaySettings(), engine=engine)
    with (
        serve_app(app) as url,
        httpx.Client(base_url=url, timeout=60) as client,
        httpx.Client(base_url=url, timeout=30) as prober,
    ):
        yield app, engine, client, prober


def _gateway_thread(client: httpx.Client) -> threading.Thread:
    port = client.base_url.port
    return next(t for t in threading.enumerate() if t.name == f"uvicorn-{port}")


def _worst_flood(subject: floods.Subject, plan: Any) -> tuple[str, tuple[str, ...]]:
    """The call flood whose sixteen-fold length costs the parser the most time in-process."""
    calls = [(what, unit) for what, unit in floods.floods(subject) if what.startswith("call")]

    return max(calls, key=lambda c: floods.parse_growth(plan, floods.repeat(c[1], floods.SIZE), 1))


def _serve(
    engine: FloodEngine,
    clients: tuple[httpx.Client, httpx.Client],
    body: dict[str, Any],
    pieces: list[str],
) -> float:
    """The gateway thread's CPU seconds for one request answered with ``pieces``; a
    ``/health`` probe is sent once the answer has started and must be answered before it ends."""
    client, prober = clients
    engine.pieces = pieces
    engine.started.clear()
    engine.answered.clear()
    health: list[int] = []

    def probe() -> None:
        if engine.started.wait(30):
            health.append(prober.get("/health").status_code)
            engine.answered.set()

    probing = threading.Thread(target=probe, name="health-probe")
    clock = time.pthread_getcpuclockid(_gateway_thread(client).ident or 0)
    probing.start()
    started = time.clock_gettime(clock)
    if body.get("stream"):
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for _ in response.iter_bytes():
                pass
    else:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
    spent = time.clock_gettime(clock) - started
    probing.join(30)
    assert health == [200], "/health was not answered while the flood was served"
    return spent


def _growth(
    engine: FloodEngine,
    clients: tuple[httpx.Client, httpx.Client],
    body: dict[str, Any],
    small: list[str],
) -> float:
    return floods.growth(
        lambda: _serve(engine, clients, body, small),
        lambda: _serve(engine, clients, body, small * floods.GROWTH),
        samples=1,
    )


@pytest.mark.parametrize("subject", SUBJECTS, ids=[s.name for s in SUBJECTS])
def test_the_worst_flood_of_each_parser_is_linear_through_http(
    subject: floods.Subject,
    served: tuple[Any, FloodEngine, httpx.Client, httpx.Client],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    app, engine, client, prober = served
    root = tmp_path_factory.getbasetemp()
    plan = floods.plan(subject, floods.vocabulary_of(subject.family, root))
    what, unit = _worst_flood(subject, plan)
    family = "gptoss" if subject.family == "harmony" else subject.family
    options = ServingOptions(
        tokenizer=str(build_tokenizer(family, Path(root))),
        tool_call_parser=subject.tool_parser,
        reasoning_parser=subject.reasoning_parser,
    )
    app.state.gateway = Gateway(engine, options)
    body: dict[str, Any] = {
        "model": SCRIPTED_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if subject.tool_parser is not None:
        body["tools"] = [
            {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
        ]
    small = floods.repeat(unit, SIZE)
    slow = []
    for stream in (True, False):
        ratio = _growth(engine, (client, prober), {**body, "stream": stream}, small)
        if ratio >= floods.BOUND:
            slow.append(f"{'streamed' if stream else 'whole'}: {ratio:.0f}x")
    assert not slow, f"{what}, {floods.GROWTH}x as long, took the gateway " + "; ".join(slow)
