"""``rankgate serve`` flags for every routing tunable (``RoutingConfig`` and its KV-event intake).

The policy itself is ``--policy``; everything here shapes how the ``kv`` policy (and, for the
cost weights and the capacity guard, ``load``) decides. Each flag also reads ``RANKGATE_<FLAG>``
from the environment, and the values are validated once by ``RoutingConfig`` itself, so a bad
knob stops the gateway at startup with the field's own message.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from rankgate.sidecar import IntakeSettings, RoutingConfig

# ``app.cli``'s environment reader: (flag name, default, converter) -> value.
EnvReader = Callable[[str, Any, Callable[[str], Any]], Any]


@dataclass(frozen=True, slots=True)
class Tunable:
    flag: str
    field: str
    convert: Callable[[str], Any]
    help: str
    # True for a field of ``RoutingConfig.intake`` rather than of ``RoutingConfig``.
    intake: bool = False

    @property
    def dest(self) -> str:
        return "routing_" + self.field


def _optional_int(text: str) -> int | None:
    lowered = text.strip().lower()
    if lowered in ("", "none", "auto"):
        return None
    return int(text)


TUNABLES: tuple[Tunable, ...] = (
    Tunable(
        "--route-prefill-weight",
        "prefill_weight",
        float,
        "cost per prompt token a rank still has to prefill, its queue included",
    ),
    Tunable(
        "--route-decode-weight",
        "decode_weight",
        float,
        "cost per token held by a rank's decoding requests",
    ),
    Tunable(
        "--route-offloaded-hit-weight",
        "offloaded_hit_weight",
        float,
        "share of a block's prefill that a CPU/disk-tier copy saves, in [0, 1]",
    ),
    Tunable(
        "--route-hot-spill-requests",
        "hot_spill_requests",
        int,
        "in-flight requests a rank may run above the least busy one before the kv policy "
        "spills a hot prefix elsewhere",
    ),
    Tunable(
        "--route-recent-weight",
        "recent_weight",
        float,
        "cost per prompt token a rank prefilled lately, so that idle-looking ranks between "
        "turns still count the conversations they serve (0: only in-flight work counts)",
    ),
    Tunable(
        "--route-recent-half-life",
        "recent_half_life",
        float,
        "seconds over which a rank's recent prefill work fades by half",
    ),
    Tunable(
        "--route-share-weight",
        "share_weight",
        float,
        "cost per request a rank was sent lately beyond the slack above the ranks' mean, in "
        "prompt tokens: "
        "spreads a hot prefix to more ranks before its first saturates (0: off)",
    ),
    Tunable(
        "--route-share-half-life",
        "share_half_life",
        float,
        "seconds over which the requests a rank was sent lately fade by half",
    ),
    Tunable(
        "--route-share-slack",
        "share_slack",
        float,
        "requests a rank may have been sent lately above the ranks' mean before the share "
        "term counts them",
    ),
    Tunable(
        "--route-affinity-entries",
        "affinity_entries",
        int,
        "conversations named by clients (prompt_cache_key, Responses chains, the affinity "
        "header) whose last rank the kv policy remembers (0: ignore them)",
    ),
    Tunable(
        "--route-affinity-ttl",
        "affinity_ttl",
        float,
        "seconds a named conversation's rank is remembered after its last request",
    ),
    Tunable(
        "--route-predict-ttl",
        "predict_ttl",
        float,
        "seconds a routed prompt is believed cached on its rank when vLLM publishes no KV events",
    ),
    Tunable(
        "--route-pending-ttl",
        "pending_ttl",
        float,
        "seconds a routed prompt counts as cached while its KV events are on their way "
        "(0: trust events alone)",
    ),
    Tunable(
        "--route-offload-index-factor",
        "offload_index_factor",
        float,
        "offloaded-tier index entries per rank, as a multiple of its device KV blocks",
    ),
    Tunable(
        "--image-token-id",
        "image_token_id",
        _optional_int,
        "the model's image placeholder token id, which places images in prompts for routing; "
        "None: the tokenizer's own image placeholder token",
    ),
    Tunable(
        "--kv-replay-timeout",
        "replay_timeout",
        float,
        "seconds to wait for a KV-event replay before purging the rank's index",
        intake=True,
    ),
    Tunable(
        "--kv-max-held-batches",
        "max_held_batches",
        int,
        "live KV-event batches held back per rank while a replay fills a gap",
        intake=True,
    ),
    Tunable(
        "--kv-coalesce",
        "coalesce",
        float,
        "seconds the KV-event thread lets batches gather after a wake-up with work (0: none)",
        intake=True,
    ),
    Tunable(
        "--kv-burst",
        "burst",
        int,
        "KV-event messages drained per rank per turn, so one busy rank cannot starve others",
        intake=True,
    ),
    Tunable(
        "--kv-receive-hwm",
        "receive_hwm",
        int,
        "ZMQ receive high-water mark of each KV-event subscriber, in messages",
        intake=True,
    ),
    Tunable(
        "--kv-max-batch-bytes",
        "max_batch_bytes",
        int,
        "largest KV-event message taken in; a larger one drops the publisher's connection",
        intake=True,
    ),
)


def add_routing_arguments(parser: argparse.ArgumentParser, env: EnvReader) -> None:
    """One flag per tunable, in a ``routing`` group of ``--help``, defaults shown."""
    group = parser.add_argument_group(
        "routing", "how --policy kv (and load) weigh ranks; RANKGATE_<FLAG> works for each"
    )
    defaults = RoutingConfig()
    for tunable in TUNABLES:
        source: Any = defaults.intake if tunable.intake else defaults
        default = getattr(source, tunable.field)
        group.add_argument(
            tunable.flag,
            dest=tunable.dest,
            type=tunable.convert,
            metavar=tunable.convert.__name__.upper() if tunable.convert in (int, float) else "ID",
            default=env(tunable.flag.removeprefix("--"), default, tunable.convert),
            help=f"{tunable.help} (default: %(default)s)",
        )


def routing_from_args(args: argparse.Namespace, policy: str) -> RoutingConfig:
    """The validated config; raises ValueError naming the bad flag's field."""
    top: dict[str, Any] = {"policy": policy}
    intake: dict[str, Any] = {}
    for tunable in TUNABLES:
        (intake if tunable.intake else top)[tunable.field] = getattr(args, tunable.dest)
    try:
        return RoutingConfig(intake=IntakeSettings(**intake), **top)
    except (ValueError, TypeError, msgspec.ValidationError) as exc:
        text = str(exc)
        flags = [t.flag for t in TUNABLES if text.startswith(t.field + " ")]
        raise ValueError(f"{flags[0]}: {text}" if flags else f"routing: {text}") from None
