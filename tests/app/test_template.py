"""Our chat-template rendering equals ``transformers``' ``apply_chat_template``, byte for byte."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from rankgate.app.prepare.template import ChatTemplate, TemplateRenderError, detect_content_format
from rankgate.app.tokens.tokenizer import TextTokenizer
from tests.conftest import TINY_TOKENIZER
from tests.support.cyclic_garbage import cyclic_garbage

TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_TURN: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
]
PLAIN: list[dict[str, Any]] = [
    {"role": "system", "content": "  You are terse.  "},
    {"role": "user", "content": "Hi <b>there</b> & welcome"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Count to 3."},
]
PARTS: list[dict[str, Any]] = [
    {"role": "system", "content": "sys"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}],
    },
    {"role": "assistant", "content": "A cat.", "reasoning_content": "Looks furry."},
    {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
]

CASES: list[tuple[str, str, list[dict[str, Any]], dict[str, Any]]] = [
    ("qwen tools", "qwen_tools.jinja", TOOL_TURN, {"tools": TOOLS}),
    ("qwen plain", "qwen_tools.jinja", PLAIN, {}),
    ("qwen no generation prompt", "qwen_tools.jinja", PLAIN, {"add_generation_prompt": False}),
    ("llama3 plain", "llama3.jinja", PLAIN, {}),
    (
        "llama3 tools and kwargs",
        "llama3.jinja",
        TOOL_TURN,
        {"tools": TOOLS, "date_string": "1 Jan 2025"},
    ),
    (
        "llama3 continue",
        "llama3.jinja",
        [*PLAIN, {"role": "assistant", "content": "One, two,  "}],
        {"continue_final_message": True, "add_generation_prompt": False},
    ),
    ("parts", "thinking_parts.jinja", PARTS, {}),
    ("parts no thinking", "thinking_parts.jinja", PARTS, {"enable_thinking": False}),
    (
        "parts documents",
        "thinking_parts.jinja",
        PARTS,
        {"documents": [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]},
    ),
    ("tiny chatml tools", "tiny", TOOL_TURN, {"tools": TOOLS}),
    (
        "tiny continue",
        "tiny",
        [*PLAIN, {"role": "assistant", "content": [{"type": "text", "text": "Sure: 1,"}]}],
        {"continue_final_message": True, "add_generation_prompt": False},
    ),
]


@pytest.fixture(scope="module")
def hf() -> Any:
    return PreTrainedTokenizerFast.from_pretrained(str(TINY_TOKENIZER))


@pytest.fixture(scope="module")
def ours() -> TextTokenizer:
    return TextTokenizer(TINY_TOKENIZER)


def _source(name: str, ours: TextTokenizer) -> str:
    if name == "tiny":
        assert ours.files.chat_template is not None
        return ours.files.chat_template
    return (TEMPLATES / name).read_text()


@pytest.mark.parametrize(
    ("name", "template", "messages", "options"), CASES, ids=[c[0] for c in CASES]
)
def test_matches_transformers(
    hf: Any,
    ours: TextTokenizer,
    name: str,
    template: str,
    messages: list[dict[str, Any]],
    options: dict[str, Any],
) -> None:
    source = _source(template, ours)
    opts = dict(options)
    tools = opts.pop("tools", None)
    documents = opts.pop("documents", None)
    add_generation_prompt = opts.pop("add_generation_prompt", True)
    continue_final = opts.pop("continue_final_message", False)
    expected = hf.apply_chat_template(
        copy.deepcopy(messages),
        chat_template=source,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        tokenize=False,
        **opts,
    )
    rendered = ChatTemplate(source, ours.files.special_tokens).render(
        copy.deepcopy(messages),
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        extra=opts,
    )
    assert rendered == expected
    expected_ids = hf.apply_chat_template(
        copy.deepcopy(messages),
        chat_template=source,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        tokenize=True,
        return_dict=False,
        **opts,
    )
    assert ours.encode(rendered, add_special_tokens=False) == list(expected_ids)


def test_raise_exception_is_a_render_error(hf: Any, ours: TextTokenizer) -> None:
    source = (TEMPLATES / "llama3.jinja").read_text()
    bad = [{"role": "wizard", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="Unknown role: wizard"):
        hf.apply_chat_template(bad, chat_template=source, tokenize=False)
    with pytest.raises(TemplateRenderError, match="Unknown role: wizard"):
        ChatTemplate(source).render(bad)


def test_content_format_detection(ours: TextTokenizer) -> None:
    assert detect_content_format((TEMPLATES / "qwen_tools.jinja").read_text()) == "string"
    assert detect_content_format((TEMPLATES / "llama3.jinja").read_text()) == "string"
    assert detect_content_format((TEMPLATES / "thinking_parts.jinja").read_text()) == "openai"
    assert detect_content_format(_source("tiny", ours)) == "openai"


def test_sandbox_blocks_escapes() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateRenderError):
        template.render([{"role": "user", "content": "x"}])


def test_a_render_leaves_nothing_for_the_cyclic_collector() -> None:
    # A macro that looks a name up is a closure over the render's context, which keeps the
    # macro among its variables.
    template = ChatTemplate(
        "{%- macro part(text) -%}{%- for word in text.split() -%}{%- set kind = word -%}"
        "[{{ kind }}]{%- endfor -%}{{ bos_token }}{%- endmacro -%}"
        "{%- set ns = namespace(count=0) -%}"
        "{%- for message in messages -%}{{ part(message['content']) }}"
        "{%- set ns.count = ns.count + 1 -%}{%- endfor -%}{{ ns.count }}",
        {"bos_token": "<s>"},
    )
    with cyclic_garbage("jinja2", "rankgate") as left:
        for i in range(20):
            rendered = template.render([{"role": "user", "content": f"question {i}"}])
            assert rendered == f"[question][{i}]<s>1"
    assert not left
