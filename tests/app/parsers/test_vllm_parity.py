"""Rankgate's output parsers against vLLM's own, on the same outputs, whole and streamed.

vLLM's parser classes run in the vLLM install that ``scripts/real-vllm`` manages (one driver
process for the session, see ``vllm_driver.py``); no server is started. For every case the
driver returns vLLM's whole-output answer and, for several chunkings (one token per delta, and
random groups of tokens), the text pieces it was fed and what its streaming produced.

Rankgate must give vLLM's whole-output answer both whole and streamed over the same pieces.
Where vLLM's own streaming disagrees with its whole-output answer, that is recorded (written
to ``$RANKGATE_PARSER_DIVERGENCES`` when set) rather than followed.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from rankgate.app.parsers import (
    ChoiceParser,
    Parsed,
    Tool,
    Vocabulary,
    canonical_reasoning_parser,
    canonical_tool_parser,
    plan_for,
    vocabulary,
)
from tests.app.parsers.corpus import NOW as NOW_TOOL
from tests.app.parsers.corpus import WEATHER as WEATHER_TOOL
from tests.app.parsers.corpus import Case, all_cases
from tests.app.parsers.vocab import build_tokenizer
from tests.support.real_vllm import SCRIPT, real_vllm_required

pytestmark = pytest.mark.real_vllm

DRIVER = Path(__file__).with_name("vllm_driver.py")
# Seed 0: one token per delta; the others: random groups of 1 to 6 tokens.
CHUNKINGS = [0, 1, 2]
READY_TIMEOUT_S = 600.0
ANSWER_TIMEOUT_S = 120.0
CASES = all_cases()
DIVERGENCES: list[dict[str, Any]] = []


def _engine_python() -> Path:
    loader = importlib.machinery.SourceFileLoader("real_vllm_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader("real_vllm_script", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    # Registered first: the script's dataclasses look their module up while being built.
    sys.modules.setdefault("real_vllm_script", module)
    loader.exec_module(module)
    return Path(module.venv_python())


def _skip_or_fail(reason: str) -> None:
    if real_vllm_required():
        pytest.fail(reason)
    pytest.skip(reason)


class Driver:
    def __init__(self, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        self.proc = proc
        self.log = log
        self._buffer = b""

    def line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise TimeoutError("the vLLM parser driver did not answer in time")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise RuntimeError(f"the vLLM parser driver exited: {self.tail()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, spec: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(spec).encode() + b"\n")
        self.proc.stdin.flush()
        return self.line(ANSWER_TIMEOUT_S)

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def driver() -> Iterator[Driver]:
    try:
        subprocess.run(
            [sys.executable, str(SCRIPT), "install"],
            check=True,
            timeout=1800,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        _skip_or_fail(f"real vLLM could not be installed: {exc}")
    python = _engine_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with tempfile.NamedTemporaryFile(prefix="vllm-driver-", suffix=".log") as log:
        proc = subprocess.Popen(
            [str(python), str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        drv = Driver(proc, log)
        try:
            ready = drv.line(READY_TIMEOUT_S)
            assert ready.get("ready"), ready
            yield drv
        finally:
            with contextlib.suppress(Exception):
                assert proc.stdin is not None
                proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            target = os.environ.get("RANKGATE_PARSER_DIVERGENCES")
            if target:
                Path(target).write_text(json.dumps(DIVERGENCES, indent=1, ensure_ascii=False))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parser-tokenizers")


def _tokenizer(case: Case, root: Path) -> tuple[str, Vocabulary]:
    if case.family == "harmony":
        return "harmony", Vocabulary()
    directory = build_tokenizer(case.family, root)
    return str(directory), vocabulary(directory)


def _plan(case: Case, vocab: Vocabulary) -> Any:
    named = None
    choice = case.tool_choice
    if isinstance(choice, dict):
        named, choice = choice["function"]["name"], None
    tools = [Tool(t["function"]["name"], t["function"].get("parameters")) for t in case.tools]
    tool = canonical_tool_parser(case.tool_parser) if case.tool_parser else None
    reasoning = canonical_reasoning_parser(case.reasoning_parser) if case.reasoning_parser else None
    return plan_for(
        tool,
        reasoning,
        vocab,
        tools=tools or None,
        tool_choice=choice,
        named=named,
        parallel_tool_calls=case.parallel_tool_calls,
        template_kwargs=case.chat_template_kwargs or {},
    ).plan


def _ours(plan: Any, pieces: list[str], *, streamed: bool) -> dict[str, Any]:
    parser = ChoiceParser(plan)
    outs: list[Parsed] = [parser.feed(p) for p in pieces]
    outs.append(parser.finish())
    calls: dict[int, list[str]] = {}
    for out in outs:
        for call in out.calls:
            slot = calls.setdefault(call.index, ["", "", ""])
            if call.id is not None:
                assert call.name is not None, "a call starts with its name"
                assert not slot[0], "a call starts once"
                slot[2] = call.id
            if call.name is not None:
                slot[0] = call.name
            else:
                assert slot[2], "arguments come after the call's id and name"
            slot[1] += call.arguments
    return {
        "reasoning": "".join(o.reasoning for o in outs) or None,
        "content": "".join(o.content for o in outs) or None,
        "calls": [calls[i] for i in sorted(calls)],
        "finish": parser.finish_reason("stop", streamed=streamed),
    }


def _args(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return ("raw", text)


def _id_shape(call_id: str | None) -> str:
    if not call_id or call_id.startswith("chatcmpl-tool-"):
        return "vllm"
    if re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return "mistral"
    found = re.match(r"call_(\d+)_", call_id)
    if found:
        return f"xlam:{found.group(1)}"
    return call_id


def _normal(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "reasoning": result.get("reasoning") or None,
        "content": result.get("content") or None,
        "calls": [(name, _args(args), _id_shape(cid)) for name, args, cid in result["calls"]],
    }


STRICT_WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CONSTRAINT_PARSERS = {
    "hermes": "chatml",
    "llama3_json": "llama",
    "llama4_json": "llama",
    "pythonic": "chatml",
    "llama4_pythonic": "llama4",
    "mistral": "mistral",
    "mistral_v7": "mistral_v7",
    "deepseek_v3": "deepseek",
    "deepseek_v31": "deepseek",
    "qwen3_coder": "chatml",
    "qwen3_xml": "chatml",
    "kimi_k2": "kimi",
    "granite": "granite",
    "xlam": "chatml",
    "openai": "harmony",
}
CONSTRAINT_CASES = [
    (parser, tools, choice, parallel)
    for parser in CONSTRAINT_PARSERS
    for tools in ("plain", "strict")
    for choice, parallel in (
        ("auto", None),
        ("auto", False),
        ("required", None),
        ("required", False),
        (NAMED, None),
        ("none", None),
    )
]


@pytest.mark.parametrize(
    ("parser", "tools", "choice", "parallel"),
    CONSTRAINT_CASES,
    ids=[f"{p}-{t}-{c if isinstance(c, str) else 'named'}-{q}" for p, t, c, q in CONSTRAINT_CASES],
)
def test_engine_constraint_matches_vllm(
    parser: str, tools: str, choice: Any, parallel: bool | None, driver: Driver, tokenizers: Path
) -> None:
    """What the engine is told to follow (JSON schema or structural tag) is what vLLM's
    renderer sends for the same request once its parser adjusted it."""
    family = CONSTRAINT_PARSERS[parser]
    tool_parser = "mistral" if parser == "mistral_v7" else parser
    listed = [STRICT_WEATHER if tools == "strict" else WEATHER_TOOL, NOW_TOOL]
    case = Case(
        "constraint",
        family,
        tool_parser,
        None,
        "",
        tools=listed,
        tool_choice=choice,
        parallel_tool_calls=parallel,
    )
    tokenizer, vocab = _tokenizer(case, tokenizers)
    expected = driver.ask({**case.spec(tokenizer, []), "op": "constraint"})
    assert "error" not in expected, expected
    named = None
    plain_choice = choice
    if isinstance(choice, dict):
        named, plain_choice = choice["function"]["name"], None
    result = plan_for(
        canonical_tool_parser(tool_parser),
        None,
        vocab,
        tools=[
            Tool(
                t["function"]["name"],
                t["function"].get("parameters"),
                t["function"].get("strict") is True,
            )
            for t in listed
        ],
        tool_choice=plain_choice,
        named=named,
        parallel_tool_calls=parallel,
        template_kwargs={},
    )
    assert result.schema == expected.get("json")
    assert result.structural_tag == expected.get("structural_tag")
    if family != "harmony":
        assert (not result.plan.needs_special_tokens) == expected["skip_special_tokens"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_vllm(case: Case, driver: Driver, tokenizers: Path) -> None:
    tokenizer, vocab = _tokenizer(case, tokenizers)
    answer = driver.ask(case.spec(tokenizer, CHUNKINGS))
    assert "error" not in answer, answer
    whole = answer["whole"]
    assert "error" not in whole, f"vLLM failed on this output: {whole['error']}"
    expected = _normal(whole)
    plan = _plan(case, vocab)
    ours = _ours(plan, [case.text], streamed=False)
    assert _normal(ours) == expected, "whole output"
    assert ours["finish"] == whole["finish"]
    named = isinstance(case.tool_choice, dict)
    stream_finish = "tool_calls" if expected["calls"] and not named else "stop"
    for stream in answer["streams"]:
        pieces = stream["pieces"]
        assert "".join(pieces) == case.text or case.family == "harmony"
        got = _ours(plan, pieces, streamed=True)
        assert _normal(got) == expected, f"streamed in {len(pieces)} pieces: {pieces}"
        assert got["finish"] == stream_finish
        theirs = stream.get("result")
        if theirs is None or _normal(theirs) != expected:
            DIVERGENCES.append(
                {
                    "case": case.id,
                    "pieces": len(pieces),
                    "whole": expected,
                    "vllm_streamed": _normal(theirs) if theirs else stream.get("error"),
                }
            )
