"""The KV connector's contract between a prefill engine and a decode engine.

A prefill answer's ``kv_transfer_params`` tell the decode engine where to pull the prompt's KV
from. Real connectors trust them blindly: altered params, or a decode request whose prompt is
not the one prefilled, pull the wrong blocks and produce garbage. The mock signs what it issues
(a digest over the params, the expanded prompt, the images, the LoRA and the salt), so a decode
role refuses anything a router did not forward verbatim with the original prompt and media.

Numbers must stay numbers. ``google.protobuf.Struct`` carries them as doubles (``remote_port``
arrives as ``5600.0``) and vLLM's NIXL connector accepts that, but it compares and adds the
sizes and counts it is given: a string there (``"dcp_size": "1"``) fails its handshake with a
TypeError, so the mock refuses strings in those fields as an engine error.

The prefill side keeps the blocks until the decode side says it read them (a datagram on the
side channel named by ``remote_host``/``remote_port``, as NIXL sends a notification) or the
lease runs out, as vLLM 0.32 does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

import orjson

from rankgate.mocker.media import MediaSpan
from rankgate.mocker.status import internal, invalid_argument

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")

DIGEST_KEY = "transfer_digest"
# The wall-clock time (epoch seconds) the prefill engine's lease on the KV ends.
LEASE_ENDS_KEY = "mock_lease_ends_at"
# The side-channel message by which a decode engine frees a prefill's blocks.
READ_NOTICE = b"read:"
# Fields NIXL does arithmetic and comparisons on (sizes, counts, the side-channel port).
NUMERIC_FIELDS = ("remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens")


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

    ``prefill`` takes only requests marked ``do_remote_decode``; ``decode`` takes remote
    prefills whose params carry a digest matching this very prompt, and prefills a request
    without them itself. ``both`` serves anything and checks a digest only when one is
    present (hand-made params in tests carry none).
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
        # As vLLM's NIXL consumer: a request without remote-prefill params is prefilled here.
        return
    digest = params.get(DIGEST_KEY)
    if digest is None:
        if role == "decode":
            raise invalid_argument(
                "kv_transfer_params carry no transfer_digest: they were not issued by a "
                "prefill engine"
            )
        return
    _check_numbers(params)
    unsigned = {key: value for key, value in params.items() if key != DIGEST_KEY}
    if _digest(unsigned, prompt, media, lora, cache_salt) != digest:
        raise invalid_argument(
            "kv_transfer_params do not match a prefill of this prompt: they were altered in "
            "transit, or the prompt, images, LoRA or cache salt differ from the prefill's"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_numbers(params: dict[str, Any]) -> None:
    for name in NUMERIC_FIELDS:
        value = params.get(name)
        if value is not None and not _is_number(value):
            raise internal(
                f"KV transfer handshake failed: kv_transfer_params {name} is "
                f"{type(value).__name__} {value!r}, not a number "
                "(TypeError: '>' not supported between instances of 'str' and 'int')"
            )
    groups = params.get("remote_block_ids")
    if groups is not None and not (
        isinstance(groups, list)
        and all(
            isinstance(group, list) and all(_is_number(block) for block in group)
            for group in groups
        )
    ):
        raise internal(
            f"KV transfer failed: remote_block_ids {groups!r} is not a list of block-id lists"
        )


def read_notice(params: dict[str, Any]) -> tuple[tuple[str, int], bytes] | None:
    """Where and what a decode engine sends once it has read a prefill's KV, if the params
    name a prefill engine's side channel."""
    host, port = params.get("remote_host"), params.get("remote_port")
    request_id = params.get("remote_request_id")
    if not (
        isinstance(host, str) and isinstance(port, (int, float)) and isinstance(request_id, str)
    ):
        return None
    return (host, int(port)), READ_NOTICE + request_id.encode()


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
    """JSON as a Struct round trip leaves it: integral numbers compare equal to ints."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return int(value) if float(value).is_integer() else value
    if isinstance(value, dict):
        return {str(key): _canonical(item) for key, item in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    return repr(value)
