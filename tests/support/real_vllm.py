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
import re
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

import httpx
import pytest

from tests.support.ports import candidate_port

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
# vLLM's NIXL KV lease (``kv_lease_duration``), which the pair is served with, and the line its
# prefill worker logs when one ends ("... for request <id>-<8 hex> which were retrieved by ...").
KV_LEASE_S = 30.0
LEASE_ENDED = "Releasing expired KV blocks for request "


def _lease_ended(request_id: str) -> re.Pattern[str]:
    return re.compile(
        re.escape(f"{LEASE_ENDED}{request_id}") + r"-[0-9a-f]{8} which were retrieved by (\d+) "
    )


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
    # "llama" (text) or "llava" (images: 64 tokens each, placeholder ``<image>``).
    model: str = "llama"
    # One side of a prefill/decode pair: "producer" or "consumer" (NIXL on the CPU).
    kv_role: str | None = None
    # The ``vllm serve`` process, which leads a session of its own, and the CPUs that every
    # thread of that session runs on once it serves (empty: unconfined).
    pid: int = 0
    cpus: tuple[int, ...] = ()

    def blocks_free(self, timeout: float = 30.0) -> bool:
        """Whether vLLM's block pool holds no request's KV, in the engine's own word.

        ``POST /reset_prefix_cache`` succeeds only when no block is in use (by a running
        request, or by a finished prefill's KV waiting for its decode), and then empties the
        prefix cache. It reads the pool at once; the ``kv_cache_usage_perc`` gauge follows the
        engine's stats to ``/metrics`` late, and in fresh-clone CI runs it never read a waiting
        prefill's KV as held. Needs the engine served with ``dev_endpoints``."""
        response = httpx.post(f"{self.http_url}/reset_prefix_cache", timeout=timeout)
        response.raise_for_status()
        return bool(response.json()["success"])

    def lease_reads(self, request_id: str) -> list[int]:
        """For each KV lease the prefill side ended on ``request_id``, how many decodes had read
        that KV, as the engine logged it."""
        text = self.log_path.read_text(errors="replace")
        return [int(found[1]) for found in _lease_ended(request_id).finditer(text)]


@dataclass(frozen=True)
class RealVllmPair:
    """A prefill engine and a decode engine joined by NIXL (``scripts/real-vllm serve-pair``)."""

    prefill: RealVllm
    decode: RealVllm
    # The harness's own first hand-off (it makes the NIXL handshake before any test does).
    first_hand_off_s: float = 0.0


