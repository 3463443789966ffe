"""OpenAI chat messages as the input a chat template reads.

A template reads plain dicts, with content either as OpenAI's list of typed parts or as one
string (its :data:`~rankgate.app.prepare.template.ContentFormat`); the media parts are taken
out on the way, in prompt order, for the media pipeline to fetch, and each leaves its
placeholder (or a typed part) where it sat.
"""

from __future__ import annotations

from typing import Any

import orjson

from rankgate.app.edge.limits import InputLimits, check_json_text
from rankgate.app.errors import invalid
from rankgate.app.prepare.template import ContentFormat
from rankgate.app.schemas.requests import (
    AssistantMessage,
    AudioUrlPart,
    DeveloperMessage,
    ImageUrlPart,
    InputAudioPart,
    Message,
    RefusalPart,
    SystemMessage,
    TextPart,
    ToolMessage,
    UserMessage,
    VideoUrlPart,
)
from rankgate.multimodal import MediaKind, MediaRef

# How a message names several items of each kind, for the errors that count them.
MEDIA_NOUNS: dict[MediaKind, str] = {"image": "images", "audio": "audio", "video": "video"}


def _media_part(part: Any) -> MediaRef | None:
    """The media reference an image, audio or video content part stands for."""
    if isinstance(part, ImageUrlPart):
        return MediaRef(url=part.image_url.url, uuid=part.uuid, detail=part.image_url.detail)
    if isinstance(part, InputAudioPart):
        audio = part.input_audio
        url = f"data:audio/{audio.format.lower()};base64,{audio.data}"
        return MediaRef(url=url, uuid=part.uuid, kind="audio")
    if isinstance(part, AudioUrlPart):
        return MediaRef(url=part.audio_url.url, uuid=part.uuid, kind="audio")
    if isinstance(part, VideoUrlPart):
        return MediaRef(url=part.video_url.url, uuid=part.uuid, kind="video")
    return None


class MessageConverter:
    """Messages as the dicts a chat template reads, collecting media parts on the way."""

    def __init__(
        self,
        fmt: ContentFormat,
        placeholders: dict[MediaKind, str | None],
        limits: InputLimits,
    ) -> None:
        self.fmt = fmt
        self.placeholders = placeholders
        self.limits = limits
        self.media: list[MediaRef] = []

    def content(self, content: str | list[Any] | None, where: str) -> Any:
        if content is None:
            return [] if self.fmt == "openai" else ""
        if isinstance(content, str):
            return [{"type": "text", "text": content}] if self.fmt == "openai" else content
        parts: list[dict[str, Any]] = []
        texts: list[str] = []
        marks: list[str] = []
        for j, part in enumerate(content):
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
                texts.append(part.text)
            elif isinstance(part, RefusalPart):
                parts.append({"type": "text", "text": part.refusal})
                texts.append(part.refusal)
            else:
                ref = _media_part(part)
                assert ref is not None
                self.media.append(ref)
                parts.append({"type": ref.kind})
                if self.fmt == "string":
                    placeholder = self.placeholders.get(ref.kind)
                    if placeholder is None:
                        raise invalid(
                            f"this model's chat template has no {ref.kind} placeholder; "
                            f"{MEDIA_NOUNS[ref.kind]} are not supported",
                            f"{where}.content[{j}]",
                        )
                    marks.append(placeholder)
        if self.fmt == "openai":
            return parts
        text = "\n".join(texts)
        if marks:
            text = "\n".join(marks + ([text] if text else []))
        return text

    def message(self, message: Message, i: int) -> dict[str, Any]:
        where = f"messages[{i}]"
        if isinstance(message, SystemMessage | DeveloperMessage):
            out: dict[str, Any] = {
                "role": "system",
                "content": self.content(message.content, where),
            }
        elif isinstance(message, UserMessage):
            out = {"role": "user", "content": self.content(message.content, where)}
        elif isinstance(message, ToolMessage):
            out = {
                "role": "tool",
                "content": self.content(message.content, where),
                "tool_call_id": message.tool_call_id,
            }
        else:
            out = self._assistant(message, where)
        name = getattr(message, "name", None)
        if name is not None:
            out["name"] = name
        return out

    def _assistant(self, message: AssistantMessage, where: str) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content(message.content, where)}
        if message.tool_calls:
            calls = []
            for j, call in enumerate(message.tool_calls):
                param = f"{where}.tool_calls[{j}].function.arguments"
                check_json_text(call.function.arguments, param, self.limits)
                try:
                    arguments = orjson.loads(call.function.arguments)
                except orjson.JSONDecodeError:
                    raise invalid(f"'{param}' must be JSON text", param) from None
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            out["tool_calls"] = calls
        reasoning = message.reasoning_content or message.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if message.refusal is not None and message.content is None:
            out["content"] = self.content(message.refusal, where)
        return out
