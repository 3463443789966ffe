"""The HTTP server's own floor: a bare ASGI app under the gateway's uvicorn configuration.

It answers every POST with a fixed chat completion after reading the body, and ``/ready``
with 200: no routing, no engine, no framework. Its CPU per request at a fixed rate is what the
gateway's HTTP protocol, uvicorn's cycle and the kernel's sockets cost before the gateway
does anything (``bench/tree_ab.py floor``).

    python bench/http_floor.py PORT
"""

from __future__ import annotations

import sys
from typing import Any

import orjson
import uvicorn

from rankgate.app.connections import ConnectionLimits, uvicorn_config

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


def main() -> None:
    port = int(sys.argv[1])
    config = uvicorn_config(
        app, ConnectionLimits(), host="127.0.0.1", port=port, log_level="warning"
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