def real_vllm_required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def _unavailable(reason: str) -> NoReturn:
    if real_vllm_required():
        raise RealVllmUnavailable(f"{reason} ({REQUIRE_ENV}=1)")
    pytest.skip(f"real vLLM unavailable: {reason}")


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _reserve_ports(dp_size: int) -> tuple[int, int, int, int]:
    """Pick gRPC, HTTP, KV-event base and replay base ports that are free and pairwise disjoint.

    The candidate sockets stay bound until every port is chosen, so two picks can never land on
    the same port; they bind the wildcard address because vLLM's ZMQ publishers do. The picks
    come from below the kernel's ephemeral range (``tests.support.ports``): a port ``bind(0)``
    gave out may become the source port of any outgoing connection before vLLM binds it, tens
    of seconds later (a P/D pair's KV-event publisher failed so, "address already in use").
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
        for _ in range(1_000):
            port = candidate_port()
            if hold(port):
                return port
        raise RuntimeError("no free port below the ephemeral range")

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
            f"(exit {result.returncode}):\n{tail(log_path)}"
        )


def _read_endpoints(
    proc: subprocess.Popen[bytes], stderr_path: Path, key: str = "grpc_target"
) -> dict[str, Any]:
    """Wait for the script's JSON line (an object with ``key``); anything else on stdout is
    not part of the protocol."""
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
                    f"ready:\n{tail(stderr_path)}"
                )
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                with contextlib.suppress(ValueError):
                    parsed = json.loads(line)
                    if isinstance(parsed, dict) and key in parsed:
                        return parsed
    _unavailable(
        f"`real-vllm serve` not ready within {READY_TIMEOUT_S:.0f} s:\n{tail(stderr_path)}"
    )


def _stop(proc: subprocess.Popen[bytes], engine_pids: list[int]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        # The script could not finish its own cleanup; each vLLM leads its own process group.
        for pid in engine_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _close(stream: IO[bytes] | None) -> None:
    if stream is not None:
        stream.close()


def _engine(endpoints: dict[str, Any]) -> RealVllm:
    return RealVllm(
        target=str(endpoints["grpc_target"]),
        dp_size=int(endpoints["dp_size"]),
        block_size=int(endpoints["block_size"]),
        served_model_name=str(endpoints["served_model_name"]),
        model_dir=Path(endpoints["model_dir"]),
        kv_events_base_port=int(endpoints["kv_events_base_port"]),
        kv_replay_base_port=int(endpoints["kv_replay_base_port"]),
        log_path=Path(endpoints["log_path"]),
        http_url=str(endpoints["http"]),
        max_model_len=int(endpoints["max_model_len"]),
        model=str(endpoints.get("model", "llama")),
        kv_role=endpoints.get("kv_role"),
        pid=int(endpoints["pid"]),
        cpus=tuple(endpoints.get("cpus") or ()),
    )


def _engine_options(
    model: str, block_size: int, max_model_len: int | None, dev_endpoints: bool, nice: int,
    cpus: str | None, eager: bool,
) -> list[str]:  # fmt: skip
    argv = ["--model", model, "--block-size", str(block_size), "--exit-with-parent"]
    if eager:
        argv.append("--eager")
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if dev_endpoints:
        argv.append("--dev-endpoints")
    if nice:
        argv += ["--nice", str(nice)]
    if cpus:
        argv += ["--cpus", cpus]
    return argv


@contextlib.contextmanager
def _serving(argv: list[str], key: str) -> Iterator[dict[str, Any]]:
    """Run ``scripts/real-vllm`` with ``argv`` until the ``with`` block ends; its JSON line."""
    if not sys.platform.startswith("linux"):
        _unavailable(f"real vLLM CPU runs on Linux only, not {sys.platform}")
    with tempfile.TemporaryDirectory(prefix="rankgate-real-vllm-") as tmp:
        workdir = Path(tmp)
        _install(workdir)
        stderr_path = workdir / "serve.stderr"
        with stderr_path.open("wb") as stderr_file:
            proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr_file,
                start_new_session=True,
            )
        engine_pids: list[int] = []
        try:
            endpoints = _read_endpoints(proc, stderr_path, key)
            sides = [endpoints] if "pid" in endpoints else list(endpoints.values())
            engine_pids = [int(side["pid"]) for side in sides]
            yield endpoints
        finally:
            _stop(proc, engine_pids)
            _close(proc.stdout)


@contextlib.contextmanager
def start_real_vllm(
    dp_size: int = 2,
    block_size: int = 32,
    *,
    model: str = "llama",
    max_model_len: int | None = None,
    dev_endpoints: bool = False,
    nice: int = 0,
    cpus: str | None = None,
    eager: bool = False,
    kv_blocks: int | None = None,
) -> Iterator[RealVllm]:
    """Serve real vLLM with KV events on for the ``with`` block; skip or fail if impossible.

    ``model`` is the tiny "llama" or the tiny "llava" (images); ``max_model_len`` past the
    model's own serves a copy with more positions; ``dev_endpoints`` opens vLLM's development
    routes such as ``/reset_prefix_cache``; ``nice`` lowers vLLM's CPU priority and ``cpus``
    keeps it on those cores (``scripts/real-vllm serve --nice/--cpus``); ``eager`` skips
    torch.compile, half a minute of start-up, for tests that do not measure the engine;
    ``kv_blocks`` sizes each rank's KV cache (``--kv-blocks``).
    """
    grpc_port, http_port, kv_port, replay_port = _reserve_ports(dp_size)
    argv = [
        "serve", "--dp-size", str(dp_size),
        "--grpc-port", str(grpc_port), "--http-port", str(http_port),
        "--kv-events-port", str(kv_port), "--kv-replay-port", str(replay_port),
        *_engine_options(model, block_size, max_model_len, dev_endpoints, nice, cpus, eager),
    ]  # fmt: skip
    if kv_blocks is not None:
        argv += ["--kv-blocks", str(kv_blocks)]
    with _serving(argv, "grpc_target") as endpoints:
        yield _engine(endpoints)


@contextlib.contextmanager
def start_real_vllm_pair(
    block_size: int = 32,
    *,
    model: str = "llava",
    max_model_len: int | None = None,
    dev_endpoints: bool = False,
    nice: int = 0,
    cpus: str | None = None,
    eager: bool = False,
    decode_cpus: str | None = None,
    kv_lease: int | None = None,
) -> Iterator[RealVllmPair]:
    """Serve a prefill engine and a decode engine (DP=1 each, KV events on, NIXL between them
    over loopback) for the ``with`` block; skip or fail if impossible."""
    argv = ["serve-pair", "--dp-size", "1"]
    for side in ("", "decode-"):
        grpc_port, http_port, kv_port, replay_port = _reserve_ports(1)
        argv += [
            f"--{side}grpc-port", str(grpc_port), f"--{side}http-port", str(http_port),
            f"--{side}kv-events-port", str(kv_port), f"--{side}kv-replay-port", str(replay_port),
            f"--{side}nixl-port", str(_reserve_ports(1)[0]),
        ]  # fmt: skip
    argv += _engine_options(model, block_size, max_model_len, dev_endpoints, nice, cpus, eager)
    if decode_cpus:
        argv += ["--decode-cpus", decode_cpus]
    if kv_lease is not None:
        argv += ["--kv-lease", str(kv_lease)]
    with _serving(argv, "prefill") as endpoints:
        prefill, decode = _engine(endpoints["prefill"]), _engine(endpoints["decode"])
        took = _first_hand_off(prefill, decode)
        yield RealVllmPair(prefill=prefill, decode=decode, first_hand_off_s=round(took, 2))


def _first_hand_off(prefill_side: RealVllm, decode_side: RealVllm) -> float:
    """One prefill and its decode, before any test: the first hand-off between two engines
    makes the NIXL handshake, which can take a whole KV lease (30 s); tests and benches should
    measure hand-offs, not that. Retried while a starved frontend is slow to accept (both
    engines may share one core); if it never succeeds, the tests will say what is wrong.
    Returns its seconds, or -1 when it did not succeed."""
    import grpc

    from rankgate.wire.proto.vllm import inference_pb2, inference_pb2_grpc

    started = time.monotonic()
    ids = list(range(400, 440))
    for attempt in range(4):
        prefill = inference_pb2.GenerateRequest(
            request_id=f"harness-warm-{os.getpid()}-{attempt}",
            token_ids=inference_pb2.TokenIds(ids=ids),
            temperature=0.0,
            stopping=inference_pb2.StoppingCriteria(max_new_tokens=1, min_new_tokens=1),
        )
        prefill.kv.kv_transfer_params.update({"do_remote_decode": True})
        try:
            with (
                grpc.insecure_channel(prefill_side.target) as p_channel,
                grpc.insecure_channel(decode_side.target) as d_channel,
            ):
                p_stub = inference_pb2_grpc.InferenceStub(p_channel)  # type: ignore[no-untyped-call]
                d_stub = inference_pb2_grpc.InferenceStub(d_channel)  # type: ignore[no-untyped-call]
                reply = p_stub.Generate(prefill, timeout=120, wait_for_ready=True)
                decode = inference_pb2.GenerateRequest(
                    request_id=f"{prefill.request_id}-d",
                    token_ids=inference_pb2.TokenIds(ids=ids),
                    temperature=0.0,
                    stopping=inference_pb2.StoppingCriteria(max_new_tokens=1),
                )
                decode.kv.kv_transfer_params.CopyFrom(reply.outputs.finish_info.kv_transfer_params)
                d_stub.Generate(decode, timeout=120, wait_for_ready=True)
            return time.monotonic() - started
        except grpc.RpcError as error:
            print(f"[real-vllm harness] warm-up hand-off failed: {error}", file=sys.stderr)
    return -1.0
