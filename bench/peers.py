"""Start gateways in front of one vLLM gRPC engine on loopback, for the peer benchmarks.

Rankgate (``rankgate serve``), ``vllm-router`` 0.1.17 in gRPC mode, and Dynamo 1.6.1's HTTP
frontend with its vLLM sidecar (from a separate venv: ``scripts`` never install it into
``.venv``). Every process is a child of the benchmark, logs to ``/tmp/rankgate-peers-*.log``
and is stopped when the benchmark's ``ExitStack`` closes. CPU time is read from ``/proc``
for each gateway's processes and their descendants.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.ports import free_port, free_port_range  # noqa: E402

TINY_TOKENIZER = ROOT / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
DYNAMO_VENV = Path(
    os.environ.get("RANKGATE_DYNAMO_VENV", Path.home() / ".cache" / "rankgate" / "dynamo")
)
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
API_KEY = "bench"
TICKS = os.sysconf("SC_CLK_TCK")
LOOPBACK_ENV = {
    # Dynamo without etcd/NATS, and every socket it opens on loopback.
    "DYN_DISCOVERY_BACKEND": "file",
    "DYN_REQUEST_PLANE": "tcp",
    "DYN_EVENT_PLANE": "zmq",
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_SYSTEM_HOST": "127.0.0.1",
    "DYN_LOG": "warn",
}


class Unavailable(RuntimeError):
    """A peer cannot run here; the message says why, for the results table."""


def table(head: Sequence[str], rows: Sequence[Sequence[str]], title: str, markdown: bool) -> str:
    """``rows`` under ``head`` after ``title``: a Markdown table, or aligned plain columns."""
    if markdown:
        lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def machine() -> str:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{when}, {platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu})"


def model_dir(work: Path, tokenizer: Path = TINY_TOKENIZER) -> Path:
    """Tokenizer files plus the ``config.json`` that vllm-router and Dynamo read."""
    target = work / "model"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, target / name)
    if not (tokenizer / "config.json").exists():
        vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
        config = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "max_position_embeddings": 8192,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
        }
        (target / "config.json").write_text(json.dumps(config))
    else:
        shutil.copy(tokenizer / "config.json", target / "config.json")
    return target


@dataclass
class Engine:
    target: str
    dp_size: int
    block_size: int
    model: str
    model_dir: Path
    kv_events_port: int | None
    pids: list[int] = field(default_factory=list)

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(pid) for pid in _tree(self.pids))

    @property
    def kv_endpoints(self) -> list[str]:
        assert self.kv_events_port is not None
        return [f"tcp://127.0.0.1:{self.kv_events_port + r}" for r in range(self.dp_size)]


@dataclass
class Gateway:
    name: str
    url: str
    pids: list[int]
    headers: dict[str, str] = field(default_factory=dict)

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(pid) for pid in _tree(self.pids))

    def settle(self, quiet: float = 0.01, timeout: float = 30.0) -> None:
        """Wait until the gateway's start-up work in the background (checks, caches built
        once) is done: under ``quiet`` CPU seconds in half a second. A CPU reading that
        began earlier would charge it to the first requests."""
        deadline = time.monotonic() + timeout
        before = self.cpu_seconds()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.cpu_seconds()
            if now - before < quiet:
                return
            before = now


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def _tree(pids: Sequence[int]) -> list[int]:
    seen: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except (FileNotFoundError, ProcessLookupError):
                continue
    return seen


def launch(
    stack: ExitStack,
    argv: list[str],
    name: str,
    env: dict[str, str] | None = None,
    cpus: str | None = None,
    cwd: Path = ROOT,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a child of the bench, in ``cwd``; ``cpus`` (a taskset list) pins it
    and every thread and process it starts."""
    log_path = Path(f"/tmp/rankgate-peers-{name}.log")
    log = log_path.open("wb")
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **(env or {})}
    )

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()

    stack.callback(stop)
    return proc


