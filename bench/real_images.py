"""Images and disaggregated serving on real vLLM: image prefix hit rate and hand-off timings.

``--part images`` (the tiny LLaVA, DP=2, 64 tokens an image): a repeated-image workload, a
few conversations each about its own picture, every turn resending the picture and the
conversation so far, the conversations interleaved. It is sent through Rankgate ``kv``,
through Rankgate ``engine`` (no rank pinned: vLLM's own DP balancer picks) and straight to
vLLM's own HTTP server (its balancer; the images carry the same ids there, since the gateway's
id is vLLM's). Before each pass vLLM's prefix cache is reset; the hit rate is vLLM's own, the
difference of its ``prefix_cache_hits`` / ``prefix_cache_queries`` counters over the pass.

``--part handoff`` (a prefill/decode pair over NIXL on the CPU, DP=1 each): per request, the
prefill's unary ``Generate`` time, the decode's time to its first token (which includes the
KV pull) and to its end, straight over gRPC; then through the gateway, the client's time to
the first streamed chunk; and, for a client that leaves while its decode waits for an
admission slot, the time until the prefill side's KV is free again (``kv_cache_usage_perc``
back to 0; without the hand-off that is vLLM's 30 s lease).

The LLaVA runs on the fair placement (``tests/support/placement.py``): vLLM on the first CPU,
this process on the second. The pair puts each engine on a CPU of its own (on one shared core
their spinning workers starve each other's NIXL progress: seconds a hand-off). Run it under
the team's vLLM lock:

    flock /tmp/rankgate-vllm.lock scripts/in-netns .venv/bin/python bench/real_images.py
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.multimodal import MediaConfig, MediaPreparer
from rankgate.sidecar.admission import AdmissionConfig
from rankgate.sidecar.config import DisaggConfig
from rankgate.sidecar.convert import decode_transfer_params, encode_transfer_params
from rankgate.wire.proto.vllm import inference_pb2, inference_pb2_grpc
from tests.app.serving import serve_app
from tests.multimodal.pictures import encode, noise
from tests.support.placement import fair_placement, on_gateway_cpus
from tests.support.real_vllm import (
    RealVllm,
    RealVllmPair,
    start_real_vllm,
    start_real_vllm_pair,
)


def counters(server: RealVllm) -> dict[str, float]:
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"vllm:([a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if match:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
    return found


def image_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


Messages = list[dict[str, Any]]


def conversations(count: int, turns: int, seed: int) -> list[list[Messages]]:
    """Each conversation's requests (message lists), in its own order of turns."""
    rng = random.Random(seed)
    result = []
    for c in range(count):
        picture = image_url(encode(noise(120 + c, 90, seed=seed * 100 + c), "PNG"))
        history: list[dict[str, Any]] = []
        requests = []
        for turn in range(turns):
            question = f"conversation {c} turn {turn}: " + " ".join(
                f"q{rng.randrange(10_000)}" for _ in range(12)
            )
            content: list[dict[str, Any]] = [{"type": "text", "text": question}]
            if turn == 0:
                content.append({"type": "image_url", "image_url": {"url": picture}})
            history = [*history, {"role": "user", "content": content}]
            requests.append(list(history))
            history.append({"role": "assistant", "content": f"answer {c}.{turn}"})
        result.append(requests)
    return result


def interleaved(convs: list[list[Messages]]) -> list[Messages]:
    order: list[Messages] = []
    for turn in range(max(len(c) for c in convs)):
        order.extend(c[turn] for c in convs if turn < len(c))
    return order


def image_pass(
    base_url: str, model: str, convs: list[list[Messages]], concurrency: int
) -> list[float]:
    """Every conversation's turns in order; ``concurrency`` conversations at a time (1: the
    conversations' turns interleaved, one request at a time)."""
    if concurrency <= 1:
        return asyncio.run(_sequential(base_url, model, interleaved(convs)))
    return asyncio.run(_concurrent(base_url, model, convs, concurrency))


async def _ask(client: httpx.AsyncClient, model: str, messages: Messages) -> float:
    started = time.monotonic()
    response = await client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 2, "temperature": 0},
    )
    response.raise_for_status()
    return time.monotonic() - started


