"""The KV connector's contract between a prefill engine and a decode engine.

A prefill answer's ``kv_transfer_params`` tell the decode engine where to pull the prompt's KV
from. Real connectors trust them blindly: altered params, or a decode request whose prompt is
not the one prefilled, pull the wrong blocks and produce garbage. The mock signs what it issues
(a digest over the params, the expanded prompt, the images, the LoRA and the salt), so a decode
role refuses anything a router did not forward verbatim with the original prompt and media.

Integers count as equal to their decimal strings: gateways send numbers as strings because
``google.protobuf.Struct`` numbers are doubles and a connector formats e.g. ``remote_port``
into a URL, where ``5600.0`` would break it (SPEC.md section 8).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any, Literal

import orjson

from mocker.media import MediaSpan
from mocker.status import invalid_argument

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")

DIGEST_KEY = "transfer_digest"

_INTEGER = re.compile(r"-?[0-9]+")


def issue(
    params: dict[str, Any],
    prompt: Sequence[int],
    media: Sequence[MediaSpan],
    lora: str,
    cache_salt: str,
) -> dict[str, Any]:
    """``params`` plus the digest a decode engine will check."""
    signed = dict(params)
    signed[DIGEST_KEY] = _digest(params, prompt, media, lora, cache_salt)
    return signed


def check(
    role: Role,
    params: dict[str, Any] | None,
    prompt: Sequence[int],
    media: Sequence[MediaSpan],
    lora: str,
    cache_salt: str,
) -> None:
    """Refuse (INVALID_ARGUMENT) what the engine's role cannot serve.

    ``prefill`` takes only requests marked ``do_remote_decode``; ``decode`` only remote
    prefills whose params carry a digest matching this very prompt. ``both`` serves anything
    and checks a digest only when one is present (hand-made params in tests carry none).
    """
    params = params or {}
    remote_prefill = bool(params.get("do_remote_prefill"))
    if role == "prefill":
        if remote_prefill:
            raise invalid_argument(
                "this engine only prefills (kv_producer): it cannot take a remote prefill"
            )
        if not params.get("do_remote_decode"):
            raise invalid_argument(
                "this engine only prefills (kv_producer): the request needs kv_transfer_params "
                "with do_remote_decode true"
            )
        return
    if not remote_prefill:
        if role == "decode":
            raise invalid_argument(
                "this engine only decodes (kv_consumer): the request needs the "
                "kv_transfer_params of a prefill engine"
            )
        return
    digest = params.get(DIGEST_KEY)
    if digest is None:
        if role == "decode":
            raise invalid_argument(
                "kv_transfer_params carry no transfer_digest: they were not issued by a "
                "prefill engine"
            )
        return
    port = params.get("remote_port")
    if port is not None and not (isinstance(port, str) and port.isdigit()):
        raise invalid_argument(
            f"kv_transfer_params remote_port {port!r} cannot be formatted into a URL; "
            "send it as a decimal string"
        )
    unsigned = {key: value for key, value in params.items() if key != DIGEST_KEY}
    if _digest(unsigned, prompt, media, lora, cache_salt) != digest:
        raise invalid_argument(
            "kv_transfer_params do not match a prefill of this prompt: they were altered in "
            "transit, or the prompt, images, LoRA or cache salt differ from the prefill's"
        )


def _digest(
    params: dict[str, Any],
    prompt: Sequence[int],
    media: Sequence[MediaSpan],
    lora: str,
    cache_salt: str,
) -> str:
    body = orjson.dumps(
        [
            _canonical(params),
            list(prompt),
            [[span.identifier, span.offset, span.length] for span in media],
            lora,
            cache_salt,
        ]
    )
    return hashlib.sha256(body).hexdigest()[:32]


def _canonical(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return str(int(value)) if _INTEGER.fullmatch(value) else value
    if isinstance(value, dict):
        return {str(key): _canonical(item) for key, item in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    return repr(value)
