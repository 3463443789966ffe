"""``rankgate serve`` flags for every routing tunable (``RoutingConfig`` and its KV-event intake).

The policy itself is ``--policy``; everything here shapes how the ``kv`` policy (and, for the
cost weights and the capacity guard, ``load``) decides. Each flag sets the ``RoutingConfig``
field it names, reads ``RANKGATE_<FLAG>`` from the environment like every flag, and is
validated once by ``RoutingConfig`` itself, so a bad knob stops the gateway at startup with the
field's own message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rankgate.app.config.flags import Flag

GROUP = "routing: how --policy kv (and load) weigh ranks; RANKGATE_<FLAG> works for each"


def _optional_int(text: str) -> int | None:
    lowered = text.strip().lower()
    if lowered in ("", "none", "auto"):
        return None
    return int(text)


def _tunable(
    flag: str,
    field: str,
    convert: Callable[[str], Any],
    help: str,
    intake: bool = False,
    metavar: str = "ID",
) -> Flag:
    """A flag for a ``RoutingConfig`` field (``intake``: of its ``intake`` settings)."""
    return Flag(
        flag,
        f"routing.intake.{field}" if intake else f"routing.{field}",
        f"{help} (default: %(default)s)",
        convert,
        metavar=convert.__name__.upper() if convert in (int, float) else metavar,
        group=GROUP,
    )


ROUTING_FLAGS: tuple[Flag, ...] = (
    _tunable(
        "--route-prefill-weight",
        "prefill_weight",
        float,
        "cost per prompt token a rank still has to prefill (its queue's at --route-queue-weight)",
    ),
    _tunable(
        "--route-queue-weight",
        "queue_weight",
        float,
        "what a token of prefill queued on a rank weighs against one of the request's own "
        "uncached prompt (below 1: a cached prefix is worth waiting for)",
    ),
    _tunable(
        "--route-copy-weight",
        "copy_weight",
        float,
        "cost per prompt token another rank holds that this one would compute again by "
        "evicting blocks of its full cache (0: off)",
    ),
    _tunable(
        "--route-decode-weight",
        "decode_weight",
        float,
        "cost per token held by a rank's decoding requests",
    ),
    _tunable(
        "--route-decode-tokens-cap",
        "decode_tokens_cap",
        int,
        "prompt tokens of one decoding request that --route-decode-weight counts, at most (0: all)",
    ),
    _tunable(
        "--route-offloaded-hit-weight",
        "offloaded_hit_weight",
        float,
        "share of a block's prefill that a CPU/disk-tier copy saves, in [0, 1]",
    ),
    _tunable(
        "--route-hot-spill-requests",
        "hot_spill_requests",
        int,
        "in-flight requests a rank may run above the least busy one before the kv policy "
        "spills a hot prefix elsewhere",
    ),
    _tunable(
        "--route-recent-weight",
        "recent_weight",
        float,
        "cost per prompt token a rank prefilled lately, so that idle-looking ranks between "
        "turns still count the conversations they serve (0: only in-flight work counts)",
    ),
    _tunable(
        "--route-recent-half-life",
        "recent_half_life",
        float,
        "seconds over which a rank's recent prefill work fades by half",
    ),
    _tunable(
        "--route-share-weight",
        "share_weight",
        float,
        "cost per request a rank was sent lately beyond the slack above the ranks' mean, in "
        "prompt tokens: "
        "spreads a hot prefix to more ranks before its first saturates (0: off)",
    ),
    _tunable(
        "--route-share-half-life",
        "share_half_life",
        float,
        "seconds over which the requests a rank was sent lately fade by half",
    ),
    _tunable(
        "--route-share-slack",
        "share_slack",
        float,
        "requests a rank may have been sent lately above the ranks' mean before the share "
        "term counts them",
    ),
    _tunable(
        "--route-pace-keep",
        "pace_keep",
        float,
        "share of a rank's past first-token samples each new one keeps when learning its "
        "speed (0: every rank is taken as equally fast)",
    ),
    _tunable(
        "--route-pace-offset-tokens",
        "pace_offset_tokens",
        float,
        "prompt tokens a request's engine steps count as when learning a rank's speed",
    ),
    _tunable(
        "--route-pace-band",
        "pace_band",
        float,
        "how far from the median rank's learned pace a rank must be to count as slower or "
        "faster, as a fraction of it",
    ),
    _tunable(
        "--route-affinity-entries",
        "affinity_entries",
        int,
        "conversations named by clients (prompt_cache_key, Responses chains, the affinity "
        "header) whose last rank the kv policy remembers (0: ignore them)",
    ),
    _tunable(
        "--route-affinity-ttl",
        "affinity_ttl",
        float,
        "seconds a named conversation's rank is remembered after its last request",
    ),
    _tunable(
        "--route-predict-ttl",
        "predict_ttl",
        float,
        "seconds a routed prompt is believed cached on its rank when vLLM publishes no KV events",
    ),
    _tunable(
        "--route-pending-ttl",
        "pending_ttl",
        float,
        "seconds a routed prompt counts as cached while its KV events are on their way "
        "(0: trust events alone)",
    ),
    _tunable(
        "--route-offload-index-factor",
        "offload_index_factor",
        float,
        "offloaded-tier index entries per rank, as a multiple of its device KV blocks",
    ),
    _tunable(
        "--image-token-id",
        "image_token_id",
        _optional_int,
        "the model's image placeholder token id, which places images in prompts for routing; "
        "None: the tokenizer's own image placeholder token",
    ),
    _tunable(
        "--route-regret-settle",
        "regret_settle",
        float,
        "seconds a finished prefill's KV events are awaited before its rank's prediction is "
        "checked against them",
    ),
    _tunable(
        "--route-regret-keys",
        "regret_keys",
        int,
        "prompt block keys watched at once to check predictions against KV events (0: off)",
    ),
    _tunable(
        "--route-regret-interval",
        "regret_interval",
        float,
        "seconds between two requests whose prediction is checked on one rank; the others "
        "in between go unmeasured (0: every request)",
    ),
    _tunable(
        "--route-trust-strikes",
        "trust_strikes",
        int,
        "untrue predictions in a row before a rank is routed by load alone, and true ones "
        "before it is trusted again",
    ),
    _tunable(
        "--route-index-file",
        "index_file",
        str,
        "a file the KV index is saved to when the gateway stops and loaded from when it starts "
        "beside the same engine, so a restarted gateway routes on the caches at once (none: "
        "not saved)",
        metavar="PATH",
    ),
    _tunable(
        "--route-index-max-age",
        "index_max_age",
        float,
        "seconds a saved KV index stays usable",
    ),
    _tunable(
        "--kv-replay-timeout",
        "replay_timeout",
        float,
        "seconds to wait for a KV-event replay before purging the rank's index",
        intake=True,
    ),
    _tunable(
        "--kv-max-held-batches",
        "max_held_batches",
        int,
        "live KV-event batches held back per rank while a replay fills a gap",
        intake=True,
    ),
    _tunable(
        "--kv-coalesce",
        "coalesce",
        float,
        "seconds the KV-event thread lets batches gather after a wake-up with work (0: none)",
        intake=True,
    ),
    _tunable(
        "--kv-burst",
        "burst",
        int,
        "KV-event messages drained per rank per turn, so one busy rank cannot starve others",
        intake=True,
    ),
    _tunable(
        "--kv-receive-hwm",
        "receive_hwm",
        int,
        "ZMQ receive high-water mark of each KV-event subscriber, in messages",
        intake=True,
    ),
    _tunable(
        "--kv-max-batch-bytes",
        "max_batch_bytes",
        int,
        "largest KV-event message taken in; a larger one drops the publisher's connection",
        intake=True,
    ),
)
