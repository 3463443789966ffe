"""Run a real vLLM (CPU build, Rust gRPC frontend) for the duration of a test session.

Everything engine-specific lives in ``scripts/real-vllm`` so that developers can run the very
same server by hand; this module only drives that script: install (cached), pick ports, serve,
read the one JSON line that says the server is SERVING, and stop it afterwards.

Whether a missing engine is a skip or an error is the caller's environment's decision: CI sets
``RANKGATE_REQUIRE_REAL_VLLM=1`` so that a broken install can never pass as "skipped".
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "real-vllm"
REQUIRE_ENV = "RANKGATE_REQUIRE_REAL_VLLM"

# A cold install downloads and unpacks about 3.5 GB.
INSTALL_TIMEOUT_S = 1800.0
# Covers building the tiny model on first use plus the script's own 600 s startup deadline.
READY_TIMEOUT_S = 720.0
# The script allows vLLM 30 s to exit before it kills the process group.
STOP_TIMEOUT_S = 60.0
TAIL_LINES = 40


class RealVllmUnavailable(RuntimeError):
    """Real vLLM could not be installed or started although the environment requires it."""


@dataclass(frozen=True)
class RealVllm:
    target: str
    dp_size: int
    block_size: int
    served_model_name: str
    model_dir: Path
    kv_events_base_port: int
    kv_replay_base_port: int
    log_path: Path
    # vLLM's own HTTP server: Prometheus ``/metrics`` (the engine's prefix-cache counters)
    # and, when served with ``dev_endpoints``, ``/reset_prefix_cache``.
    http_url: str = ""
    max_model_len: int = 512


def real_vllm_required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def _unavailable(reason: str) -> NoReturn:
    if real_vllm_required():
        raise RealVllmUnavailable(f"{reason} ({REQUIRE_ENV}=1)")
    pytest.skip(f"real vLLM unavailable: {reason}")


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _reserve_ports(dp_size: int) -> tuple[int, int, int, int]:
    """Pick gRPC, HTTP, KV-event base and replay base ports that are free and pairwise disjoint.

    The candidate sockets stay bound until every port is chosen, so two picks can never land on
    the same port; they bind the wildcard address because vLLM's ZMQ publishers do.
    """
    held: list[socket.socket] = []

    def hold(port: int) -> bool:
        sock = socket.socket()
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            sock.close()
            return False
        held.append(sock)
        return True

    def single() -> int:
        sock = socket.socket()
        sock.bind(("0.0.0.0", 0))
        held.append(sock)
        return int(sock.getsockname()[1])

    def consecutive(count: int) -> int:
        for _ in range(200):
            base = single()
            if base + count > 65536:
                continue
            if all(hold(base + offset) for offset in range(1, count)):
                return base
        raise RuntimeError(f"no run of {count} free ports found")

    try:
        grpc_port, http_port = single(), single()
        return grpc_port, http_port, consecutive(dp_size), consecutive(dp_size)
    finally:
        for sock in held:
            sock.close()


def _install(workdir: Path) -> None:
    log_path = workdir / "install.log"
    started = time.monotonic()
    with log_path.open("wb") as log_file:
        try:
            result = subprocess.run(
                [sys.executable, str(SCRIPT), "install"],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                timeout=INSTALL_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            _unavailable(f"`real-vllm install` took over {INSTALL_TIMEOUT_S:.0f} s")
    if result.returncode != 0:
        _unavailable(
            f"`real-vllm install` failed after {time.monotonic() - started:.0f} s "
            f"(exit {result.returncode}):\n{_tail(log_path)}"
        )


def _read_endpoints(proc: subprocess.Popen[bytes], stderr_path: Path) -> dict[str, Any]:
    """Wait for the script's JSON line; anything else on stdout is not part of the protocol."""
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    buffered = b""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while (remaining := deadline - time.monotonic()) > 0:
            if not selector.select(timeout=min(remaining, 1.0)):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                proc.wait()
                _unavailable(
                    f"`real-vllm serve` exited with status {proc.returncode} before it was "
                    f"ready:\n{_tail(stderr_path)}"
                )
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                with contextlib.suppress(ValueError):
                    parsed = json.loads(line)
                    if isinstance(parsed, dict) and "grpc_target" in parsed:
                        return parsed
    _unavailable(
        f"`real-vllm serve` not ready within {READY_TIMEOUT_S:.0f} s:\n{_tail(stderr_path)}"
    )


def _stop(proc: subprocess.Popen[bytes], engine_pid: int | None) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        # The script could not finish its own cleanup; vLLM leads its own process group.
        if engine_pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(engine_pid, signal.SIGKILL)


def _close(stream: IO[bytes] | None) -> None:
    if stream is not None:
        stream.close()


@contextlib.contextmanager
def start_real_vllm(
    dp_size: int = 2,
    block_size: int = 32,
    *,
    max_model_len: int = 512,
    dev_endpoints: bool = False,
    nice: int = 0,
) -> Iterator[RealVllm]:
    """Serve real vLLM with KV events on for the ``with`` block; skip or fail if impossible.

    ``max_model_len`` past the tiny model's 512 serves a copy with more positions;
    ``dev_endpoints`` opens vLLM's development routes such as ``/reset_prefix_cache``;
    ``nice`` lowers vLLM's CPU priority (``scripts/real-vllm serve --nice``).
    """
    if not sys.platform.startswith("linux"):
        _unavailable(f"real vLLM CPU runs on Linux only, not {sys.platform}")
    with tempfile.TemporaryDirectory(prefix="rankgate-real-vllm-") as tmp:
        workdir = Path(tmp)
        _install(workdir)
        grpc_port, http_port, kv_port, replay_port = _reserve_ports(dp_size)
        stderr_path = workdir / "serve.stderr"
        argv = [
            sys.executable, str(SCRIPT), "serve",
            "--dp-size", str(dp_size),
            "--block-size", str(block_size),
            "--grpc-port", str(grpc_port),
            "--http-port", str(http_port),
            "--kv-events-port", str(kv_port),
            "--kv-replay-port", str(replay_port),
            "--max-model-len", str(max_model_len),
            "--exit-with-parent",
        ]  # fmt: skip
        if dev_endpoints:
            argv.append("--dev-endpoints")
        if nice:
            argv += ["--nice", str(nice)]
        with stderr_path.open("wb") as stderr_file:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr_file,
                start_new_session=True,
            )
        engine_pid: int | None = None
        try:
            endpoints = _read_endpoints(proc, stderr_path)
            engine_pid = int(endpoints["pid"])
            yield RealVllm(
                target=str(endpoints["grpc_target"]),
                dp_size=int(endpoints["dp_size"]),
                block_size=int(endpoints["block_size"]),
                served_model_name=str(endpoints["served_model_name"]),
                model_dir=Path(endpoints["model_dir"]),
                kv_events_base_port=int(endpoints["kv_events_base_port"]),
                kv_replay_base_port=int(endpoints["kv_replay_base_port"]),
                log_path=Path(endpoints["log_path"]),
                http_url=str(endpoints["http"]),
                max_model_len=int(endpoints.get("max_model_len", max_model_len)),
            )
        finally:
            _stop(proc, engine_pid)
            _close(proc.stdout)
