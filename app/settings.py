"""The gateway's configuration, one typed value built from CLI flags and ``RANKGATE_*`` env."""

from __future__ import annotations

from dataclasses import dataclass, field

from multimodal.types import MediaConfig


@dataclass(frozen=True, kw_only=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # vLLM gRPC endpoint; None starts the bundled mock engine in-process.
    engine: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    policy: str = "kv"
    log_level: str = "info"
    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    startup_timeout: float = 600.0
    access_log: bool = False
    # "text" or "json" (``--log-format``).
    log_format: str = "text"
    # Gateway processes on one port (``--workers``); each runs its own sidecar.
    workers: int = 1
    # The embedded mock engine's timing: 0 = zero latency, 1 = GPU-like.
    mock_speed: float = 1.0
    # Image fetching, validation and identity limits (``--media-mode`` and the image flags).
    media: MediaConfig = field(default_factory=MediaConfig)
