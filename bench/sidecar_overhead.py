"""What does the sidecar cost per request and per token, above a bare gRPC client?

Part 1 times the conversions alone: encoding a PreparedRequest into GenerateRequests and
decoding one streamed token into a Delta. Part 2 streams the same workload from a mock engine
(child process, DP=2, zero latency, pinned to its own core) twice: once with raw generated
stubs (the floor any Python client pays) and once through ``Sidecar.generate`` with the
``round_robin`` router pinning ranks; it reports this process's CPU time per request.

    .venv/bin/python bench/sidecar_overhead.py [--requests 2000] [--concurrency 32] [--tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import socket
import time
from typing import Any

import grpc

from rankgate.mocker.config import MockEngineConfig
from rankgate.sidecar.config import SidecarConfig
from rankgate.sidecar.convert import DeltaDecoder, RequestEncoder
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.policies import build_router
from rankgate.sidecar.types import OutputOptions, PreparedRequest, SamplingParams, StoppingParams
from rankgate.wire.proto.vllm import inference_pb2, inference_pb2_grpc


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _prepared(i: int, tokens: int, logprobs: int | None = None) -> PreparedRequest:
    return PreparedRequest(
        request_id=f"bench-{i}",
        prompt_token_ids=tuple(range(300, 556)),
        sampling=SamplingParams(temperature=0.7, top_p=0.9),
        stopping=StoppingParams(max_tokens=tokens, ignore_eos=True),
        output=OutputOptions(logprobs=logprobs),
    )


def _best_us(fn: Any, items: list[Any], repeats: int = 5) -> float:
    """Best-of-``repeats`` CPU microseconds per item: the figure least disturbed by neighbours."""
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for item in items:
            fn(item)
        best = min(best, time.process_time() - started)
    return best / len(items) * 1e6


def bench_conversion(rounds: int) -> None:
    encoder = RequestEncoder("model")
    encode_us = _best_us(encoder.encode, [_prepared(i, 16) for i in range(rounds)])
    fanout_us = _best_us(
        encoder.encode,
        [
            PreparedRequest(
                request_id=f"n-{i}",
                prompt_token_ids=tuple(range(300, 556)),
                sampling=SamplingParams(temperature=0.7, seed=i),
                stopping=StoppingParams(max_tokens=16),
                n=4,
            )
            for i in range(rounds // 4)
        ],
    )

    token = inference_pb2.GenerateResponse(
        outputs=inference_pb2.SequenceOutput(text=" word", token_ids=[1234])
    )
    decode_us = _best_us(DeltaDecoder(0, want_logprobs=False).feed, [token] * rounds)
    top = inference_pb2.CandidateTokenInfo(
        tokens=[
            inference_pb2.CandidateTokenInfo.TokenInfo(id=i, logprob=-i, rank=i) for i in range(5)
        ]
    )
    with_logprobs = inference_pb2.GenerateResponse(
        outputs=inference_pb2.SequenceOutput(
            text=" word", token_ids=[1234], logprobs=[-0.1], ranks=[1], candidate_tokens=[top]
        )
    )
    logprob_us = _best_us(DeltaDecoder(0, want_logprobs=True).feed, [with_logprobs] * rounds)

    print("conversion (CPU time, best of 5)")
    print(f"  {'encode PreparedRequest (256-token prompt)':<48} {encode_us:8.2f} us/request")
    print(f"  {'encode the same with n=4 (four requests)':<48} {fanout_us:8.2f} us/request")
    print(f"  {'decode one token':<48} {decode_us:8.2f} us/token")
    print(f"  {'decode one token with top-5 logprobs':<48} {logprob_us:8.2f} us/token")


def _serve(config: MockEngineConfig, core: int, ready: Any, stop: Any) -> None:
    if hasattr(os, "sched_setaffinity") and core >= 0:
        os.sched_setaffinity(0, {core})
    from rankgate.mocker.server import MockServer

    async def main() -> None:
        server = MockServer(config)
        await server.start()
        ready.set()
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop()

    asyncio.run(main())


async def _raw(target: str, requests: int, concurrency: int, tokens: int) -> float:
    channel = grpc.aio.insecure_channel(target)
    stub: Any = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
    queue = iter(range(requests))

    async def worker() -> None:
        for i in queue:
            message = inference_pb2.GenerateRequest(
                request_id=f"raw-{i}",
                model="mock-llm",
                token_ids=inference_pb2.TokenIds(ids=range(300, 556)),
                temperature=0.7,
                stopping=inference_pb2.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
                response=inference_pb2.ResponseOptions(output_text=True, output_token_ids=True),
            )
            metadata = (("x-data-parallel-rank", str(i % 2)),)
            async for _ in stub.GenerateStream(message, metadata=metadata):
                pass

    cpu = _cpu()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    spent = _cpu() - cpu
    await channel.close()
    return spent


async def _sidecar(target: str, requests: int, concurrency: int, tokens: int) -> float:
    sidecar = Sidecar(
        SidecarConfig(endpoint=target), build_router(RoutingConfig(policy="round_robin"))
    )
    await sidecar.start()
    queue = iter(range(requests))

    async def worker() -> None:
        for i in queue:
            async for _ in sidecar.generate(_prepared(i, tokens)):
                pass

    cpu = _cpu()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    spent = _cpu() - cpu
    await sidecar.close()
    return spent


async def _both(target: str, requests: int, concurrency: int, tokens: int) -> tuple[float, float]:
    await _raw(target, 200, concurrency, tokens)  # warm up both paths
    await _sidecar(target, 200, concurrency, tokens)
    raw = await _raw(target, requests, concurrency, tokens)
    side = await _sidecar(target, requests, concurrency, tokens)
    return raw, side


def bench_streaming(requests: int, concurrency: int, tokens: int) -> None:
    port = _free_port()
    config = MockEngineConfig(
        host="127.0.0.1", port=port, dp_size=2, model="mock-llm", speed=0.0, block_size=16
    )
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    engine_core = cores[-1] if len(cores) > 1 else -1
    if len(cores) > 1 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cores[0]})
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_serve, args=(config, engine_core, ready, stop), daemon=True)
    child.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("mock engine did not start")
        target = f"127.0.0.1:{port}"
        # One loop for everything: grpc.aio binds its poller to the first loop it sees.
        raw, side = asyncio.run(_both(target, requests, concurrency, tokens))
    finally:
        stop.set()
        child.join(10)
    print(
        f"streaming {requests} requests x {tokens} tokens, {concurrency} concurrent, "
        "client CPU time (engine on its own core)"
    )
    print(f"  {'raw generated stubs':<32} {raw / requests * 1e6:9.1f} us/request")
    print(f"  {'Sidecar.generate (round_robin)':<32} {side / requests * 1e6:9.1f} us/request")
    print(f"  {'sidecar overhead':<32} {(side - raw) / requests * 1e6:9.1f} us/request "
          f"({(side - raw) / (requests * tokens) * 1e6:.2f} us/token)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20000)
    args = parser.parse_args()
    bench_conversion(args.rounds)
    bench_streaming(args.requests, args.concurrency, args.tokens)


if __name__ == "__main__":
    main()
