"""What a preparer needs besides the decoded body: the request as the engine and the router
know it, settled by the route from the request's head, its record and the model it names."""

from __future__ import annotations

import msgspec

from rankgate.sidecar import RequestTrace


class PrepareContext(msgspec.Struct, frozen=True, kw_only=True):
    """A Struct, not a frozen dataclass: one is made per request (see
    :class:`rankgate.app.respond.context.ResponseContext`)."""

    # The id vLLM sees (a batch's prompts add their index to it).
    request_id: str
    # The adapter the model name stands for, if it is one.
    lora_name: str | None
    max_model_len: int
    # The header's rank pin; the body's ``data_parallel_rank`` must agree with it.
    rank: int | None = None
    trace: RequestTrace | None = None
    # Bytes of the request (the body, and a stored conversation it continues): whether the
    # work is done off the event loop.
    body_size: int = 0
    # The router's affinity key (:mod:`rankgate.app.edge.affinity`).
    affinity: str | None = None
