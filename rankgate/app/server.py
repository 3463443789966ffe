"""The FastAPI application: routes, error handlers, OpenAPI, and the engine's lifecycle.

Startup waits for the engine (vLLM, or the bundled mock when no ``--engine`` is given) to be
discovered, then loads the tokenizer its model id names; failures stop the process with a
message saying what to fix, instead of serving a gateway that can only answer 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from rankgate import __version__
from rankgate.app.config.settings import GatewaySettings
from rankgate.app.edge.auth import install_access
from rankgate.app.errors import install_error_handlers
from rankgate.app.gateway import Engine, Gateway, ServingOptions
from rankgate.app.observability.admission import AdmissionCollector
from rankgate.app.observability.logs import AccessLog
from rankgate.app.observability.metrics import EngineProbe, GatewayMetrics
from rankgate.app.observability.record import RequestObserver
from rankgate.app.prepare.media import MediaHook
from rankgate.app.response_store import ResponseStore
from rankgate.app.routes import chat, completions, models, ops, responses, tokenize
from rankgate.app.schemas.openapi import install_openapi
from rankgate.app.serving.clients import ClientWatch
from rankgate.app.serving.demo import demo_engines
from rankgate.app.serving.gc_tuning import tune_after_startup
from rankgate.app.serving.shutdown import Shutdown
from rankgate.app.state import GatewayApp, GatewayState
from rankgate.app.tokens.tokenizer import TokenizerNotFound, locate_tokenizer
from rankgate.multimodal import MediaPreparer
from rankgate.sidecar import (
    Admission,
    EngineInfo,
    SharedLoadBoard,
    SidecarError,
    routing_metrics,
)

if TYPE_CHECKING:
    from rankgate.app.observability.tracing import Tracing
    from rankgate.sidecar import DisaggregatedEngine, Router, Sidecar

log = logging.getLogger(__name__)


# The POST routes served past FastAPI's routing (rankgate.app.serving.fastpath).
HOT_ROUTES = (chat.ROUTE, completions.ROUTE, responses.ROUTE)


def create_app(
    settings: GatewaySettings,
    *,
    engine: Engine | None = None,
    media: MediaHook | None = None,
    shared_load: SharedLoadBoard | None = None,
    prefill_load: SharedLoadBoard | None = None,
    tracing: Tracing | None = None,
) -> GatewayApp:
    """Build the app; ``engine`` replaces the sidecar (tests), which is then not started here.

    ``shared_load`` is this worker's row of the per-rank load board (``--workers`` > 1), and
    ``prefill_load`` of the prefill engine's under disaggregated serving;
    ``tracing`` replaces the OTLP tracer that ``otlp_traces_endpoint`` would build.
    """
    if tracing is None and settings.otlp_traces_endpoint:
        tracing = _tracing(settings.otlp_traces_endpoint)
    registry = CollectorRegistry()
    # Under disaggregated serving every routing series says which side's rank it is about.
    routing_metrics(registry, sided=settings.split_serving)
    state = _state(settings, registry, tracing, demo=engine is None and settings.demo)
    lifespan = _Lifespan(settings, state, engine, media, shared_load, prefill_load)
    app = GatewayApp(
        state,
        title="Rankgate",
        version=__version__,
        description="OpenAI-compatible gateway in front of vLLM with KV-cache-aware DP routing.",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    registry.register(AdmissionCollector(lambda: _admission_of(state)))
    install_error_handlers(app)
    _install_routes(app, settings)
    return app


def _install_routes(app: GatewayApp, settings: GatewaySettings) -> None:
    """The routes, then the middleware in front of them: client liveness outside the fast
    path, so that it watches the hot routes too, and API keys and CORS outside both."""
    hot = app.serve_directly(HOT_ROUTES)
    for module in (responses, tokenize, models, ops):
        app.include_router(module.router)
    app.add_middleware(ClientWatch, paths=hot, stall_timeout=settings.stream_stall_timeout)
    install_access(app, settings.access)
    install_openapi(app, reject_unknown_fields=settings.limits.reject_unknown_fields)


@dataclass(frozen=True, slots=True)
class _Lifespan:
    """The app's lifespan: nothing is served until the engine is discovered and its tokenizer
    loaded, a failure to do either is logged and stops the process, and shutdown flushes the
    metrics and spans still held."""

    settings: GatewaySettings
    state: GatewayState
    engine: Engine | None
    media: MediaHook | None
    shared_load: SharedLoadBoard | None
    prefill_load: SharedLoadBoard | None

    @asynccontextmanager
    async def __call__(self, app: FastAPI) -> AsyncIterator[None]:
        state = self.state
        async with AsyncExitStack() as stack:
            try:
                await self._start(stack)
            except (TokenizerNotFound, SidecarError, ValueError, OSError) as exc:
                log.error("startup failed: %s", getattr(exc, "message", None) or exc)
                raise
            try:
                yield
            finally:
                state.metrics.watch_engine(None)
                state.metrics.flush()
                state.gateway = None
                if state.tracing is not None:
                    # Flushes the spans still queued for export.
                    await asyncio.to_thread(state.tracing.shutdown)

    async def _start(self, stack: AsyncExitStack) -> None:
        settings, state = self.settings, self.state
        if settings.tokenizer is not None:
            # Fail before starting anything when the operator's path is wrong.
            locate_tokenizer(settings.tokenizer, "")
        options = _options(settings)
        serving = self.engine
        if serving is None:
            serving = await _start_sidecar(
                settings, state.registry, options, stack, self.shared_load, self.prefill_load
            )
        hook = self.media
        if hook is None:
            preparer = MediaPreparer(settings.media)
            stack.push_async_callback(preparer.aclose)
            hook = preparer
        state.gateway = await asyncio.to_thread(Gateway, serving, options, hook)
        if self.engine is None:
            # Queued requests get 503; pre-empted engine streams end with an error event, not
            # a cut.
            state.shutdown.on_expiry(serving.close)
        state.metrics.watch_engine(_engine_probe(serving))
        state.metrics.answer_flushes(asyncio.get_running_loop())
        tune_after_startup()


def _options(settings: GatewaySettings) -> ServingOptions:
    return ServingOptions(
        tokenizer=settings.tokenizer,
        chat_template=settings.chat_template,
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
        image_token_id=settings.routing.image_token_id,
        limits=settings.limits,
    )


def _state(
    settings: GatewaySettings,
    registry: CollectorRegistry,
    tracing: Tracing | None,
    *,
    demo: bool,
) -> GatewayState:
    metrics = GatewayMetrics(registry)
    metrics.expose_process()
    header = (settings.affinity_header or "").strip().lower()
    return GatewayState(
        registry=registry,
        metrics=metrics,
        observer=RequestObserver(metrics, AccessLog() if settings.access_log else None),
        limits=settings.limits,
        responses=ResponseStore(settings.responses_store, workers=settings.workers),
        shutdown=Shutdown(settings.shutdown_grace),
        started_at=int(time.time()),
        # The bundled mock engine, not a vLLM: /v1/models says so.
        demo=demo,
        affinity_header=header.encode("latin-1") if header else None,
        tracing=tracing,
    )


def _tracing(endpoint: str) -> Tracing:
    try:
        from rankgate.app.observability.tracing import Tracing
    except ImportError as exc:
        raise ValueError(
            f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'rankgate[tracing]' ({exc})"
        ) from None
    return Tracing.to_endpoint(endpoint)


async def _start_sidecar(
    settings: GatewaySettings,
    registry: CollectorRegistry,
    options: ServingOptions,
    stack: AsyncExitStack,
    shared_load: SharedLoadBoard | None,
    prefill_load: SharedLoadBoard | None = None,
) -> Engine:
    from rankgate.sidecar import DisaggMetrics, DisaggregatedEngine, build_router, routing_for

    settings = await asyncio.to_thread(stack.enter_context, demo_engines(settings))
    routing = settings.routing_config()
    serving: Sidecar | DisaggregatedEngine
    if settings.prefill_engine is not None and settings.decode_engine is not None:
        # Each side has its own router, load board and ``side`` label (rank ids repeat).
        routing = routing_for(routing)
        prefill = build_router(routing, registry, prefill_load, side="prefill")
        decode = build_router(routing, registry, shared_load, side="decode")
        serving = DisaggregatedEngine(
            _sidecar(settings, settings.prefill_engine, prefill),
            _sidecar(settings, settings.decode_engine, decode),
            settings.disagg,
            DisaggMetrics(registry),
        )
    else:
        assert settings.engine is not None  # demo_engines filled it in when it was not given
        serving = _sidecar(settings, settings.engine, build_router(routing, registry, shared_load))
    await serving.start()
    stack.push_async_callback(serving.close)
    return serving


def _sidecar(settings: GatewaySettings, endpoint: str, router: Router) -> Sidecar:
    from rankgate.sidecar import Sidecar, SidecarConfig

    config = SidecarConfig(
        endpoint=endpoint,
        startup_timeout=settings.startup_timeout,
        served_model_name=settings.served_model_name,
        health_interval=settings.health_interval,
        decode_handoff_timeout=settings.decode_handoff_timeout,
    )
    return Sidecar(config, router, Admission(settings.admission, settings.workers))


def _admission_of(state: GatewayState) -> Admission | None:
    """The serving engine's admission, when it has one (an injected test engine may not)."""
    gateway = state.gateway
    return gateway.engine.admission if gateway is not None else None


def _engine_probe(engine: Engine) -> EngineProbe:
    def probe() -> tuple[bool, EngineInfo | None]:
        ready = engine.ready
        return ready, engine.info if ready else None

    return probe
