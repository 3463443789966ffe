"""bench/open_loop.mjs sends what it is asked to: every request, over a bounded number of
connections, each body its template (with ``--unique``, its own question), and counts as
answered only what came back 2xx with a JSON body."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.bench.load import BENCH

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed"),
]


class _Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, answer: bytes) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer = answer
        self.bodies: list[dict[str, Any]] = []
        self.peers: set[tuple[str, int]] = set()
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Recorder

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with self.server.lock:
            self.server.bodies.append(body)
            self.server.peers.add(self.client_address)
        answer = self.server.answer
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[_Recorder]:
    server = _Recorder(b'{"ok": true}')
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _run(recorder: _Recorder, body: Path, *extra: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{recorder.server_address[1]}/v1/chat/completions"
    argv = [
        "node", str(BENCH / "open_loop.mjs"), "--url", url, "--body", str(body), "--rate", "400",
        "--seconds", "0.25", "--clients", "4", *extra,
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=50, check=False)
    assert done.returncode == 0, done.stderr
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def test_unique_requests_each_ask_their_own_question(recorder: _Recorder, tmp_path: Path) -> None:
    template = {"model": "m", "messages": [{"role": "user", "content": "Hello."}]}
    body = tmp_path / "body.json"
    body.write_text(json.dumps(template))
    figures = _run(recorder, body, "--unique", "--header", "authorization: Bearer k")
    assert figures["requests"] == figures["ok"] == 100
    assert len(recorder.bodies) == 100
    contents = [b["messages"][-1]["content"] for b in recorder.bodies]
    assert len(set(contents)) == 100
    assert all(c.startswith("Hello. Question ") for c in contents)
    assert len(recorder.peers) <= 4


def test_without_unique_every_body_is_the_template(recorder: _Recorder, tmp_path: Path) -> None:
    template = {"model": "m", "prompt": "Once"}
    body = tmp_path / "body.json"
    body.write_text(json.dumps(template))
    figures = _run(recorder, body, "--even")
    assert figures["ok"] == 100
    assert recorder.bodies == [template] * 100


def test_an_answer_that_is_not_json_is_not_counted(recorder: _Recorder, tmp_path: Path) -> None:
    recorder.answer = b"not json"
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"model": "m", "prompt": "x"}))
    figures = _run(recorder, body)
    assert figures["requests"] == 100
    assert figures["ok"] == 0
