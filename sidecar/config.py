"""How the sidecar reaches and watches one vLLM frontend; built once from CLI flags or env."""

from __future__ import annotations

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
