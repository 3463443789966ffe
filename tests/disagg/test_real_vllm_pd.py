"""Disaggregated serving through the gateway on a real prefill/decode pair over NIXL.

The tiny LLaVA on two vLLM servers (DP=1 each, ``kv_buffer_device: cpu``): the decode side
must load the whole prompt from the prefill side (``external_prefix_cache_hits`` = prompt),
streamed and not, with ``n`` > 1 and with an image, and a client that hangs up in any of the
four windows must leave nothing running on either engine and the prefill side's blocks freed
at once, not when vLLM's 30 s KV lease expires (its log says "Releasing expired KV blocks").
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from rankgate.multimodal import MediaConfig, MediaPreparer
from rankgate.sidecar import DisaggConfig
from rankgate.sidecar.admission import AdmissionConfig
from tests.app.serving import serve_app
from tests.multimodal.pictures import encode, noise
from tests.support.metrics import metric_total
from tests.support.polling import wait_until, wait_until_or_not
from tests.support.real_vllm import KV_LEASE_S, LEASE_ENDED, RealVllm, RealVllmPair
from tests.support.stalls import RERUN_ON_STALLS, answered_in_time, judge_lease_wait

SEEDED = "rankgate_pd_first_token_seeded_total"
PREFILLS = "rankgate_pd_prefills_total"

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600), RERUN_ON_STALLS]

# vLLM's counters are read again this long after a read until two agree.
SETTLE_S = 1.5
IMAGE_TOKENS = 64
# Hang-ups that miss the window they are meant for are not judged; this many may be tried.
WINDOW_ATTEMPTS = 3
_words = itertools.count()


def unique_text(words: int = 40) -> str:
    start = next(_words) * 10_000
    return " ".join(f"v{start + i}" for i in range(words))


def metrics(server: RealVllm) -> dict[str, float]:
    """vLLM's gauges and counters that matter here, summed over its engines."""
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    wanted = (
        "num_requests_running",
        "num_requests_waiting",
        "external_prefix_cache_hits_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
    )
    found = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        for name in wanted:
            if line.startswith(f"vllm:{name}{{") or line.startswith(f"vllm:{name} "):
                found[name] += float(line.rsplit(" ", 1)[1])
    return found


def expired_lines(server: RealVllm) -> int:
    return len(expiries(server))


def expiries(server: RealVllm) -> list[str]:
    """vLLM's lines of leases that ended, each naming its request."""
    return [
        line
        for line in server.log_path.read_text(errors="replace").splitlines()
        if LEASE_ENDED in line
    ]


def body(model: str, text: str, *images: bytes, **fields: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    content += [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(i).decode()},
        }
        for i in images
    ]
    payload: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    }
    payload.update(fields)
    return payload


def idle(server: RealVllm) -> bool:
    found = metrics(server)
    return found["num_requests_running"] == 0 and found["num_requests_waiting"] == 0


def assert_settled(pd: RealVllmPair, expired_before: int) -> float:
    """Nothing runs on either side and the prefill side holds no KV, soon (not at lease end).
    Returns the seconds until the prefill side's blocks were free.

    KV still held after 10 s is waited for to the lease's end, for the engines' word on it:
    see :func:`tests.support.stalls.judge_lease_wait`."""
    started = time.monotonic()
    with answered_in_time("settling"):
        wait_until(lambda: idle(pd.prefill) and idle(pd.decode), 10.0, "both engines idle")
        if wait_until_or_not(pd.prefill.blocks_free, 10.0):
            freed = time.monotonic() - started
            late = expiries(pd.prefill)[expired_before:]
            if not late:
                return freed
        else:
            wait_until(pd.prefill.blocks_free, KV_LEASE_S + 10.0, "prefill KV freed by its lease")
            late = expiries(pd.prefill)[expired_before:]
    raise judge_lease_wait(pd, late, time.monotonic() - started)


def settled_metrics(server: RealVllm) -> dict[str, float]:
    """:func:`metrics` once they have stopped moving. vLLM's frontend counts a finished request's
    tokens late: a second after a test's last request, 16 of its tokens were still missing."""
    with answered_in_time("reading the engine's counters"):
        last = metrics(server)
        deadline = time.monotonic() + 20.0
        while True:
            time.sleep(SETTLE_S)
            now = metrics(server)
            if now == last or time.monotonic() > deadline:
                return now
            last = now


