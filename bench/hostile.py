"""Hostile clients against one gateway: how long is everyone else kept waiting, and what memory?

For every class of attack this sends the worst case found and measures, on a fresh
gateway each time: the outcome the attacker gets (status, or how long a connection stayed
open), the longest ``GET /health`` round trip of a concurrent poller (that is the event loop's
stall: /health itself does no work) and the gateway process's peak RSS growth over its idle
size. Run it against two source trees to compare before and after a change:

    git worktree add /work/wt/hostile-before ecf0ed4
    flock /tmp/rankgate-bench.lock .venv/bin/python bench/hostile.py \
        --tree before=/work/wt/hostile-before --tree after=.

Each tree's gateway and mock engine run from that tree's sources (``PYTHONPATH``) with this
interpreter; the engine is a separate process, so the RSS is the gateway's own. An attack that
is not answered within ``--attack-timeout`` seconds is reported as such (the gateway is then
killed and the next case starts afresh).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import http.client
import io
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.loop_probe import health_probe  # noqa: E402
from tests.support.ports import free_port, free_port_range  # noqa: E402

PY = sys.executable
TOKENIZER = ROOT / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
MODEL = "mock-model"
MB = 1 << 20
RANK = "x-data-parallel-rank"


@dataclass
class Gateway:
    url: str
    port: int
    pid: int
    tree: Path


@dataclass
class Outcome:
    what: str
    seconds: float


Attack = Callable[[Gateway], Outcome]


# ---- attacks ---------------------------------------------------------------------------------


def _post(gw: Gateway, path: str, body: bytes, timeout: float, **headers: str) -> Outcome:
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=timeout)
    try:
        conn.request(
            "POST", path, body=body, headers={"content-type": "application/json", **headers}
        )
        response = conn.getresponse()
        response.read()
        return Outcome(str(response.status), time.perf_counter() - started)
    except TimeoutError:
        return Outcome("no answer", time.perf_counter() - started)
    except (OSError, http.client.HTTPException) as exc:
        return Outcome(type(exc).__name__, time.perf_counter() - started)
    finally:
        conn.close()


def _chat(messages: list[Any], **fields: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 1, **fields})


def depth_regex(gw: Gateway, timeout: float) -> Outcome:
    # Brackets past the limit, then an unterminated string of escaped quotes: 60 KB.
    body = b'{"model":"m","messages":' + b"[" * 100 + b'"' + b'\\"' * 30_000
    return _post(gw, "/v1/chat/completions", body, timeout)


# Bodies are built once, before the probe starts: building them holds this process's GIL,
# which would delay the probe's own thread and show up as the gateway's latency.


@cache
def _kv_nested_body() -> bytes:
    inner = b",".join([b"[[],[[]],[[[]]]]"] * (30 * MB // 17))
    return (
        b'{"model":"'
        + MODEL.encode()
        + b'","prompt":"hi","max_tokens":1,"kv_transfer_params":{"x":['
        + inner
        + b"]}}"
    )


def kv_nested_30mb(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/v1/completions", _kv_nested_body(), timeout)


@cache
def _message_body() -> bytes:
    return _chat([{"role": "user", "content": "lorem ipsum dolor " * (10 * MB // 18)}])


def message_10mb(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/v1/chat/completions", _message_body(), timeout)


@cache
def _tool_body() -> bytes:
    tool = {
        "type": "function",
        "function": {"name": "f", "description": "describe " * (10 * MB // 9), "parameters": {}},
    }
    return _chat([{"role": "user", "content": "hi"}], tools=[tool])


def tool_description_10mb(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/v1/chat/completions", _tool_body(), timeout)


@cache
def _reasoning_body() -> bytes:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "reasoning_content": "think " * (10 * MB // 6)},
        {"role": "user", "content": "again"},
    ]
    return _chat(messages)


def reasoning_10mb(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/v1/chat/completions", _reasoning_body(), timeout)


def header_200mb(gw: Gateway, timeout: float) -> Outcome:
    started = time.perf_counter()
    body = _chat([{"role": "user", "content": "hi"}])
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nx-filler: "
    )
    with socket.create_connection(("127.0.0.1", gw.port), timeout=timeout) as sock:
        try:
            sock.sendall(head)
            chunk = b"a" * MB
            for _ in range(200):
                sock.sendall(chunk)
            sock.sendall(b"\r\n\r\n" + body)
        except OSError:
            pass
        return Outcome(_status_line(sock), time.perf_counter() - started)


def _status_line(sock: socket.socket) -> str:
    try:
        data = sock.recv(64)
    except TimeoutError:
        return "no answer"
    except OSError as exc:
        return type(exc).__name__
    if not data:
        return "closed"
    parts = data.split(b" ", 2)
    return parts[1].decode() if len(parts) > 1 else "?"


class BombServer:
    """Serves a compression bomb: a few hundred bytes that inflate to hundreds of MiB."""

    def __init__(self) -> None:
        raw = b"\0" * (512 * MB)
        once = gzip.compress(raw, compresslevel=9)
        self.gzip_gzip = gzip.compress(once, compresslevel=9)
        try:
            import brotli  # type: ignore[import-untyped]

            self.brotli: bytes | None = brotli.compress(raw, quality=5)
        except ImportError:
            self.brotli = None
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/gzip.png":
                    body, encoding = server.gzip_gzip, "gzip, gzip"
                else:
                    assert server.brotli is not None
                    body, encoding = server.brotli, "br"
                self.send_response(200)
                self.send_header("content-type", "image/png")
                self.send_header("content-encoding", encoding)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


_BOMBS: BombServer | None = None


def _bombs() -> BombServer:
    global _BOMBS
    if _BOMBS is None:
        _BOMBS = BombServer()
    return _BOMBS


def _image_chat(urls: list[str]) -> bytes:
    content: list[dict[str, Any]] = [{"type": "text", "text": "what is this?"}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return _chat([{"role": "user", "content": content}])


def gzip_bomb(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/v1/chat/completions", _image_chat([_bombs().base + "/gzip.png"]), timeout)


def brotli_bomb(gw: Gateway, timeout: float) -> Outcome:
    if _bombs().brotli is None:
        return Outcome("skipped (no brotli)", 0.0)
    return _post(gw, "/v1/chat/completions", _image_chat([_bombs().base + "/br.png"]), timeout)


def _big_png(width: int, height: int, shade: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (shade, shade, shade)).save(buffer, "PNG", compress_level=9)
    return buffer.getvalue()


@cache
def _images_body() -> bytes:
    # Sixteen 7000x4000 PNGs (each a few dozen KB, 28 Mpixel decoded) in a 4096-token context.
    uris = [
        "data:image/png;base64," + base64.b64encode(_big_png(7000, 4000, i)).decode()
        for i in range(16)
    ]
    return _image_chat(uris)


def images_over_budget(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/v1/chat/completions", _images_body(), timeout)


def _clip_chat(parts: list[dict[str, Any]]) -> bytes:
    return _chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}])


def _input_audio(data: bytes, fmt: str) -> dict[str, Any]:
    encoded = base64.b64encode(data).decode()
    return {"type": "input_audio", "input_audio": {"data": encoded, "format": fmt}}


@cache
def _audio_duration_body() -> bytes:
    # A one-second FLAC whose STREAMINFO claims 2^36 - 1 samples: about 50 days at 16 kHz.
    from tests.multimodal.test_clips import flac_declaring

    return _clip_chat([_input_audio(flac_declaring(2**36 - 1), "flac")])


@cache
def _audio_decode_body() -> bytes:
    # 20 minutes of silence at 48 kHz: a few hundred KB of FLAC, 230 MB of samples decoded.
    from tests.multimodal.clips import encoded_audio

    silence = encoded_audio("flac", "flac", seconds=1200.0, rate=48_000, tone=0.0)
    return _clip_chat([_input_audio(silence, "flac")])


@cache
def _wav_scan_body() -> bytes:
    # A WAV whose header declares 100 bytes of samples, followed by 18 MB more bytes of
    # zeros FFmpeg walks as chunk headers.
    from tests.multimodal.clips import wav_declaring

    return _clip_chat([_input_audio(wav_declaring(100, 18 * MB), "wav")])


@cache
def _wav_18mb_body() -> bytes:
    # A plain WAV of the same size (9 minutes at 16 kHz): the control for the scan above.
    from tests.multimodal.clips import wav

    return _clip_chat([_input_audio(wav(560.0, rate=16_000), "wav")])


@cache
def _video_frames_body() -> bytes:
    # A WebM of 40,000 tiny frames (WebM states no frame count: only its packets tell).
    from tests.multimodal.clips import video

    clip = video("webm", "libvpx", frames=40_000, width=16, height=16, fps=1000)
    uri = "data:video/webm;base64," + base64.b64encode(clip).decode()
    return _clip_chat([{"type": "video_url", "video_url": {"url": uri}}])


def audio_duration_bomb(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/v1/chat/completions", _audio_duration_body(), timeout)


def audio_decode_bomb(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/v1/chat/completions", _audio_decode_body(), timeout)


def wav_scan_18mb(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/v1/chat/completions", _wav_scan_body(), timeout)


def wav_18mb(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/v1/chat/completions", _wav_18mb_body(), timeout)


def video_frame_flood(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/v1/chat/completions", _video_frames_body(), timeout)


def _connection_lifetime(gw: Gateway, timeout: float, send: Callable[[socket.socket], None]) -> str:
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.settimeout(0.5)
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            try:
                send(sock)
                data = sock.recv(4096)
                if not data:
                    return "closed"
                return f"answered {_status_of(data)}"
            except TimeoutError:
                continue
            except OSError:
                return "closed"
        return "still open"


def _status_of(data: bytes) -> str:
    parts = data.split(b" ", 2)
    return parts[1].decode() if len(parts) > 1 else "?"


def slowloris(gw: Gateway, timeout: float) -> Outcome:
    started = time.perf_counter()
    lines = iter([b"POST /v1/chat/completions HTTP/1.1\r\n", *[b"x-a: b\r\n"] * 10_000])
    last = [0.0]

    def send(sock: socket.socket) -> None:
        if time.monotonic() - last[0] >= 5:
            last[0] = time.monotonic()
            sock.sendall(next(lines))

    what = _connection_lifetime(gw, timeout, send)
    return Outcome(what, time.perf_counter() - started)


def slow_body(gw: Gateway, timeout: float) -> Outcome:
    started = time.perf_counter()
    body = _chat([{"role": "user", "content": "hi"}])
    state = {"sent": 0, "last": 0.0}

    def send(sock: socket.socket) -> None:
        sent = int(state["sent"])
        if sent == 0:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
            )
        if time.monotonic() - state["last"] >= 5 and sent < len(body) - 1:
            state["last"] = time.monotonic()
            sock.sendall(body[sent : sent + 1])
            state["sent"] = sent + 1

    what = _connection_lifetime(gw, timeout, send)
    return Outcome(what, time.perf_counter() - started)


def silent(gw: Gateway, timeout: float) -> Outcome:
    started = time.perf_counter()
    what = _connection_lifetime(gw, timeout, lambda sock: None)
    return Outcome(what, time.perf_counter() - started)


def fan_out(gw: Gateway, timeout: float) -> Outcome:
    body = orjson.dumps(
        {"model": MODEL, "prompt": [f"p{i}" for i in range(256)], "n": 128, "max_tokens": 16}
    )
    victim: list[float] = []

    def bystander() -> None:
        time.sleep(1.0)
        small = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4})
        victim.append(_post(gw, "/v1/completions", small, timeout).seconds)

    thread = threading.Thread(target=bystander)
    thread.start()
    outcome = _post(gw, "/v1/completions", body, timeout)
    thread.join()
    wait = f", bystander {victim[0]:.2f}s" if victim else ""
    return Outcome(outcome.what + wait, outcome.seconds)


def client_errors(gw: Gateway, timeout: float) -> Outcome:
    """The statuses of the 'never a 500' class, one request each."""
    started = time.perf_counter()
    deep = "[" * 900 + "]" * 900
    cases: list[tuple[str, bytes, dict[str, str]]] = [
        ("rank \\xb2", _chat([{"role": "user", "content": "hi"}]), {RANK: "\xb2"}),
        ("url [::1", _image_chat(["http://[::1"]), {}),
        ("url full-width", _image_chat(["http://\uff11\uff12\uff17.0.0.1/a.png"]), {}),
        ("url octal", _image_chat(["http://0177.0.0.01/a.png"]), {}),
        (
            "deep arguments",
            _chat(
                [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": deep}}],
                    },
                    {"role": "tool", "tool_call_id": "c", "content": "ok"},
                ]
            ),
            {},
        ),
        ("deep guided_json", _chat([{"role": "user", "content": "hi"}], guided_json=deep), {}),
        (
            "kv depth 34",
            orjson.dumps(
                {
                    "model": MODEL,
                    "prompt": "hi",
                    "max_tokens": 1,
                    "kv_transfer_params": orjson.loads("{" + '"a":{' * 33 + '"b":1' + "}" * 34),
                }
            ),
            {},
        ),
    ]
    statuses = []
    for name, body, headers in cases:
        path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
        statuses.append(f"{name}={_post(gw, path, body, timeout, **headers).what}")
    return Outcome(" ".join(statuses), time.perf_counter() - started)


@cache
def _tokenize_body() -> bytes:
    return orjson.dumps({"prompt": "lorem ipsum dolor " * (10 * MB // 18)})


def tokenize_10mb(gw: Gateway, timeout: float) -> Outcome:
    return _post(gw, "/tokenize", _tokenize_body(), timeout)


def connection_flood(gw: Gateway, timeout: float) -> Outcome:
    """Idle sockets past the connection cap (2048 per worker), then a fresh probe."""
    started = time.perf_counter()
    flood: list[socket.socket] = []
    try:
        flood.extend(socket.create_connection(("127.0.0.1", gw.port)) for _ in range(3000))
        time.sleep(1.5)  # past the grace that spares young connections
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=timeout)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        return Outcome(f"new /health {status}", time.perf_counter() - started)
    finally:
        for sock in flood:
            sock.close()


PREPARE: dict[str, Callable[[], bytes]] = {
    "kv_nested_30mb": _kv_nested_body,
    "message_10mb": _message_body,
    "tool_description_10mb": _tool_body,
    "reasoning_10mb": _reasoning_body,
    "images_over_budget": _images_body,
    "tokenize_10mb": _tokenize_body,
    "audio_duration_bomb": _audio_duration_body,
    "audio_decode_bomb": _audio_decode_body,
    "wav_scan_18mb": _wav_scan_body,
    "wav_18mb": _wav_18mb_body,
    "video_frame_flood": _video_frames_body,
}
# Connection cases wait past the longest default deadline (the 60 s body timeout).
LIFETIME_CASES = frozenset({"slowloris", "slow_body", "silent_connection"})
LIFETIME_TIMEOUT = 75.0

ATTACKS: dict[str, Callable[[Gateway, float], Outcome]] = {
    "depth_regex_60kb": depth_regex,
    "kv_nested_30mb": kv_nested_30mb,
    "message_10mb": message_10mb,
    "tool_description_10mb": tool_description_10mb,
    "reasoning_10mb": reasoning_10mb,
    "header_200mb": header_200mb,
    "gzip_gzip_bomb": gzip_bomb,
    "brotli_bomb": brotli_bomb,
    "images_over_budget": images_over_budget,
    "slowloris": slowloris,
    "slow_body": slow_body,
    "silent_connection": silent,
    "fan_out_256x128": fan_out,
    "client_errors": client_errors,
    "tokenize_10mb": tokenize_10mb,
    "connection_flood_3000": connection_flood,
    "audio_duration_bomb": audio_duration_bomb,
    "audio_decode_bomb": audio_decode_bomb,
    "wav_scan_18mb": wav_scan_18mb,
    "wav_18mb": wav_18mb,
    "video_frame_flood": video_frame_flood,
}


# ---- processes -------------------------------------------------------------------------------


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env.pop("RANKGATE_ENGINE", None)
    return env


@contextmanager
def mock_engine(tree: Path) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [
            PY, "-m", "rankgate.mocker", "--port", str(port), "--dp-size", "2", "--speed", "0",
            "--tokenizer", str(TOKENIZER), "--model", MODEL,
            "--model-id", "Qwen/Qwen2-VL-2B-Instruct", "--max-model-len", "4096",
            "--kv-events-port", str(free_port_range(2)), "--kv-events-host", "127.0.0.1",
            "--log-level", "warning",
        ],
        cwd=tree, env=_env(tree), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


@contextmanager
def gateway(tree: Path, engine: str, log: Path) -> Iterator[Gateway]:
    port = free_port()
    with log.open("ab") as out:
        process = subprocess.Popen(
            [
                PY, "-m", "rankgate.app.cli", "serve", "--engine", engine, "--port", str(port),
                "--tokenizer", str(TOKENIZER), "--log-level", "warning",
                "--image-allow-network", "127.0.0.0/8",
            ],
            cwd=tree, env=_env(tree), stdout=out, stderr=out,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"the gateway in {tree} exited; see {log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/ready")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise SystemExit(f"the gateway in {tree} did not get ready; see {log}")
        time.sleep(0.5)
        yield Gateway(url, port, process.pid, tree)
    finally:
        process.kill()
        process.wait()


@dataclass
class Row:
    case: str
    label: str
    outcome: str
    seconds: float
    health_ms: float
    rss_mb: float


def run_case(label: str, tree: Path, engine: str, name: str, timeout: float, log: Path) -> Row:
    attack = ATTACKS[name]
    if name in PREPARE:
        PREPARE[name]()
    if name in LIFETIME_CASES:
        timeout = max(timeout, LIFETIME_TIMEOUT)
    with gateway(tree, engine, log) as gw:
        result: list[Outcome] = []
        with health_probe(gw.url, pid=gw.pid, timeout=timeout + 10) as probe:
            worker = threading.Thread(target=lambda: result.append(attack(gw, timeout)))
            worker.start()
            worker.join(timeout + 30)
        outcome = result[0] if result else Outcome("no answer", timeout)
    return Row(
        name,
        label,
        outcome.what,
        outcome.seconds,
        probe.max_latency * 1000,
        probe.rss_growth / MB,
    )


def machine_conditions() -> str:
    load = os.getloadavg()
    return f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tree",
        action="append",
        metavar="LABEL=DIR",
        help="a source tree to run (repeatable; default: this one as 'this')",
    )
    parser.add_argument("--cases", help=f"comma-separated subset of: {', '.join(ATTACKS)}")
    parser.add_argument("--attack-timeout", type=float, default=40.0)
    parser.add_argument("--log", type=Path, default=Path("/tmp/rankgate-hostile-bench.log"))
    args = parser.parse_args()
    trees = [t.split("=", 1) for t in args.tree or [f"this={ROOT}"]]
    names = args.cases.split(",") if args.cases else list(ATTACKS)
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        raise SystemExit(f"unknown cases: {unknown}")
    if any("bomb" in name for name in names):
        _bombs()  # built before any gateway runs: compressing 512 MiB takes seconds
    print(f"machine: {machine_conditions()}", flush=True)
    rows: list[Row] = []
    for label, directory in trees:
        tree = Path(directory).resolve()
        with mock_engine(tree) as engine:
            for name in names:
                row = run_case(label, tree, engine, name, args.attack_timeout, args.log)
                rows.append(row)
                print(
                    f"  {row.case} [{row.label}]: {row.outcome} in {row.seconds:.2f}s, "
                    f"/health max {row.health_ms:.0f} ms, RSS +{row.rss_mb:.0f} MB",
                    flush=True,
                )
    print(f"\nmachine after: {machine_conditions()}")
    print("\n| case | tree | attacker gets | in s | longest /health ms | peak RSS growth MB |")
    print("|---|---|---|---:|---:|---:|")
    for name in names:
        for row in rows:
            if row.case == name:
                print(
                    f"| {row.case} | {row.label} | {row.outcome} | {row.seconds:.2f} | "
                    f"{row.health_ms:.0f} | {row.rss_mb:.0f} |"
                )


if __name__ == "__main__":
    main()