def wait_http(
    url: str,
    procs: Sequence[subprocess.Popen[bytes]],
    ready: str,
    timeout: float = 90,
    poll: float = 0.25,
) -> None:
    """Until GET ``ready`` answers 200 (for ``/v1/models``: with a model listed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise Unavailable(
                    f"process {proc.pid} exited with {proc.returncode} "
                    "(logs: /tmp/rankgate-peers-*.log)"
                )
        try:
            response = httpx.get(url + ready, timeout=2, headers={"authorization": "Bearer x"})
            if response.status_code == 200 and (
                ready != "/v1/models" or response.json().get("data")
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise Unavailable(f"not ready at {url}{ready} within {timeout:.0f} s")


def start_mock_engine(
    stack: ExitStack,
    work: Path,
    *,
    dp_size: int = 2,
    speed: float = 0.0,
    block_size: int = 16,
    model: str = "bench-model",
    tokenizer: Path = TINY_TOKENIZER,
    paced_step_seconds: float = 0.0,
    cpus: str | None = None,
    max_model_len: int = 8192,
    kv_blocks: int = 8192,
) -> Engine:
    mdir = model_dir(work, tokenizer)
    port, kv, replay = free_port(), free_port_range(dp_size), free_port_range(dp_size)
    argv = [
        sys.executable, "-m", "rankgate.mocker", "--port", str(port), "--dp-size", str(dp_size),
        "--speed", str(speed), "--model", model, "--model-id", str(mdir),
        "--tokenizer", str(mdir), "--block-size", str(block_size),
        "--max-model-len", str(max_model_len), "--total-kv-blocks", str(kv_blocks),
        "--eos-probability", "0",
        "--kv-events-port", str(kv), "--kv-replay-port", str(replay), "--log-level", "warning",
        "--paced-step-seconds", str(paced_step_seconds),
    ]  # fmt: skip
    proc = launch(stack, argv, "mock-engine", cpus=cpus)
    _wait_grpc(f"127.0.0.1:{port}", proc)
    return Engine(f"127.0.0.1:{port}", dp_size, block_size, model, mdir, kv, [proc.pid])


NODE_ENGINE = ROOT / "bench" / "node_engine.mjs"


def start_node_engine(
    stack: ExitStack,
    work: Path,
    *,
    dp_size: int = 2,
    block_size: int = 16,
    model: str = "bench-model",
    tokenizer: Path = TINY_TOKENIZER,
    paced_step_seconds: float = 0.0,
    cpus: str | None = None,
    max_model_len: int = 8192,
) -> Engine:
    """The fake engine in Node (``bench/node_engine.mjs``): the same gRPC services as the mock,
    from another runtime and HTTP/2 stack. It answers every prompt with copies of one token,
    chosen here so its text is what the tokenizer decodes it to; it publishes no KV events
    (its sources name silent endpoints), so every gateway routes on what else it knows."""
    node = shutil.which("node")
    if node is None:
        raise Unavailable("node is not installed")
    from tokenizers import Tokenizer

    mdir = model_dir(work, tokenizer)
    vocab = Tokenizer.from_file(str(mdir / "tokenizer.json"))
    token = vocab.encode(" the", add_special_tokens=False).ids[-1]
    port, kv = free_port(), free_port_range(dp_size)
    argv = [
        node, str(NODE_ENGINE), "--port", str(port), "--dp-size", str(dp_size),
        "--model", model, "--model-id", str(mdir), "--token-id", str(token),
        "--token-text", vocab.decode([token]), "--step-ms", str(paced_step_seconds * 1e3),
        "--kv-events-port", str(kv), "--block-size", str(block_size),
        "--max-model-len", str(max_model_len),
    ]  # fmt: skip
    proc = launch(stack, argv, "node-engine", cpus=cpus)
    _wait_grpc(f"127.0.0.1:{port}", proc)
    return Engine(f"127.0.0.1:{port}", dp_size, block_size, model, mdir, kv, [proc.pid])


def _wait_grpc(target: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    # Short reconnect backoff: grpc's default grows past the whole deadline while a slow
    # machine is still starting the engine.
    options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the engine exited with {proc.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise RuntimeError("the engine did not become healthy")


def start_rankgate(
    stack: ExitStack,
    engine: Engine,
    policy: str = "kv",
    extra: Sequence[str] = (),
    cpus: str | None = None,
    poll: float = 0.25,
    tree: Path | None = None,
    python: str = sys.executable,
) -> Gateway:
    """``tree``: a source tree to serve from instead of this one (``python -m`` puts its
    working directory first on the path, so the tree is where it runs); ``python``: the
    interpreter, which must have Rankgate's dependencies installed."""
    port = free_port()
    argv = [
        python, "-m", "rankgate.app.cli", "serve", "--engine", engine.target,
        "--port", str(port), "--tokenizer", str(engine.model_dir), "--policy", policy,
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    env = None if tree is None else {"PYTHONPATH": str(tree)}
    proc = launch(stack, argv, f"rankgate-{policy}", env, cpus, tree or ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url, [proc], "/ready", poll=poll)
    return Gateway(f"rankgate --policy {policy}", url, [proc.pid])


def start_vllm_router(
    stack: ExitStack, engine: Engine, policy: str = "kv_aware", cpus: str | None = None
) -> Gateway:
    if not Path(ROUTER).exists():
        raise Unavailable("vllm-router is not installed (pip install -e '.[peers]')")
    port = free_port()
    worker = f"grpc://{engine.target}"
    argv = [
        ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", worker,
        "--intra-node-data-parallel-size", str(engine.dp_size), "--policy", policy,
        "--api-key", API_KEY, "--prometheus-port", str(free_port()), "--log-level", "warning",
    ]  # fmt: skip
    if policy == "kv_aware":
        argv += [
            "--kv-event-source", f"{worker}={','.join(engine.kv_endpoints)}",
            "--kv-event-block-size", str(engine.block_size),
            "--kv-event-model", engine.model,
        ]  # fmt: skip
    proc = launch(
        stack,
        argv,
        f"vllm-router-{policy}",
        {"VLLM_ROUTER_TOKENIZER": str(engine.model_dir)},
        cpus,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url, [proc], "/health")
    # /health turns 200 before the workers are discovered; a request proves the path.
    _first_chat(url, engine.model, {"authorization": f"Bearer {API_KEY}"}, [proc])
    return Gateway(f"vllm-router {policy}", url, [proc.pid], {"authorization": f"Bearer {API_KEY}"})


def dynamo_python() -> Path:
    python = DYNAMO_VENV / "bin" / "python"
    if not python.exists():
        raise Unavailable(
            f"no Dynamo venv at {DYNAMO_VENV}: python3 -m venv it, pip install "
            "ai-dynamo-runtime==1.6.1 and its dependencies, then ai-dynamo==1.6.1 --no-deps"
        )
    return python


# ai-dynamo's own requirements less ``aisimulate`` (only on NVIDIA's index; the frontend and
# the vLLM sidecar never import it), which is why ai-dynamo itself goes in with --no-deps.
DYNAMO_RUNTIME = "ai-dynamo-runtime==1.6.1"
DYNAMO = "ai-dynamo==1.6.1"
DYNAMO_DEPS = (
    "aiohttp", "certifi", "kubernetes", "msgspec", "prometheus-client", "pyzmq", "redis",
    "tqdm", "transformers", "typing-extensions", "zstandard",
)  # fmt: skip


def install_dynamo(venv: Path = DYNAMO_VENV) -> Path:
    """Create Dynamo's venv (never inside ``.venv``) unless it already imports both modules."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import dynamo.frontend, dynamo.vllm.sidecar"]
    if python.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return python
    print(f"installing Dynamo 1.6.1 into {venv} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, DYNAMO_RUNTIME, *DYNAMO_DEPS], check=True)
    subprocess.run([*pip, "--no-deps", DYNAMO], check=True)
    subprocess.run(probe, check=True)
    return python


def start_dynamo(
    stack: ExitStack, engine: Engine, work: Path, router: str = "kv", cpus: str | None = None
) -> Gateway:
    """Dynamo's vLLM sidecar (a worker for the engine's gRPC port) and its HTTP frontend,
    discovering each other through a file store, with Dynamo's own KV router."""
    python = str(dynamo_python())
    # A fresh store per start: a second start must not find the first one's registrations.
    store = Path(tempfile.mkdtemp(prefix=f"dynamo-store-{router}-", dir=work))
    env = {**LOOPBACK_ENV, "DYN_FILE_KV": str(store)}
    sidecar = launch(
        stack,
        [python, "-m", "dynamo.vllm.sidecar", "--grpc-endpoint", engine.target],
        f"dynamo-sidecar-{router}",
        env,
        cpus,
    )
    port = free_port()
    frontend = launch(
        stack,
        [
            python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
            str(port), "--router-mode", router, "--kv-cache-block-size", str(engine.block_size),
        ],
        f"dynamo-frontend-{router}",
        env,
        cpus,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(url, [sidecar, frontend], "/v1/models", timeout=120)
    _first_chat(url, engine.model, {}, [sidecar, frontend])
    return Gateway(f"dynamo frontend+sidecar ({router})", url, [frontend.pid, sidecar.pid])


def _first_chat(
    url: str, model: str, headers: dict[str, str], procs: Sequence[subprocess.Popen[bytes]]
) -> None:
    deadline = time.monotonic() + 30
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    last = ""
    while time.monotonic() < deadline:
        try:
            reply = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
            if reply.status_code == 200:
                return
            last = f"{reply.status_code} {reply.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    raise Unavailable(f"no chat completion through {url}: {last}")
