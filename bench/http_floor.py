"""The HTTP server's own floor: a bare ASGI app under the gateway's uvicorn configuration.

It answers every POST with a fixed chat completion after reading the body, and ``/ready``
with 200: no routing, no engine, no framework. Its CPU per request at a fixed rate is what the
gateway's HTTP protocol, uvicorn's cycle and the kernel's sockets cost before the gateway
does anything (``bench/tree_ab.py floor``).

``--server`` puts the same answer behind another server, the control for the one underneath
the gateway: Granian (Rust, hyper) with this ASGI app, or with its own RSGI interface, one
worker process and one runtime thread, HTTP/1.1 only. Granian is not a dependency of the
gateway: ``pip install granian`` first (``bench/tree_ab.py floor:granian-asgi``).

    python bench/http_floor.py PORT [--server uvicorn|granian-asgi|granian-rsgi]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
from pathlib import Path
from typing import Any

import httptools
import orjson
import uvicorn
import uvloop

from rankgate.app.serving.connections import ConnectionLimits
from rankgate.app.serving.http1 import uvicorn_config

ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-floor",
        "object": "chat.completion",
        "created": 0,
        "model": "floor",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "eight tokens of a short answer."},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 30, "completion_tokens": 8, "total_tokens": 38},
    }
)
HEAD = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(ANSWER)),
    ],
}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    more = scope["method"] == "POST"
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(HEAD)
    await send({"type": "http.response.body", "body": ANSWER})


async def rsgi(scope: Any, protocol: Any) -> None:
    """The same answer through Granian's own interface, which needs no ASGI messages."""
    if scope.method == "POST":
        await protocol()
    protocol.response_bytes(200, [("content-type", "application/json")], ANSWER)


class RawProtocol(asyncio.Protocol):
    """The same answer from an HTTP/1.1 protocol with nothing between the parser and the
    socket: no ASGI scope, messages or task per request. What any server written in Python on
    ``httptools`` and uvloop pays at least."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.body.clear()
        assert self.transport is not None
        self.transport.write(RAW_ANSWER)


RAW_ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(ANSWER)
    + ANSWER
)


def serve_raw(port: int) -> None:
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(RawProtocol, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    uvloop.run(serve())


SERVERS = ("uvicorn", "raw", "granian-asgi", "granian-rsgi")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--server", choices=SERVERS, default="uvicorn")
    args = parser.parse_args()
    if args.server == "uvicorn":
        config = uvicorn_config(
            app, ConnectionLimits(), host="127.0.0.1", port=args.port, log_level="warning"
        )
        uvicorn.Server(config).run()
        return
    if args.server == "raw":
        serve_raw(args.port)
        return
    # Imported by name: Granian is installed only to run this control.
    granian = importlib.import_module("granian")
    constants = importlib.import_module("granian.constants")

    # Granian's worker imports the target by name, in a process of its own.
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
    interface = args.server.removeprefix("granian-")
    granian.Granian(
        f"http_floor:{'app' if interface == 'asgi' else 'rsgi'}",
        address="127.0.0.1",
        port=args.port,
        interface=constants.Interfaces(interface),
        workers=1,
        runtime_threads=1,
        runtime_mode=constants.RuntimeModes("st"),
        loop=constants.Loops("uvloop"),
        http=constants.HTTPModes("1"),
        websockets=False,
        log_enabled=False,
    ).serve()


if __name__ == "__main__":
    main()
