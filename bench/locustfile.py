"""Load test for an OpenAI-compatible chat endpoint (Rankgate or any peer): TTFT and tokens/s.

Each simulated user sends chat completions back to back (``--think-seconds`` apart), streaming
or not, optionally with images and with system prompts shared by groups of requests, so that
a KV-aware router has something to find. Besides locust's own table it records, per request,
``LLM TTFT`` (streaming: first content token), ``LLM end-to-end`` (its size column counts
completion tokens) and ``LLM inter-token`` (mean gap between streamed tokens), and prints
output tokens/s and TTFT percentiles when the run ends.

It needs nothing but ``pip install locust`` (the standard library does its JSON); Pillow, a
Rankgate dependency, only for ``--images`` above 0.

    .venv/bin/pip install -e '.[bench]'
    rankgate serve --port 8000 &        # or any OpenAI-compatible server
    .venv/bin/locust -f bench/locustfile.py --headless -H http://127.0.0.1:8000 \\
        -u 32 -r 8 -t 60s --stream --max-tokens 64 --shared-prefix-words 400 --images 0

Options (after locust's own): ``--model`` (default: the first of GET /v1/models),
``--stream/--no-stream``, ``--max-tokens``, ``--prompt-words``, ``--shared-prefix-words`` and
``--prefix-groups`` (0 words = no shared prefix), ``--images`` per request with
``--image-size`` pixels and ``--unique-images`` (else a small pool is reused),
``--think-seconds``.
"""

from __future__ import annotations

import base64
import io
import json
import random
import time
from typing import Any

from locust import FastHttpUser, events, task
from locust.env import Environment

# fmt: off
WORDS = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
    "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango",
    "uniform", "victor", "whiskey", "xray", "yankee", "zulu", "river", "mountain", "cache",
    "token", "router", "rank", "prefix", "block", "engine", "gateway", "stream", "latency",
)
# fmt: on
IMAGE_POOL = 8
KIND = "LLM"


@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]
def _options(parser: Any) -> None:
    group = parser.add_argument_group("rankgate workload")
    group.add_argument("--model", default="", help="model name; default: first of /v1/models")
    group.add_argument(
        "--stream", action="store_true", default=True, help="stream responses (default)"
    )
    group.add_argument("--no-stream", dest="stream", action="store_false")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--prompt-words", type=int, default=64, help="unique words per request")
    group.add_argument("--shared-prefix-words", type=int, default=0)
    group.add_argument("--prefix-groups", type=int, default=4)
    group.add_argument("--images", type=int, default=0, help="images per request")
    group.add_argument("--image-size", type=int, default=64, help="pixels per side")
    group.add_argument("--unique-images", action="store_true", help="a new image every request")
    group.add_argument("--think-seconds", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=1)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _image(rng: random.Random, size: int) -> dict[str, Any]:
    from PIL import Image

    colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
    picture = Image.new("RGB", (size, size), colour)
    picture.putpixel((rng.randrange(size), rng.randrange(size)), (255, 255, 255))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    data = base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


class Workload:
    """What every user sends; built once per process from the command line."""

    def __init__(self, options: Any) -> None:
        self.options = options
        rng = random.Random(options.seed)
        self.prefixes = [
            f"Group {g}. " + _words(rng, options.shared_prefix_words)
            for g in range(max(1, options.prefix_groups))
            if options.shared_prefix_words > 0
        ]
        # Text-only runs never touch Pillow.
        pool = IMAGE_POOL if options.images > 0 and not options.unique_images else 0
        self.pool = [_image(rng, options.image_size) for _ in range(pool)]

    def body(self, rng: random.Random, model: str) -> str:
        o = self.options
        text = f"Request {rng.getrandbits(64):x}: " + _words(rng, o.prompt_words)
        content: str | list[dict[str, Any]] = text
        if o.images > 0:
            images = [
                _image(rng, o.image_size) if o.unique_images else rng.choice(self.pool)
                for _ in range(o.images)
            ]
            content = [*images, {"type": "text", "text": text}]
        messages: list[dict[str, Any]] = []
        if self.prefixes:
            messages.append({"role": "system", "content": rng.choice(self.prefixes)})
        messages.append({"role": "user", "content": content})
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": o.max_tokens,
            "stream": o.stream,
        }
        if o.stream:
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body, separators=(",", ":"))


_workload: Workload | None = None