async def _sequential(base_url: str, model: str, requests: list[Messages]) -> list[float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        return [await _ask(client, model, messages) for messages in requests]


async def _concurrent(
    base_url: str, model: str, convs: list[list[Messages]], concurrency: int
) -> list[float]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def talk(turns: list[Messages]) -> list[float]:
            async with gate:
                return [await _ask(client, model, messages) for messages in turns]

        done = await asyncio.gather(*(talk(turns) for turns in convs))
    return [latency for turns in done for latency in turns]


@contextmanager
def gateway(settings: GatewaySettings) -> Iterator[str]:
    media = MediaPreparer(MediaConfig())
    with serve_app(create_app(settings, media=media)) as url:
        yield url


def run_images(args: argparse.Namespace) -> None:
    placement = fair_placement()
    convs = conversations(args.conversations, args.turns, seed=11)
    shape = (
        "interleaved, one request at a time"
        if args.concurrency <= 1
        else f"{args.concurrency} conversations at a time, each turn after the last"
    )
    print(
        f"repeated-image workload: {args.conversations} conversations x {args.turns} turns, "
        f"one 64-token image each ({args.conversations * args.turns} requests, {shape}); "
        f"placement: {placement.describe()}"
    )
    with start_real_vllm(
        dp_size=2, block_size=32, model="llava", dev_endpoints=True, cpus=placement.engine_cpus
    ) as server:
        targets = [("rankgate kv", "kv"), ("rankgate engine (vLLM balancer)", "engine")]
        rows = []
        with on_gateway_cpus(placement):
            for _ in range(args.rounds):
                for name, policy in [*targets, ("vLLM's own server", None)]:
                    httpx.post(f"{server.http_url}/reset_prefix_cache", timeout=30)
                    time.sleep(1.0)
                    before = counters(server)
                    if policy is None:
                        latencies = image_pass(
                            server.http_url, server.served_model_name, convs, args.concurrency
                        )
                    else:
                        settings = GatewaySettings(
                            engine=server.target,
                            tokenizer=str(server.model_dir),
                            policy=policy,
                            startup_timeout=180.0,
                        )
                        with gateway(settings) as url:
                            latencies = image_pass(
                                url, server.served_model_name, convs, args.concurrency
                            )
                    after = counters(server)
                    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
                    queries = (
                        after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
                    )
                    rows.append((name, hits, queries, statistics.mean(latencies)))
        print(f"{'target':<34} {'vLLM hit rate':>13} {'hit tokens':>11} {'mean latency':>13}")
        for name in dict.fromkeys(row[0] for row in rows):
            mine = [row for row in rows if row[0] == name]
            hits = sum(row[1] for row in mine)
            queries = sum(row[2] for row in mine)
            latency = statistics.mean(row[3] for row in mine)
            print(f"{name:<34} {hits / queries:>12.1%} {hits:>11.0f} {latency * 1000:>10.0f} ms")


def prefill_request(rid: str, ids: list[int]) -> Any:
    request = inference_pb2.GenerateRequest(
        request_id=rid,
        token_ids=inference_pb2.TokenIds(ids=ids),
        temperature=0.0,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=1, min_new_tokens=1),
    )
    request.kv.kv_transfer_params.update({"do_remote_decode": True})
    return request


def run_handoff(args: argparse.Namespace) -> None:
    placement = fair_placement()
    rng = random.Random(5)
    cpus = sorted(os.sched_getaffinity(0))
    print(
        f"prefill/decode pair over NIXL (kv_buffer_device cpu, DP=1 each), {args.prompt}-token "
        f"prompts, {args.tokens} output tokens; prefill engine on CPU {cpus[0]}, decode engine "
        f"on CPU {cpus[-1]}, gateway and client on CPU {placement.gateway or cpus[-1]}"
    )
    # Each engine on a core of its own: two engines sharing one core starve each other's
    # NIXL progress while their CPU workers spin after each step (seconds per hand-off).
    cpus = sorted(os.sched_getaffinity(0))
    prefill_cpu, decode_cpu = str(cpus[0]), str(cpus[-1])
    with start_real_vllm_pair(block_size=32, cpus=prefill_cpu, decode_cpus=decode_cpu) as pair:
        print(f"the harness's first hand-off (NIXL handshake): {pair.first_hand_off_s:.1f} s")
        prefill_ms, first_ms, total_ms = [], [], []
        with (
            grpc.insecure_channel(pair.prefill.target) as p_channel,
            grpc.insecure_channel(pair.decode.target) as d_channel,
        ):
            prefill = inference_pb2_grpc.InferenceStub(p_channel)  # type: ignore[no-untyped-call]
            decode = inference_pb2_grpc.InferenceStub(d_channel)  # type: ignore[no-untyped-call]
            for i in range(args.requests + 1):
                ids = [rng.randrange(10, 3000) for _ in range(args.prompt)]
                started = time.monotonic()
                reply = prefill.Generate(prefill_request(f"h{i}", ids), timeout=120)
                prefilled = time.monotonic()
                params = decode_transfer_params(reply.outputs.finish_info.kv_transfer_params)
                request = inference_pb2.GenerateRequest(
                    request_id=f"h{i}d",
                    token_ids=inference_pb2.TokenIds(ids=ids),
                    temperature=0.0,
                    stopping=inference_pb2.StoppingCriteria(max_new_tokens=args.tokens),
                )
                encode_transfer_params(request.kv.kv_transfer_params, params)
                first = None
                for message in decode.GenerateStream(request, timeout=120):
                    if first is None and message.outputs.token_ids:
                        first = time.monotonic()
                done = time.monotonic()
                if i == 0:
                    continue  # a warm-up: the first request on fresh prompt shapes
                prefill_ms.append((prefilled - started) * 1e3)
                first_ms.append(((first or done) - prefilled) * 1e3)
                total_ms.append((done - prefilled) * 1e3)
        print(f"over gRPC, {args.requests} requests after the first (median / p90):")
        for name, values in (
            ("prefill (unary Generate)", prefill_ms),
            ("decode: time to first token (with the KV pull)", first_ms),
            (f"decode: all {args.tokens} tokens", total_ms),
        ):
            ordered = sorted(values)
            p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
            print(f"  {name:<48} {statistics.median(values):>7.0f} ms {p90:>7.0f} ms")
        with on_gateway_cpus(placement):
            asyncio.run(gateway_handoff(pair, args))


