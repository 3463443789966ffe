"""litellm against the gateway: chat, streamed and not, through two providers, and a completion.

Run by ``tests/clients/test_clients.py`` with the client environment's interpreter
(``.venv-clients/bin/python``), never the product's: ``drive_litellm.py BASE_URL MODEL``.
Prints one JSON line ``{"requests": N, "errors": [...]}`` last and exits 1 on any error.
"""

from __future__ import annotations

import functools
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import litellm


def chat(model: str, api_base: str, *, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "api_base": api_base,
        "api_key": "unused",
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": 8,
        "num_retries": 0,
    }
    if stream:
        text = ""
        finish = None
        for chunk in litellm.completion(**kwargs, stream=True):
            choice = chunk.choices[0]
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    else:
        response = litellm.completion(**kwargs)
        text = response.choices[0].message.content or ""
        finish = response.choices[0].finish_reason
        assert response.usage.completion_tokens > 0, response.usage
    assert text.strip(), f"empty reply from {model} (stream={stream})"
    assert finish in ("stop", "length"), finish


def text_completion(model: str, api_base: str) -> None:
    response = litellm.text_completion(
        model=model, api_base=api_base, api_key="unused", prompt="Once upon a time", max_tokens=8
    )
    assert response.choices[0].text.strip(), response


def main() -> int:
    base, model = sys.argv[1], sys.argv[2]
    api_base = f"{base}/v1"
    calls: list[tuple[str, Callable[[], None]]] = [
        (
            f"{provider}/{model} stream={stream}",
            functools.partial(chat, f"{provider}/{model}", api_base, stream=stream),
        )
        for provider in ("hosted_vllm", "openai")
        for stream in (False, True)
    ]
    calls.append(
        (
            f"text_completion openai/{model}",
            functools.partial(text_completion, f"openai/{model}", api_base),
        )
    )
    errors: list[str] = []
    for name, call in calls:
        try:
            call()
        except Exception:
            errors.append(f"{name}: {traceback.format_exc()}")
    print(json.dumps({"requests": len(calls), "errors": errors}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
