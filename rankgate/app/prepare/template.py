"""Chat-template rendering that matches ``transformers``' ``apply_chat_template``.

Models ship Jinja templates written against Hugging Face's environment: a sandbox with
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII text, loop controls and the ``{% generation %}`` tag. Reproducing that environment
exactly is what makes the prompt the gateway tokenizes identical to the one the model was
trained on. A template is compiled once and reused for every request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# What makes a render depend on more than its inputs: the clock, a random pick.
_UNSTABLE_NAMES = frozenset({"strftime_now", "lipsum"})
_UNSTABLE_FILTERS = frozenset({"random"})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateRenderError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed on it."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` marks training spans; it renders its body as-is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
            lineno
        )

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, as Hugging Face's does."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore attributes on a namespace: {name!r}"
            )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


_ENV = _environment()


def _iterates_content(node: jinja2.nodes.Node) -> bool:
    target = node
    if isinstance(target, jinja2.nodes.Filter | jinja2.nodes.Test) and target.node is not None:
        target = target.node
    if isinstance(target, jinja2.nodes.Getitem):
        return isinstance(target.arg, jinja2.nodes.Const) and target.arg.value == "content"
    if isinstance(target, jinja2.nodes.Getattr):
        return target.attr == "content"
    if isinstance(target, jinja2.nodes.Name):
        return "content" in target.name
    return False


def detect_content_format(source: str) -> ContentFormat:
    """``openai`` when the template loops over a message's content parts, else ``string``.

    Templates of the first kind expect OpenAI-style part lists (and place image tokens
    themselves); the others expect one string per message.
    """
    ast = _ENV.parse(source)
    for loop in ast.find_all(jinja2.nodes.For):
        if _iterates_content(loop.iter):
            return "openai"
    return "string"


def _deterministic(source: str) -> bool:
    """Whether a render depends on its inputs alone (no clock, no random source), so that
    identical conversations may share one render."""
    ast = _ENV.parse(source)
    if any(node.name in _UNSTABLE_NAMES for node in ast.find_all(jinja2.nodes.Name)):
        return False
    return not any(node.name in _UNSTABLE_FILTERS for node in ast.find_all(jinja2.nodes.Filter))


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        try:
            self._compiled = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc
        self.content_format: ContentFormat = detect_content_format(source)
        self.deterministic = _deterministic(source)
        self._special = dict(special_tokens or {})
        # The template's globals (its own over the environment's) and the special tokens as
        # one flat dict: a render then builds its context from a plain dict copy instead of
        # Jinja merging the globals' ChainMap for every request.
        self._base: dict[str, Any] = {**self._compiled.globals, **self._special}

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Render like ``apply_chat_template(..., tokenize=False)``; may mutate ``messages``."""
        if not messages:
            raise TemplateRenderError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise TemplateRenderError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        _alias_reasoning(messages)
        final_text: str | None = None
        if continue_final_message:
            final_text = _tag_final_message(messages, self.source)
        context: dict[str, Any] = {**self._base, **extra} if extra else dict(self._base)
        context["messages"] = messages
        context["tools"] = list(tools) if tools is not None else None
        context["documents"] = list(documents) if documents is not None else None
        context["add_generation_prompt"] = add_generation_prompt
        template = self._compiled
        scope = template.new_context(context, shared=True)
        try:
            rendered = _ENV.concat(template.root_render_func(scope))
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateRenderError(str(exc)) from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise TemplateRenderError(
                f"the chat template failed on this conversation: {exc}"
            ) from exc
        finally:
            # A macro the template defines is a closure over the render's context, kept in
            # that context's variables: a cycle that only the cyclic collector would free.
            scope.vars.clear()
        if final_text is None:
            return rendered
        if final_text.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise TemplateRenderError(
                "continue_final_message is set but the chat template drops part of the final "
                "message"
            )
        at = rendered.rindex(_CONTINUE_TAG.strip())
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        return rendered[:at].rstrip()


def _alias_reasoning(messages: list[dict[str, Any]]) -> None:
    for i, message in enumerate(messages):
        reasoning = next(
            (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
        )
        if reasoning is not None:
            messages[i] = {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(messages: list[dict[str, Any]], source: str) -> str:
    final = messages[-1]
    content = final.get("content")
    if content is None:
        raise TemplateRenderError(
            "continue_final_message is set but the final message has no content to continue"
        )
    if "content" not in source:
        raise TemplateRenderError("continue_final_message is set but the template has no content")
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and "text" in part:
                text = str(part["text"])
                part["text"] = text + _CONTINUE_TAG
                return text
        raise TemplateRenderError(
            "continue_final_message is set but the final message has no text to continue"
        )
    text = str(content)
    final["content"] = text + _CONTINUE_TAG
    return text