# The tests' prompts are short, which the per-request choice would prefill on the decode
# engine; the hand-off is what they check, so they pin remote prefills, and without seeding:
# the windows they hang up in are counted in the decode's tokens as the client sees them.
REMOTE_PREFILLS = DisaggConfig(prefill_mode="remote", seed_first_token=False)


def gateway_for(pd: RealVllmPair, **settings: Any) -> Any:
    config = GatewaySettings(
        prefill_engine=pd.prefill.target,
        decode_engine=pd.decode.target,
        tokenizer=str(pd.decode.model_dir),
        startup_timeout=180.0,
        **{"disagg": REMOTE_PREFILLS, **settings},
    )
    return serve_app(create_app(config, media=MediaPreparer(MediaConfig())))


@pytest.fixture(scope="module")
def gateway(real_pd: RealVllmPair) -> Iterator[httpx.Client]:
    with gateway_for(real_pd) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


def post(client: httpx.Client, payload: dict[str, Any]) -> httpx.Response:
    response = client.post("/v1/chat/completions", json=payload)
    assert response.status_code == 200, response.text
    return response


def sse_text(response: httpx.Response) -> tuple[str, dict[str, Any] | None]:
    import orjson

    text, usage = "", None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = orjson.loads(line[6:])
        for choice in chunk.get("choices", ()):
            text += choice.get("delta", {}).get("content") or ""
        usage = chunk.get("usage") or usage
    return text, usage


def test_the_decode_side_loads_the_whole_prompt_streamed_and_not(
    gateway: httpx.Client, real_pd: RealVllmPair
) -> None:
    model = real_pd.decode.served_model_name
    text = unique_text()
    expired = expired_lines(real_pd.prefill)
    before = settled_metrics(real_pd.decode)
    whole = post(gateway, body(model, text)).json()
    prompt = whole["usage"]["prompt_tokens"]
    after = settled_metrics(real_pd.decode)
    assert (
        after["external_prefix_cache_hits_total"] - before["external_prefix_cache_hits_total"]
        == prompt
    )
    assert_settled(real_pd, expired)

    payload = body(model, text, stream=True, stream_options={"include_usage": True})
    streamed = post(gateway, payload)
    streamed_text, usage = sse_text(streamed)
    assert usage is not None
    assert usage["prompt_tokens"] == prompt
    assert streamed_text == whole["choices"][0]["message"]["content"]  # greedy, same prompt
    assert_settled(real_pd, expired)


def test_n_choices_each_run_their_own_prefill_and_decode(
    gateway: httpx.Client, real_pd: RealVllmPair
) -> None:
    model = real_pd.decode.served_model_name
    expired = expired_lines(real_pd.prefill)
    before = settled_metrics(real_pd.decode)
    answer = post(gateway, body(model, unique_text(), n=2, temperature=0.8, seed=7)).json()
    assert sorted(choice["index"] for choice in answer["choices"]) == [0, 1]
    hits = settled_metrics(real_pd.decode)["external_prefix_cache_hits_total"]
    # Both decodes pulled the prompt; the second may find the first's blocks cached locally.
    assert hits - before["external_prefix_cache_hits_total"] >= answer["usage"]["prompt_tokens"]
    assert_settled(real_pd, expired)


def test_prompt_logprobs_are_prefilled_on_the_decode_engine(
    gateway: httpx.Client, real_pd: RealVllmPair
) -> None:
    """vLLM's transfer moves KV, not logprobs: the decode engine prefills the request itself,
    and the prefill engine never sees it."""
    model = real_pd.decode.served_model_name
    prefill_before = settled_metrics(real_pd.prefill)
    decode_before = settled_metrics(real_pd.decode)
    answer = post(gateway, body(model, unique_text(), prompt_logprobs=1)).json()
    prompt = answer["usage"]["prompt_tokens"]
    entries = answer["prompt_logprobs"]
    assert len(entries) == prompt
    assert entries[0] is None
    assert all(1 <= len(entry) <= 2 for entry in entries[1:])
    prefill_after = settled_metrics(real_pd.prefill)
    decode_after = settled_metrics(real_pd.decode)
    assert prefill_after["prompt_tokens_total"] == prefill_before["prompt_tokens_total"]
    assert decode_after["prompt_tokens_total"] - decode_before["prompt_tokens_total"] == prompt
    assert (
        decode_after["external_prefix_cache_hits_total"]
        == decode_before["external_prefix_cache_hits_total"]
    )


