"""openai-agents against the gateway: an agent with a function tool, run and streamed, on the
SDK's default model (the Responses API) and on its Chat Completions model.

Run by ``tests/clients/test_clients.py`` with the client environment's interpreter
(``.venv-clients/bin/python``), never the product's: ``drive_agents.py BASE_URL MODEL``.
The first turn is made to call the tool (``tool_choice="required"``; the demo engine answers a
forced tool choice with arguments that fit the schema), the SDK runs it and resets the choice,
and the second turn answers in text, ending where the model ends it (a turn cut at the token
limit is an incomplete response, which the SDK refuses). Prints one JSON line
``{"requests": N, "errors": [...]}`` last and exits 1 on any error.
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
    set_default_openai_client,
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
    # A model given by name is the SDK's default: the Responses API, on the default client.
    set_default_openai_client(client, use_for_tracing=False)
    models = {
        "responses": model_name,
        "chat": OpenAIChatCompletionsModel(model=model_name, openai_client=client),
    }
    errors: list[str] = []
    runs = [(api, stream) for api in models for stream in (False, True)]
    for api, stream in runs:
        agent = Agent(
            name="weather",
            instructions="Answer with the tool's result.",
            tools=[get_weather],
            model=models[api],
            # No token limit: the answer ends where the model ends it.
            model_settings=ModelSettings(tool_choice="required"),
        )
        try:
            await run_once(agent, stream=stream)
        except Exception:
            errors.append(f"{api} stream={stream}: {traceback.format_exc()}")
    print(json.dumps({"requests": len(runs), "errors": errors}))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
