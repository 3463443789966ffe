"""Every routing tunable, validated once when built (the CLI's routing flags fill it)."""

from __future__ import annotations

from typing import Literal

import msgspec

from rankgate.sidecar.routing.events import IntakeSettings

PolicyName = Literal["kv", "load", "round_robin", "engine"]
POLICIES: tuple[PolicyName, ...] = ("kv", "load", "round_robin", "engine")


class RoutingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Every routing tunable; validated once when built."""

    policy: PolicyName = "kv"
    # Cost weights, in prompt-token units (Dynamo's defaults: both 1; see policies.kv).
    prefill_weight: float = 1.0
    decode_weight: float = 0.1
    # Prompt tokens of one decoding request that the decode term counts, at most (0: all). A
    # running sequence costs a step mostly as a sequence, not per token of its context; counted
    # in full, a rank decoding a few agent contexts of 30k-60k tokens looks busier than one
    # running dozens of short chats, and the next turn of a session leaves the rank holding
    # its history to compute it again elsewhere (``bench/routing_simulation.py --agents``).
    decode_tokens_cap: int = 8192
    # What a token of prefill already queued on a rank weighs against a token of the request's
    # own uncached prompt. Below 1: the queue's head is partly done when the request arrives,
    # and going elsewhere to skip it recomputes a prefix, work every later request then waits
    # behind (``bench/routing_simulation.py --long``: routed at 1, a third to three fifths more
    # prefill than the cache-greedy rule, and first tokens up to a quarter later).
    queue_weight: float = 0.5
    # Cost per prompt token another rank holds that this one would compute again by evicting
    # blocks of its full cache, some of which someone then computes again in turn (at 0.5,
    # half of them; 1 did no better). Under KV pressure with long prompts a departure from the
    # rank holding a prompt, right for its own first token, otherwise cost everyone behind it
    # (``bench/routing_simulation.py --long --kv-blocks 4096``); a rank with room pays nothing.
    copy_weight: float = 0.5
    # Share of a block's prefill an offloaded (CPU/disk) copy saves.
    offloaded_hit_weight: float = 0.5
    # In-flight requests a rank may run above the least busy one before it is skipped.
    hot_spill_requests: int = 8
    # Cost per prompt token a rank prefilled lately, fading by half every ``recent_half_life``
    # seconds (0: only what is in flight counts).
    recent_weight: float = 0.1
    recent_half_life: float = 2.0
    # Cost per request a rank was sent lately beyond ``share_slack`` standard deviations above
    # the ranks' mean (counts taken as Poisson: the deviation is the mean's square root),
    # fading by half every ``share_half_life`` seconds (0: off): what spreads a hot prefix
    # before its rank saturates. The slack keeps chance and a handful of requests from
    # counting as hot.
    share_weight: float = 300.0
    share_half_life: float = 10.0
    share_slack: float = 1.0
    # Learning each rank's speed from its first tokens (:class:`~rankgate.sidecar.routing.load.
    # RankPace`): the share of a rank's past samples each new one keeps (0: every rank is
    # taken as equally fast), the prompt tokens a request's engine steps count as, and how
    # far from the median rank's pace a rank must be to count as slower or faster. Costs on a
    # slow rank are its work in time, and its fair share of requests shrinks with its speed.
    pace_keep: float = 0.97
    pace_offset_tokens: float = 256.0
    pace_band: float = 0.2
    # Conversations named by the client (``PreparedRequest.affinity``) remembered, and for how
    # many seconds after their last request (0 entries: affinity keys are ignored).
    affinity_entries: int = 100_000
    affinity_ttl: float = 600.0
    # Seconds a routed prompt is believed cached on its rank: without KV events, and while
    # waiting for the events of a prompt just routed (0: trust the events alone).
    predict_ttl: float = 120.0
    pending_ttl: float = 5.0
    # Offloaded-tier index entries allowed per rank, as a multiple of its device blocks.
    offload_index_factor: float = 4.0
    # The model's image placeholder token id, used to find each image in a token prompt when
    # the request does not give ``MediaInput.position``; with neither, prompts with images are
    # matched on none of their blocks.
    image_token_id: int | None = None
    # Checking predictions against the KV events (:mod:`rankgate.sidecar.routing.regret`): seconds a
    # finished prefill's events are awaited, block keys watched at once (0: off), seconds
    # between two requests measured on one rank (0: every request), and untrue predictions in
    # a row before a rank is routed by load alone (true ones to trust it again).
    regret_settle: float = 1.0
    regret_keys: int = 262_144
    regret_interval: float = 0.01
    trust_strikes: int = 3
    # A file the KV index is saved to when the gateway stops and loaded from when it starts
    # beside the same engine, if younger than ``index_max_age`` seconds (None: not saved).
    index_file: str | None = None
    index_max_age: float = 600.0
    intake: IntakeSettings = IntakeSettings()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose from {POLICIES}")
        if self.prefill_weight < 0:
            raise ValueError("prefill_weight must be >= 0")
        if self.queue_weight < 0:
            raise ValueError("queue_weight must be >= 0")
        if self.decode_weight < 0:
            raise ValueError("decode_weight must be >= 0")
        if self.decode_tokens_cap < 0:
            raise ValueError("decode_tokens_cap must be >= 0")
        if self.copy_weight < 0:
            raise ValueError("copy_weight must be >= 0")
        if not 0.0 <= self.offloaded_hit_weight <= 1.0:
            raise ValueError("offloaded_hit_weight must lie in [0, 1]")
        if self.hot_spill_requests < 1:
            raise ValueError("hot_spill_requests must be at least 1")
        if self.recent_weight < 0:
            raise ValueError("recent_weight must be >= 0")
        if self.recent_half_life <= 0:
            raise ValueError("recent_half_life must be positive")
        if self.share_weight < 0:
            raise ValueError("share_weight must be >= 0")
        if self.share_half_life <= 0:
            raise ValueError("share_half_life must be positive")
        if self.share_slack < 0:
            raise ValueError("share_slack must be >= 0")
        if not 0.0 <= self.pace_keep < 1.0:
            raise ValueError("pace_keep must lie in [0, 1)")
        if self.pace_offset_tokens < 0 or self.pace_band < 0:
            raise ValueError("pace_offset_tokens and pace_band must be >= 0")
        if self.affinity_entries < 0:
            raise ValueError("affinity_entries must be >= 0")
        if self.affinity_ttl <= 0:
            raise ValueError("affinity_ttl must be positive")
        if self.predict_ttl <= 0:
            raise ValueError("predict_ttl must be positive")
        if self.pending_ttl < 0:
            raise ValueError("pending_ttl must be >= 0")
        if self.offload_index_factor < 0:
            raise ValueError("offload_index_factor must be >= 0")
        if self.image_token_id is not None and self.image_token_id < 0:
            raise ValueError("image_token_id must be >= 0")
        if self.regret_settle <= 0:
            raise ValueError("regret_settle must be positive")
        if self.regret_keys < 0:
            raise ValueError("regret_keys must be >= 0")
        if not 0 <= self.regret_interval <= 60:
            raise ValueError("regret_interval must be between 0 and 60 seconds")
        if self.trust_strikes < 1:
            raise ValueError("trust_strikes must be at least 1")
        if self.index_max_age <= 0:
            raise ValueError("index_max_age must be positive")