def test_an_image_request_is_prefilled_and_decoded_on_separate_engines(
    gateway: httpx.Client, real_pd: RealVllmPair
) -> None:
    model = real_pd.decode.served_model_name
    text = unique_text()
    expired = expired_lines(real_pd.prefill)
    before = settled_metrics(real_pd.decode)
    picture = encode(noise(120, 90, seed=301), "PNG")
    answer = post(gateway, body(model, text, picture)).json()
    prompt = answer["usage"]["prompt_tokens"]
    hits = settled_metrics(real_pd.decode)["external_prefix_cache_hits_total"]
    # Everything the decode side computed was pulled over NIXL, the image's 64 tokens too.
    assert hits - before["external_prefix_cache_hits_total"] == prompt
    assert_settled(real_pd, expired)
    text_only = post(gateway, body(model, text)).json()["usage"]["prompt_tokens"]
    assert prompt == text_only + IMAGE_TOKENS


async def hang_up_when(
    url: str, payload: dict[str, Any], condition: Callable[[list[str]], bool]
) -> list[str]:
    """Stream ``payload`` and drop the connection once ``condition(lines so far)`` holds."""
    lines, left = await hang_up_if_in_time(url, payload, condition)
    assert left, f"the request ended before the client could hang up: {lines[-3:]}"
    return lines


async def hang_up_if_in_time(
    url: str, payload: dict[str, Any], condition: Callable[[list[str]], bool]
) -> tuple[list[str], bool]:
    """As :func:`hang_up_when`: the lines read, and whether the client hung up (False when
    the request ended before ``condition`` held)."""
    lines: list[str] = []

    async def talk() -> None:
        async with (
            httpx.AsyncClient(base_url=url, timeout=120) as client,
            client.stream("POST", "/v1/chat/completions", json=payload) as response,
        ):
            async for line in response.aiter_lines():
                lines.append(line)  # noqa: PERF401 (read while the stream runs)

    task = asyncio.ensure_future(talk())
    # Checked on a thread of its own: the condition reads the engines, and the loop streams.
    await asyncio.to_thread(
        wait_until, lambda: condition(lines) or task.done(), 120, "the hang-up condition"
    )
    if task.done():
        task.result()
        return lines, False
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return lines, True


async def read_all(url: str, payload: dict[str, Any]) -> None:
    async with (
        httpx.AsyncClient(base_url=url, timeout=300) as client,
        client.stream("POST", "/v1/chat/completions", json=payload) as response,
    ):
        async for _ in response.aiter_lines():
            pass


def content_lines(lines: list[str]) -> int:
    return sum(1 for line in lines if line.startswith("data: ") and '"content"' in line)


def arrived(server: RealVllm, request_id: str) -> bool:
    """Whether vLLM's frontend has logged the arrival of (a choice of) ``request_id``."""
    return any(
        f"request_id={request_id}" in line and "request received" in line
        for line in server.log_path.read_text(errors="replace").splitlines()
    )


async def test_hang_up_during_the_prefill(gateway: httpx.Client, real_pd: RealVllmPair) -> None:
    model = real_pd.decode.served_model_name
    url = str(gateway.base_url)
    # A prompt near the context's end prefills for a second or more on one core; the client
    # leaves as soon as the prefill engine has it. On a fast run the whole request can end
    # before the engine's arrival line is read: then a fresh request tries again.
    for _ in range(3):
        expired = expired_lines(real_pd.prefill)
        decode_before = settled_metrics(real_pd.decode)["generation_tokens_total"]
        rid = f"prefill-window-{time.monotonic_ns()}"
        payload = body(model, unique_text(400), stream=True, max_tokens=20, request_id=rid)

        def at_the_prefill(_: list[str], rid: str = rid) -> bool:
            return arrived(real_pd.prefill, rid)

        _, left = await hang_up_if_in_time(url, payload, at_the_prefill)
        if left:
            break
    else:
        pytest.fail("every request ended before the client could hang up")
    assert_settled(real_pd, expired)
    # No decode was served for it: at most one token, when the prefill had finished before its
    # abort landed and the decode side read its KV to free it.
    assert settled_metrics(real_pd.decode)["generation_tokens_total"] - decode_before <= 1


