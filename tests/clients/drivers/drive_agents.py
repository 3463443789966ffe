"""openai-agents against the gateway: an agent with a function tool, run and streamed.

Run by ``tests/clients/test_clients.py`` with the client environment's interpreter
(``.venv-clients/bin/python``), never the product's: ``drive_agents.py BASE_URL MODEL``.
The first turn is made to call the tool (``tool_choice="required"``; the demo engine answers a
forced tool choice with arguments that fit the schema), the SDK runs it and resets the choice,
and the second turn answers in text. Prints one JSON line ``{"requests": N, "errors": [...]}``
last and exits 1 on any error.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

calls: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    calls.append(city)
    return f"It is sunny in {city}."


async def run_once(agent: Agent, *, stream: bool) -> None:
    before = len(calls)
    if stream:
        result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        events = 0
        async for _ in result.stream_events():
            events += 1
        assert events > 0, "no stream events"
    else:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert len(calls) == before + 1, f"tool calls: {calls[before:]}"
    output = result.final_output
    assert isinstance(output, str), repr(output)
    assert output.strip(), "empty final output"


async def main() -> int:
    base, model_name = sys.argv[1], sys.argv[2]
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the tool's result.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=model_name, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", max_tokens=64),
    )
    errors: list[str] = []
    runs = (False, True)
    for stream in runs:
        try:
            await run_once(agent, stream=stream)
        except Exception:
            errors.append(f"stream={stream}: {traceback.format_exc()}")
    print(json.dumps({"requests": len(runs), "errors": errors}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
