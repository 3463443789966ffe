"""Client-side TTFT and inter-token latency on real vLLM, Rankgate against its peers.

One real vLLM 0.32 server (CPU build, DP=2, tiny model) serves every target in turn:

- Rankgate with each policy (``kv``, ``load``, ``round_robin``, ``engine``);
- vllm-router 0.1.17 with ``round_robin`` and ``kv_aware``;
- Dynamo 1.6.1's frontend and vLLM sidecar with its KV router (when its venv exists:
  ``--install-dynamo`` builds it);
- vLLM's own HTTP server (its frontend and its DP balancer, no gateway in front);
- a control: vllm-router ``round_robin`` with a process burning half a CPU beside it.

Everything runs under the fair placement of ``tests/support/placement.py``: vLLM (every DP
engine) on the first CPU, the gateways, this client and the control's hog on the second. vLLM's
CPU workers spin for a second after each step, so on shared cores the client's TTFT measures
who gets the CPU, not the gateway; ``--placement shared`` shows that.

Each target streams short chat completions (distinct prompts, ``max_tokens`` tokens, EOS
ignored) sequentially and then from 8, 16 and 32 concurrent clients in a closed loop. **TTFT**
is from sending the request to the first content chunk; **ITL** is a request's time from its
first to its last content chunk over the tokens in between (so a gateway that merges tokens
into fewer chunks is neither rewarded nor punished); **bursts** counts the streams whose first
content chunk came in the second half of the stream, the symptom of a stalled gateway or
client. Beside them, the gateway's CPU per request and how busy each of the two CPUs was.
Targets run ``--rounds`` times, interleaved (every other round backwards), and pool their
samples.

    flock /tmp/rankgate-vllm.lock scripts/in-netns .venv/bin/python bench/peers_latency.py \
        [--markdown] [--rounds 2] [--concurrency 1 8 16 32]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import httpx
import msgspec
import peers

sys.path.insert(0, str(peers.ROOT))

from tests.support.placement import SHARED, Placement, fair_placement

RANKGATE_POLICIES = ("kv", "load", "round_robin", "engine")
# Real vLLM on busy cores can take over a second to answer a health check; the default 1 s
# probe deadline would then take the engine out of service for a moment (503s).
RANKGATE_FLAGS = ("--health-interval", "5")
CONTROL = "control: vllm-router round_robin + hog"
VLLM_OWN = "vLLM's own server"
# A busy loop on for this share of every period: half a CPU, in slices short enough that the
# scheduler sees a steady demand rather than bursts.
HOG = (
    "import time\n"
    "while True:\n"
    "    end = time.perf_counter() + 0.005\n"
    "    while time.perf_counter() < end:\n"
    "        pass\n"
    "    time.sleep(0.005)\n"
)


@dataclasses.dataclass
class Sample:
    ttft: float
    itl: float | None
    burst: bool


@dataclasses.dataclass
class Cell:
    """One target at one concurrency: pooled samples, wall time, CPU spent."""

    target: str
    concurrency: int
    samples: list[Sample] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    gateway_cpu: float | None = 0.0
    busy: list[float] = dataclasses.field(default_factory=list)
    cpu_seconds: list[float] = dataclasses.field(default_factory=list)
    errors: int = 0

    def absorb(self, other: Cell) -> None:
        self.samples += other.samples
        self.seconds += other.seconds
        if self.gateway_cpu is None or other.gateway_cpu is None:
            self.gateway_cpu = None
        else:
            self.gateway_cpu += other.gateway_cpu
        if self.busy and other.busy:
            self.busy = [a + b for a, b in zip(self.busy, other.busy, strict=True)]
        else:
            self.busy = self.busy or other.busy
        self.errors += other.errors

    def median_ttft(self) -> float:
        return statistics.median(s.ttft for s in self.samples)

    def row(self) -> list[str]:
        if not self.samples:
            return [self.target, _level(self.concurrency), "0", *[""] * (len(HEAD) - 3)]
        ttfts = sorted(s.ttft for s in self.samples)
        itls = [s.itl for s in self.samples if s.itl is not None]
        count = len(self.samples)
        cpu = (
            "n/a"
            if self.gateway_cpu is None
            else f"{self.gateway_cpu / (count + self.errors) * 1e3:.1f}"
        )
        busy = " / ".join(f"{b / self.seconds:.0%}" for b in self.busy) if self.seconds else ""
        return [
            self.target,
            _level(self.concurrency),
            str(count) + (f" ({self.errors} failed)" if self.errors else ""),
            f"{statistics.median(ttfts) * 1e3:.0f}",
            f"{_quantile(ttfts, 0.9) * 1e3:.0f}",
            f"{statistics.median(itls) * 1e3:.1f}" if itls else "n/a",
            f"{sum(s.burst for s in self.samples)}/{count}",
            f"{count / self.seconds:.1f}",
            cpu,
            busy,
        ]


HEAD = [
    "target", "clients", "requests", "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms/token",
    "bursts", "req/s", "gateway CPU ms/req", "CPU busy (vLLM / gateway+client)",
]  # fmt: skip


def _level(concurrency: int) -> str:
    return "sequential" if concurrency == 1 else str(concurrency)


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class CpuTimes:
    """Busy seconds per CPU from ``/proc/stat`` (everything but idle and iowait)."""

    def __init__(self, cpus: Sequence[int]) -> None:
        self.cpus = list(cpus)

    def read(self) -> list[float]:
        ticks = os.sysconf("SC_CLK_TCK")
        found: dict[int, float] = {}
        with open("/proc/stat") as stat:
            for line in stat:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                cpu = int(name[3:])
                if cpu in self.cpus:
                    values = [int(v) for v in fields]
                    found[cpu] = (sum(values[:8]) - values[3] - values[4]) / ticks
        return [found.get(cpu, 0.0) for cpu in self.cpus]


class ChunkDelta(msgspec.Struct):
    content: str | None = None


class ChunkChoice(msgspec.Struct):
    delta: ChunkDelta | None = None


class ChunkUsage(msgspec.Struct):
    completion_tokens: int = 0


class ChunkEvent(msgspec.Struct):
    """The parts of a streamed chat chunk this client reads; the rest is skipped unparsed."""

    choices: list[ChunkChoice] = []
    usage: ChunkUsage | None = None


DECODER = msgspec.json.Decoder(ChunkEvent)


async def one_stream(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = last = 0.0
    chunks = tokens = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code} {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = DECODER.decode(line[6:])
            if event.usage is not None and event.usage.completion_tokens:
                tokens = event.usage.completion_tokens
            if any(c.delta is not None and c.delta.content for c in event.choices):
                last = time.perf_counter() - started
                first = first or last
                chunks += 1
    if not chunks:
        raise RuntimeError("no content chunk")
    tokens = tokens or chunks
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    return Sample(ttft=first, itl=itl, burst=first > last / 2)


async def closed_loop(
    gateway: peers.Gateway,
    model: str,
    concurrency: int,
    requests: int,
    tag: str,
    max_tokens: int,
    cpu_times: CpuTimes,
) -> Cell:
    cell = Cell(gateway.name, concurrency)
    prompts = [
        f"{tag} request {i}: describe the harbour at dawn, the boats, the gulls and the light."
        for i in range(requests)
    ]
    queue = list(reversed(prompts))
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(
        base_url=gateway.url, headers=gateway.headers, timeout=120.0, limits=limits
    ) as http:

        async def worker() -> None:
            while queue:
                prompt = queue.pop()
                try:
                    cell.samples.append(await one_stream(http, model, prompt, max_tokens))
                except (httpx.HTTPError, RuntimeError) as exc:
                    cell.errors += 1
                    if cell.errors <= 3:
                        print(f"  {gateway.name}: {exc!r}", flush=True)

        cpu_before = gateway.cpu_seconds() if gateway.pids else None
        busy_before = cpu_times.read()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cell.seconds = time.perf_counter() - started
        busy_after = cpu_times.read()
        cell.busy = [b - a for a, b in zip(busy_before, busy_after, strict=True)]
        cell.gateway_cpu = None if cpu_before is None else gateway.cpu_seconds() - cpu_before
    return cell


Starter = Callable[[ExitStack, peers.Engine], peers.Gateway]


def start_hog(stack: ExitStack) -> None:
    """Half a CPU of extra demand, on this process's CPUs (the gateway's, when placed)."""
    peers.launch(stack, [sys.executable, "-c", HOG], "hog")


def starters(args: argparse.Namespace, work: Path, vllm_http: str) -> dict[str, Starter]:
    found: dict[str, Starter] = {}
    for policy in args.policy:
        found[f"rankgate {policy}"] = functools.partial(
            peers.start_rankgate, policy=policy, extra=RANKGATE_FLAGS
        )
    for policy in ("round_robin", "kv_aware"):
        found[f"vllm-router {policy}"] = functools.partial(peers.start_vllm_router, policy=policy)
    found["dynamo kv"] = lambda s, e: peers.start_dynamo(s, e, work, "kv")
    found[VLLM_OWN] = lambda s, e: peers.Gateway(VLLM_OWN, vllm_http, [])

    def control(stack: ExitStack, engine: peers.Engine) -> peers.Gateway:
        start_hog(stack)
        gateway = peers.start_vllm_router(stack, engine, "round_robin")
        return dataclasses.replace(gateway, name=CONTROL)

    found[CONTROL] = control
    return {name: start for name, start in found.items() if name in args.targets}


def requests_at(concurrency: int, args: argparse.Namespace) -> int:
    return int(args.sequential) if concurrency == 1 else concurrency * args.per_client


async def measure_target(
    name: str,
    start: Starter,
    engine: peers.Engine,
    args: argparse.Namespace,
    round_: int,
    cpu_times: CpuTimes,
) -> list[Cell]:
    with ExitStack() as stack:
        gateway = dataclasses.replace(start(stack, engine), name=name)
        # Unrecorded: the first streams through a fresh gateway pay for its lazy start-up.
        await closed_loop(gateway, engine.model, 4, 8, f"warm {name} {round_}", 4, cpu_times)
        cells = []
        for level in args.concurrency:
            tag = f"{name} round {round_} clients {level}"
            cell = await closed_loop(
                gateway, engine.model, level, requests_at(level, args), tag, args.max_tokens,
                cpu_times,
            )  # fmt: skip
            print(f"round {round_ + 1}: " + "  ".join(cell.row()), flush=True)
            cells.append(cell)
    return cells


def render(rows: list[list[str]], title: str, notes: list[str], markdown: bool) -> str:
    lines = [title, ""]
    if markdown:
        lines.append("| " + " | ".join(HEAD) + " |")
        lines.append("|" + "---|" * len(HEAD))
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        widths = [max(len(r[i]) for r in [HEAD, *rows]) for i in range(len(HEAD))]
        lines.append("  ".join(h.ljust(w) for h, w in zip(HEAD, widths, strict=True)))
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([*lines, "", *notes])


def comparisons(pooled: dict[tuple[str, int], Cell], levels: Sequence[int]) -> list[str]:
    """Rankgate's median TTFT over vllm-router's under the same policy, per concurrency."""
    notes = []
    for ours, theirs in (("rankgate round_robin", "vllm-router round_robin"),
                         ("rankgate kv", "vllm-router kv_aware")):  # fmt: skip
        ratios = []
        for level in levels:
            a, b = pooled.get((ours, level)), pooled.get((theirs, level))
            if a and b and a.samples and b.samples:
                ratios.append(f"{_level(level)} {a.median_ttft() / b.median_ttft():.2f}x")
        if ratios:
            notes.append(f"median TTFT, {ours} / {theirs}: " + ", ".join(ratios))
    return notes


async def main_async(args: argparse.Namespace, placement: Placement, work: Path) -> str:
    from tests.support.real_vllm import start_real_vllm

    cpus = [*placement.engine, *placement.gateway] or sorted(os.sched_getaffinity(0))[:2]
    cpu_times = CpuTimes(cpus)
    with start_real_vllm(
        dp_size=2, block_size=32, max_model_len=args.max_model_len, cpus=placement.engine_cpus
    ) as server:
        engine = peers.Engine(
            server.target, server.dp_size, server.block_size, server.served_model_name,
            peers.model_dir(work, server.model_dir), server.kv_events_base_port,
        )  # fmt: skip
        targets = starters(args, work, server.http_url)
        # A fresh server's first streams are slow (CPU kernels warming up for new shapes).
        own = peers.Gateway(VLLM_OWN, server.http_url, [])
        for level in sorted({4, *args.concurrency}):
            await closed_loop(own, engine.model, level, level * 2, "warm-up", 8, cpu_times)
        pooled: dict[tuple[str, int], Cell] = {}
        failed: dict[str, str] = {}
        names = list(targets)
        for round_ in range(args.rounds):
            for name in names[::-1] if round_ % 2 else names:
                if name in failed:
                    continue
                try:
                    cells = await measure_target(
                        name, targets[name], engine, args, round_, cpu_times
                    )
                except peers.Unavailable as exc:
                    failed[name] = f"not run: {exc}"
                    print(f"{name}: {failed[name]}", flush=True)
                    continue
                for cell in cells:
                    key = (name, cell.concurrency)
                    if key in pooled:
                        pooled[key].absorb(cell)
                    else:
                        pooled[key] = cell
    rows = []
    for name in names:
        if name in failed:
            rows.append([name, "", failed[name], *[""] * (len(HEAD) - 3)])
            continue
        rows += [pooled[(name, level)].row() for level in args.concurrency]
    title = (
        f"Client TTFT and ITL, real vLLM 0.32 CPU (DP=2, tiny model), {placement.describe()}; "
        f"streamed chat completions of {args.max_tokens} tokens, {args.sequential} sequential "
        f"then {args.per_client} per client in a closed loop; {args.rounds} interleaved rounds "
        f"per target, pooled; {peers.machine()}"
    )
    return render(rows, title, comparisons(pooled, args.concurrency), args.markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    every = [
        *(f"rankgate {p}" for p in RANKGATE_POLICIES),
        "vllm-router round_robin", "vllm-router kv_aware", "dynamo kv", VLLM_OWN, CONTROL,
    ]  # fmt: skip
    parser.add_argument("--targets", nargs="+", default=every, choices=every, metavar="TARGET")
    parser.add_argument("--policy", nargs="+", default=list(RANKGATE_POLICIES))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 16, 32])
    parser.add_argument("--sequential", type=int, default=12, help="requests at concurrency 1")
    parser.add_argument("--per-client", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved passes per target")
    parser.add_argument(
        "--placement",
        choices=["fair", "shared"],
        default="fair",
        help="fair: vLLM on the first CPU, gateways and client on the second; shared: unpinned",
    )
    parser.add_argument(
        "--install-dynamo", action="store_true", help=f"first create {peers.DYNAMO_VENV}"
    )
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    args.targets = [
        t for t in args.targets if not t.startswith("rankgate ") or t.split()[1] in args.policy
    ]
    if args.install_dynamo:
        peers.install_dynamo()
    placement = fair_placement() if args.placement == "fair" else SHARED
    if args.placement == "fair" and not placement.pinned:
        raise SystemExit("the fair placement needs two CPUs")
    if placement.pinned:
        # Before anything starts: every gateway, the hog and this client inherit the mask;
        # scripts/real-vllm moves vLLM to its own CPU.
        os.sched_setaffinity(0, placement.gateway)
    with tempfile.TemporaryDirectory(prefix="rankgate-latency-") as tmp:
        table = asyncio.run(main_async(args, placement, Path(tmp)))
    print()
    print(table)


if __name__ == "__main__":
    main()