async def test_hang_up_while_the_decode_waits_for_a_slot(real_pd: RealVllmPair) -> None:
    """The fix: the decode no admission slot lets go is handed off at once (one token,
    outside admission), so vLLM's NIXL frees the prefill's blocks on the read notification.

    The proof is the order: the prefill's blocks are free while the blocker still decodes,
    holding the only slot, and not because the request's lease ended (its lease line names
    it). The blocker's ~1,900 tokens last a second or two on a fast machine; an attempt where
    it ends first (before the hang-up, or before the blocks are seen free) is inconclusive,
    and a fresh pair tries again once both engines have settled. Without the fix the blocks
    wait for the blocker's slot or the lease, and no attempt is conclusive. Time is measured
    from the hang-up, never from the request's start: reading the prefill's counters to see
    it finish can itself take many seconds on a busy machine.
    """
    expired = expired_lines(real_pd.prefill)
    with gateway_for(real_pd, admission=AdmissionConfig(per_rank=1)) as url:
        for _ in range(3):
            freed_after = await freed_while_blocked(url, real_pd)
            if freed_after is not None:
                break
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    idle(real_pd.prefill) and idle(real_pd.decode) and real_pd.prefill.blocks_free()
                ),
                45.0,
                "both engines settled after an inconclusive attempt",
            )
            expired = expired_lines(real_pd.prefill)
        else:
            pytest.fail("the prefill's blocks were never freed while the blocker held the slot")
    late = expiries(real_pd.prefill)[expired:]
    if late:
        raise judge_lease_wait(real_pd, late, freed_after)
    await asyncio.to_thread(assert_settled, real_pd, expired)


async def freed_while_blocked(url: str, pd: RealVllmPair) -> float | None:
    """One attempt of the test above: the seconds from the hang-up until the prefill's blocks
    were free, or None when the blocker ended first."""
    model = pd.decode.served_model_name
    long_one = body(model, unique_text(8), stream=True, max_tokens=1900, ignore_eos=True)
    ended: list[float] = []
    blocker = asyncio.ensure_future(read_all(url, long_one))
    blocker.add_done_callback(lambda _: ended.append(time.monotonic()))
    try:
        await asyncio.to_thread(
            wait_until, lambda: metrics(pd.decode)["num_requests_running"] == 1, 60, "blocker"
        )
        served = metrics(pd.prefill)["request_success_total"]
        rid = f"slot-window-{time.monotonic_ns()}"
        _, left = await hang_up_if_in_time(
            url,
            body(model, unique_text(), stream=True, request_id=rid),
            lambda _: metrics(pd.prefill)["request_success_total"] > served,
        )
        if not left:
            return None
        hung_up = time.monotonic()
        freed = await asyncio.to_thread(
            wait_until_or_not,
            lambda: bool(ended) or pd.prefill.blocks_free(),
            10.0,
        )
        return time.monotonic() - hung_up if freed and not ended else None
    finally:
        blocker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await blocker


async def test_hang_up_after_the_decode_was_submitted(
    gateway: httpx.Client, real_pd: RealVllmPair
) -> None:
    """The client leaves once the decode engine has the request, before its first token: the
    sidecar reads on to the first token, then drops it. The engine's arrival line can reach
    its log late (one run streamed 42 tokens by then): a client that left after the first
    token missed the window, and a fresh request tries again. The log is the only witness
    read while waiting; a /metrics read takes 0.1 s or more, which made every one of three
    attempts late in a CI run."""
    model = real_pd.decode.served_model_name
    url = str(gateway.base_url)
    for _ in range(WINDOW_ATTEMPTS):
        expired = expired_lines(real_pd.prefill)
        rid = f"submitted-window-{time.monotonic_ns()}"
        payload = body(model, unique_text(), stream=True, max_tokens=200, request_id=rid)

        def at_the_decode(_: list[str], rid: str = rid) -> bool:
            return arrived(real_pd.decode, rid)

        lines = await hang_up_when(url, payload, at_the_decode)
        await asyncio.to_thread(assert_settled, real_pd, expired)
        if content_lines(lines) <= 1:
            return
    pytest.fail(f"every one of {WINDOW_ATTEMPTS} clients left after its first token")