@events.init.add_listener  # type: ignore[untyped-decorator]
def _init(environment: Environment, **_: Any) -> None:
    global _workload
    if environment.parsed_options is not None:
        _workload = Workload(environment.parsed_options)


def _record(environment: Environment, name: str, seconds: float, length: int = 0) -> None:
    environment.events.request.fire(  # type: ignore[no-untyped-call]
        request_type=KIND,
        name=name,
        response_time=seconds * 1000,
        response_length=length,
        exception=None,
        context={},
    )


class ChatUser(FastHttpUser):
    """One client sending chat completions back to back."""

    def on_start(self) -> None:
        assert _workload is not None
        self.workload = _workload
        self.rng = random.Random()
        self.model = self.workload.options.model or self._first_model()
        self.think = self.workload.options.think_seconds

    def _first_model(self) -> str:
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as response:
            models = response.json().get("data") or []
            if not models:
                response.failure("no models served")
                return ""
            return str(models[0]["id"])

    def wait_time(self) -> float:
        return self.rng.expovariate(1 / self.think) if self.think > 0 else 0.0

    @task
    def chat(self) -> None:
        body = self.workload.body(self.rng, self.model)
        headers = {"content-type": "application/json"}
        started = time.perf_counter()
        if not self.workload.options.stream:
            with self.client.post(
                "/v1/chat/completions", data=body, headers=headers, catch_response=True
            ) as response:
                if response.status_code != 200:
                    response.failure(f"{response.status_code}: {response.text[:200]}")
                    return
                tokens = int(response.json()["usage"]["completion_tokens"])
            _record(self.environment, "end-to-end", time.perf_counter() - started, tokens)
            return
        with self.client.post(
            "/v1/chat/completions",
            data=body,
            headers=headers,
            stream=True,
            catch_response=True,
            name="/v1/chat/completions (stream)",
        ) as response:
            if response.status_code != 200:
                response.failure(f"{response.status_code}")
                return
            first = 0.0
            tokens = 0
            # geventhttpclient's readline returns each SSE line as soon as it arrives;
            # locust's iter_content would wait for whole chunks and blur TTFT.
            raw = response._response
            assert raw is not None
            while line := raw.readline(b"\n"):
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                choices = event.get("choices") or ()
                if not first and any(c.get("delta", {}).get("content") for c in choices):
                    first = time.perf_counter() - started
                usage = event.get("usage")
                if usage:
                    tokens = int(usage["completion_tokens"])
            total = time.perf_counter() - started
            if not first:
                response.failure("the stream carried no content")
                return
            response.success()
        _record(self.environment, "TTFT", first)
        _record(self.environment, "end-to-end", total, tokens)
        if tokens > 1:
            _record(self.environment, "inter-token", (total - first) / (tokens - 1))


@events.quitting.add_listener  # type: ignore[untyped-decorator]
def _summary(environment: Environment, **_: Any) -> None:
    stats = environment.stats
    if stats is None or environment.runner is None or environment.parsed_options is None:
        return
    if type(environment.runner).__name__ == "WorkerRunner":
        return
    end_to_end = stats.get("end-to-end", KIND)
    ttft = stats.get("TTFT", KIND)
    itl = stats.get("inter-token", KIND)
    last = stats.total.last_request_timestamp or stats.total.start_time
    elapsed = max(last - stats.total.start_time, 1e-9)
    tokens = end_to_end.total_content_length
    print()
    print(f"LLM summary over {elapsed:.1f} s, {end_to_end.num_requests} completed requests")
    print(f"  output tokens/s        {tokens / elapsed:10.1f}  ({tokens} tokens)")
    print(f"  requests/s             {end_to_end.num_requests / elapsed:10.2f}")
    if ttft.num_requests:
        p50, p99 = (ttft.get_response_time_percentile(q) for q in (0.5, 0.99))
        print(f"  TTFT ms   mean {ttft.avg_response_time:8.1f}  p50 {p50:8.1f}  p99 {p99:8.1f}")
    if itl.num_requests:
        print(
            f"  inter-token ms mean {itl.avg_response_time:6.2f}  p99 "
            f"{itl.get_response_time_percentile(0.99):6.2f}"
        )
    print(
        f"  end-to-end ms  mean {end_to_end.avg_response_time:8.1f}  p99 "
        f"{end_to_end.get_response_time_percentile(0.99):8.1f}"
    )
