"""The gateway's configuration, one typed value built from CLI flags and ``RANKGATE_*`` env."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from rankgate.app.edge.auth import AccessConfig
from rankgate.app.edge.limits import InputLimits
from rankgate.app.response_store import StoreLimits
from rankgate.app.serving.connections import ConnectionLimits
from rankgate.multimodal import MediaConfig
from rankgate.sidecar import AdmissionConfig, DisaggConfig, RoutingConfig


@dataclass(frozen=True, kw_only=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # vLLM gRPC endpoint; None starts the bundled mock engine in-process.
    engine: str | None = None
    # Disaggregated serving: prefill on one vLLM frontend, decode on another (both or neither).
    # ``disaggregated`` without them starts a bundled prefill/decode pair of mock engines.
    prefill_engine: str | None = None
    decode_engine: str | None = None
    disaggregated: bool = False
    # Refuse to start without an engine rather than serve the bundled demo (the container).
    require_engine: bool = False
    # The engine endpoints are the bundled demo engines' (set by
    # rankgate.app.serving.demo.demo_engines).
    demo_engines: bool = False
    # Seconds a decode request whose client left is still read for its first token.
    decode_handoff_timeout: float = 30.0
    # Disaggregated serving: where each prefill runs, and how long held KV is trusted.
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
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
    # Hardening: body limits, API keys and CORS, admission control, client liveness, shutdown.
    limits: InputLimits = field(default_factory=InputLimits)
    # HTTP connections: header size and count, header/body/keep-alive timeouts, a cap.
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    access: AccessConfig = field(default_factory=AccessConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # Seconds a stream's client may stop reading before the stream is cut; 0 never cuts.
    stream_stall_timeout: float = 30.0
    # Seconds in-flight requests get after SIGTERM before they are ended with an error.
    shutdown_grace: float = 30.0
    # How often the engine's health is checked (readiness, re-discovery after a restart).
    health_interval: float = 1.0
    # A request header whose value names the client's conversation (e.g. ``x-session-id``):
    # the router keeps its turns together, as with ``prompt_cache_key``. None: no header.
    affinity_header: str | None = None
    # OTLP endpoint for OpenTelemetry traces (vLLM's ``--otlp-traces-endpoint``); None: off.
    otlp_traces_endpoint: str | None = None
    # Stored responses (``store: true`` on /v1/responses): bounds of the in-memory store.
    responses_store: StoreLimits = field(default_factory=StoreLimits)
    # Routing tunables (the ``routing`` flags); ``policy`` above selects the policy itself.
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    def routing_config(self) -> RoutingConfig:
        """The router's config: the tunables with ``policy`` applied (validated again)."""
        return msgspec.structs.replace(self.routing, policy=self.policy)

    def __post_init__(self) -> None:
        split = (self.prefill_engine is not None, self.decode_engine is not None)
        if any(split) and not all(split):
            raise ValueError(
                "--prefill-engine and --decode-engine go together: disaggregated serving needs "
                "both endpoints"
            )
        if self.engine is not None and (any(split) or self.disaggregated):
            raise ValueError(
                "--engine (one aggregated engine) cannot be combined with --prefill-engine, "
                "--decode-engine or --disaggregated"
            )
        if self.require_engine and self.demo:
            raise ValueError(
                "no engine to serve: set RANKGATE_ENGINE (--engine) to vLLM's gRPC HOST:PORT, or "
                "RANKGATE_PREFILL_ENGINE and RANKGATE_DECODE_ENGINE; RANKGATE_REQUIRE_ENGINE "
                "(--require-engine, set in the container image) refuses the bundled demo engine"
            )
        if self.decode_handoff_timeout < 0:
            raise ValueError("--decode-handoff-timeout must be >= 0")

    @property
    def demo(self) -> bool:
        """The bundled mock engine (or mock pair) serves made-up text: no engine was given,
        or the ones named are the demo's (:func:`rankgate.app.serving.demo.demo_engines`)."""
        return self.demo_engines or (self.engine is None and self.prefill_engine is None)

    @property
    def split_serving(self) -> bool:
        """Prefill and decode on separate engines (given ones, or the bundled mock pair)."""
        return self.disaggregated or self.prefill_engine is not None