async def test_hang_up_after_the_first_token(gateway: httpx.Client, real_pd: RealVllmPair) -> None:
    model = real_pd.decode.served_model_name
    expired = expired_lines(real_pd.prefill)
    payload = body(model, unique_text(), stream=True, max_tokens=1500, ignore_eos=True)
    lines = await hang_up_when(str(gateway.base_url), payload, lambda got: content_lines(got) >= 2)
    assert content_lines(lines) >= 2
    await asyncio.to_thread(assert_settled, real_pd, expired)
    # The decode was aborted, not run to its 1500 tokens.
    log = real_pd.decode.log_path.read_text(errors="replace")
    assert "aborting request due to dropped stream" in log


def stream_choices(url: str, payload: dict[str, Any]) -> dict[int, tuple[str, list[Any]]]:
    """Per choice of a streamed chat answer: its text and its tokens' logprobs entries."""
    import orjson

    out: dict[int, tuple[str, list[Any]]] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in orjson.loads(line[6:]).get("choices", ()):
                text, logprobs = out.get(choice["index"], ("", []))
                text += choice["delta"].get("content") or ""
                logprobs += (choice.get("logprobs") or {}).get("content") or []
                out[choice["index"]] = (text, logprobs)
    return out


def test_seeded_streams_are_what_the_decode_engine_answers_alone(real_pd: RealVllmPair) -> None:
    """The client's first token is the prefill's, sampled as the client asked; the stream is
    token for token the decode engine's own answer to the whole request (greedy, seeded
    sampling with logprobs, n > 1)."""
    model = real_pd.decode.served_model_name
    cases: list[dict[str, Any]] = [
        {},
        {"temperature": 1.0, "seed": 5, "logprobs": True, "top_logprobs": 2},
        {"temperature": 0.9, "top_p": 0.95, "seed": 3, "n": 2},
    ]
    alone = DisaggConfig(prefill_mode="local")
    seeding = DisaggConfig(prefill_mode="remote")
    with (
        gateway_for(real_pd, disagg=alone) as local,
        gateway_for(real_pd, disagg=seeding) as seeded,
    ):
        for fields in cases:
            payload = body(model, unique_text(), stream=True, max_tokens=12, **fields)
            assert stream_choices(seeded, payload) == stream_choices(local, payload), fields
        with httpx.Client(base_url=seeded) as client:
            sent_early = metric_total(client, SEEDED, outcome="first_token")
            assert sent_early + metric_total(client, SEEDED, outcome="held_back") == 4
            assert sent_early >= 1
            assert metric_total(client, SEEDED, outcome="mismatch") == 0


def test_short_prompts_skip_the_transfer_and_long_ones_take_it(real_pd: RealVllmPair) -> None:
    model = real_pd.decode.served_model_name
    with gateway_for(real_pd, disagg=DisaggConfig()) as url:
        client = httpx.Client(base_url=url, timeout=120)
        prefill_before = settled_metrics(real_pd.prefill)
        decode_before = settled_metrics(real_pd.decode)
        short = post(client, body(model, unique_text(20))).json()["usage"]["prompt_tokens"]
        assert short < 256
        prefill_after = settled_metrics(real_pd.prefill)
        decode_after = settled_metrics(real_pd.decode)
        # The decode engine prefilled it itself: no prefill, no KV pulled.
        assert prefill_after["prompt_tokens_total"] == prefill_before["prompt_tokens_total"]
        assert decode_after["prompt_tokens_total"] - decode_before["prompt_tokens_total"] == short
        assert (
            decode_after["external_prefix_cache_hits_total"]
            == decode_before["external_prefix_cache_hits_total"]
        )
        long = post(client, body(model, unique_text(300))).json()["usage"]["prompt_tokens"]
        assert long > 256
        prefill_last = settled_metrics(real_pd.prefill)
        decode_last = settled_metrics(real_pd.decode)
        assert prefill_last["prompt_tokens_total"] - prefill_after["prompt_tokens_total"] == long
        assert (
            decode_last["external_prefix_cache_hits_total"]
            - decode_after["external_prefix_cache_hits_total"]
            == long
        )
        assert metric_total(client, PREFILLS, where="local", reason="short") == 1
        assert metric_total(client, PREFILLS, where="remote", reason="cheaper") == 1
        client.close()
