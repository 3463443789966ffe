"""How the sidecar reaches and watches one vLLM frontend; built once from CLI flags or env."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

# The bound on each Control-plane call (discovery, abort, adapter listing).
CONTROL_RPC_TIMEOUT_S = 10.0


class SidecarConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Connection and lifecycle knobs.

    ``served_model_name`` renames the model towards clients only: vLLM is always addressed by the
    name it reports itself, which then stays accepted as an alias.

    ``decode_handoff_timeout`` bounds how long a disaggregated decode request whose client left
    is still read for its first token, so the KV transfer it started can complete (and, on the
    decode side's config, how long an aborted prefill is read for its end).
    """

    endpoint: str
    tls_ca_file: str | None = None
    startup_timeout: float = 600.0
    retry_interval: float = 0.5
    health_interval: float = 1.0
    num_channels: int = 2
    served_model_name: str | None = None
    decode_handoff_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.startup_timeout <= 0:
            raise ValueError("startup_timeout must be positive")
        if self.retry_interval <= 0:
            raise ValueError("retry_interval must be positive")
        if self.health_interval <= 0:
            raise ValueError("health_interval must be positive")
        if not 1 <= self.num_channels <= 64:
            raise ValueError("num_channels must be between 1 and 64")
        if self.decode_handoff_timeout < 0:
            raise ValueError("decode_handoff_timeout must be >= 0")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")


PrefillMode = Literal["auto", "remote", "local"]
PREFILL_MODES: tuple[PrefillMode, ...] = ("auto", "remote", "local")


class DisaggConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How disaggregated serving places each prefill and how long it trusts held KV.

    ``prefill_mode`` ``auto`` decides per request between a remote prefill (prefill engine,
    then a KV transfer) and a local one (the decode engine prefills itself), from what each
    would cost; ``remote`` and ``local`` pin one. A prompt whose uncached part on the decode
    side is at most ``local_prefill_tokens`` is prefilled there: a short prompt costs the
    decode batch about one step, while the remote path adds a second queue, a transfer and
    a second scheduling. Longer ones go remote unless the decode side's uncached tokens,
    weighed ``local_prefill_weight`` times (a long local prefill stalls the decodes sharing
    its rank), cost less than the prefill side's uncached and queued tokens plus the
    transfer (``transfer_token_cost`` per token pulled).

    ``seed_first_token`` sends a streaming client the remote prefill's token (sampled as the
    client asked) as its first, before the decode starts (``rankgate.sidecar.pd_seed``).

    ``kv_lease`` is how long the prefill engine keeps a finished prefill's KV for its decode
    (vLLM's ``kv_lease_duration``): a decode that has not produced its first token by then,
    less a margin (:attr:`trust_window`), is not answered from that KV.
    """

    MODES: ClassVar[tuple[PrefillMode, ...]] = PREFILL_MODES

    prefill_mode: PrefillMode = "auto"
    local_prefill_tokens: int = 256
    local_prefill_weight: float = 2.0
    transfer_token_cost: float = 0.1
    kv_lease: float = 30.0
    seed_first_token: bool = True

    def __post_init__(self) -> None:
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {', '.join(PREFILL_MODES)}")
        if self.local_prefill_tokens < 0:
            raise ValueError("local_prefill_tokens must be >= 0")
        if self.local_prefill_weight <= 0 or self.transfer_token_cost < 0:
            raise ValueError("local_prefill_weight must be > 0 and transfer_token_cost >= 0")
        if self.kv_lease <= 0:
            raise ValueError("kv_lease must be positive")

    @property
    def trust_window(self) -> float:
        """Seconds after the gateway sees a prefill finish that its KV is surely still held:
        the lease less a tenth (at most a second) for the time between the engine finishing
        and the gateway reading its reply."""
        return self.kv_lease - min(1.0, 0.1 * self.kv_lease)
