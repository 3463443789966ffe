"""How much CPU do the app's own layers take per request and per streamed chunk?

The gateway bench (``bench/gateway_overhead.py``) measures the whole process on loopback, where
socket wake-ups, the HTTP server and a shared machine's noise swamp changes of tens of
microseconds. This one calls the ASGI app in-process with an engine that answers instantly
(a prepared delta), so what is left is the framework, middleware, preparation (template and
tokenizer) and response encoding: best-of-rounds CPU time, stable enough to A/B a change.

    .venv/bin/python bench/app_overhead.py [--requests 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.sidecar import merge_batch
from rankgate.sidecar.types import Delta, EngineInfo, PreparedRequest, RankCapacity

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
MODEL = "bench-model"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a short poem about data-parallel routing."},
]


class InstantEngine:
    """Answers every request at once: one whole-output delta, or ``max_tokens`` token deltas
    when the client streams (as a sidecar would)."""

    ready = True

    def __init__(self) -> None:
        self.info = EngineInfo(
            model_id=str(TOKENIZER),
            served_model_name=MODEL,
            aliases=(),
            engine_version="0.32.0",
            instance_id="bench",
            max_model_len=4096,
            block_size=16,
            dp_size=2,
            ranks=(0, 1),
            capacity=(RankCapacity(0, 4096, 256), RankCapacity(1, 4096, 256)),
            max_batched_tokens=8192,
            supports_text_input=True,
            supports_lora=False,
            supports_multimodal=False,
            reasoning_parser="",
            tool_call_parser="",
        )

    admission = None

    async def list_loras(self) -> tuple[str, ...]:
        return ()

    def generate_batch(self, requests: Sequence[PreparedRequest], n: int) -> AsyncIterator[Delta]:
        return merge_batch([self.generate(request) for request in requests], n)

    async def close(self) -> None:
        return None

    async def generate(self, request: PreparedRequest) -> AsyncIterator[Delta]:
        tokens = request.stopping.max_tokens
        if not request.stream:
            yield Delta(
                text=" word" * tokens,
                token_ids=(42,) * tokens,
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=tokens,
                finish_reason="length",
            )
            return
        for i in range(tokens):
            delta = Delta(text=" word", token_ids=(42,))
            if i == 0:
                delta.prompt_tokens = len(request.prompt_token_ids)
            if i == tokens - 1:
                delta.completion_tokens = tokens
                delta.finish_reason = "length"
            yield delta


class Client:
    """Drives the ASGI app directly: one request at a time, the connection kept open."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.chunks = 0
        self.error = b""

    async def post(self, path: str, body: bytes) -> int:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"bench"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }
        sent = False
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        status = 0

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message.get("more_body"):
                self.chunks += 1
            elif status != 200:
                self.error = message.get("body", b"")

        await self.app(scope, receive, send)
        never.cancel()
        return status


async def lifespan(app: Any) -> asyncio.Task[None]:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    started = asyncio.Event()
    await queue.put({"type": "lifespan.startup"})

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set()
        elif message["type"] == "lifespan.startup.failed":
            raise SystemExit(f"app startup failed: {message.get('message')}")

    task = asyncio.create_task(app({"type": "lifespan", "state": {}}, queue.get, send))
    await asyncio.wait_for(started.wait(), 60)
    return task


async def measure(client: Client, body: bytes, requests: int, rounds: int) -> tuple[float, float]:
    """Best-of-rounds CPU seconds per request, and chunks per request."""
    best = float("inf")
    chunks = 0
    for _ in range(rounds):
        client.chunks = 0
        started = time.process_time()
        for _ in range(requests):
            status = await client.post("/v1/chat/completions", body)
            if status != 200:
                raise SystemExit(f"status {status}: {client.error.decode(errors='replace')}")
            # A turn of the loop between requests, as a server has: the request's cancelled
            # helpers (the client watch's) end there instead of piling up over the run.
            await asyncio.sleep(0)
        best = min(best, time.process_time() - started)
        chunks = client.chunks
    return best / requests, chunks / requests


async def run(args: argparse.Namespace) -> None:
    app = create_app(GatewaySettings(tokenizer=str(TOKENIZER)), engine=InstantEngine())
    # Held until the end: a lifespan task that is garbage-collected shuts the app down.
    running = await lifespan(app)
    client = Client(app)
    base: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "ignore_eos": True}
    plain = orjson.dumps({**base, "max_tokens": 16})
    short = orjson.dumps({**base, "max_tokens": 16, "stream": True})
    long = orjson.dumps({**base, "max_tokens": 128, "stream": True})
    n, rounds = args.requests, args.rounds
    await measure(client, plain, 200, 1)
    await measure(client, short, 100, 1)
    plain_cpu, _ = await measure(client, plain, n, rounds)
    short_cpu, short_chunks = await measure(client, short, n, rounds)
    long_cpu, long_chunks = await measure(client, long, n // 4, rounds)
    per_chunk = (long_cpu - short_cpu) / (long_chunks - short_chunks)
    print(f"app layers in-process (instant engine), best of {rounds} rounds")
    print(f"  non-streaming chat request      {plain_cpu * 1e6:8.1f} us")
    print(
        f"  streaming chat, 16 tokens       {short_cpu * 1e6:8.1f} us ({short_chunks:.0f} chunks)"
    )
    print(f"  streaming chat, 128 tokens      {long_cpu * 1e6:8.1f} us ({long_chunks:.0f} chunks)")
    print(f"  per streamed chunk (marginal)   {per_chunk * 1e6:8.2f} us")
    running.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(run(args))
    except ImportError:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