async def until(condition: Any, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {within} s")
        await asyncio.sleep(0.02)


async def gateway_handoff(pair: RealVllmPair, args: argparse.Namespace) -> None:
    model = pair.decode.served_model_name
    settings = GatewaySettings(
        prefill_engine=pair.prefill.target,
        decode_engine=pair.decode.target,
        tokenizer=str(pair.decode.model_dir),
        startup_timeout=180.0,
        admission=AdmissionConfig(per_rank=1),
        disagg=DisaggConfig(prefill_mode="remote"),
    )
    rng = random.Random(9)

    def words(count: int) -> str:
        return " ".join(f"x{rng.randrange(100_000)}" for _ in range(count))

    ttft = []
    with gateway(settings) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for _ in range(args.requests):
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": words(args.prompt // 5)}],
                    "max_tokens": args.tokens,
                    "temperature": 0,
                    "stream": True,
                }
                started = time.monotonic()
                first = None
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if first is None and '"content"' in line:
                            first = time.monotonic()
                if first is not None:
                    ttft.append((first - started) * 1e3)
            print(
                f"through the gateway: client TTFT median {statistics.median(ttft):.0f} ms "
                f"over {len(ttft)} streamed requests (prefill + hand-off + first decode step)"
            )
            # A client that leaves while its decode waits for the one admission slot.
            blocker_body = {
                "model": model,
                "messages": [{"role": "user", "content": words(20)}],
                "max_tokens": 1500,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }

            async def block() -> None:
                async with client.stream("POST", "/v1/chat/completions", json=blocker_body) as r:
                    async for _ in r.aiter_lines():
                        pass

            blocker = asyncio.ensure_future(block())
            await until(lambda: counters(pair.decode).get("num_requests_running", 0) >= 1)
            served = counters(pair.prefill).get("request_success_total", 0)

            async def waiter() -> None:
                body = {**blocker_body, "max_tokens": 8, "messages": [
                    {"role": "user", "content": words(40)}]}  # fmt: skip
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            waiting = asyncio.ensure_future(waiter())
            await until(lambda: counters(pair.prefill).get("request_success_total", 0) > served)
            left = time.monotonic()
            waiting.cancel()
            await until(lambda: counters(pair.prefill).get("kv_cache_usage_perc", 1.0) == 0)
            freed = time.monotonic() - left
            blocker.cancel()
            await asyncio.gather(blocker, waiting, return_exceptions=True)
    print(
        f"client left while its decode waited for an admission slot: prefill KV free after "
        f"{freed * 1e3:.0f} ms (vLLM's lease would hold it 30 s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("images", "handoff", "all"), default="all")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=6,
        help="conversations in flight at once (1: interleaved turns, one request at a time; "
        "vLLM's balancer then sends everything to rank 0)",
    )
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("RANKGATE_REQUIRE_REAL_VLLM", "1")
    if args.part in ("images", "all"):
        run_images(args)
    if args.part in ("handoff", "all"):
        run_handoff(args)


if __name__ == "__main__":
    main()
