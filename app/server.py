"""The FastAPI application: routes, error handlers, OpenAPI, and the engine's lifecycle.

Startup waits for the engine (vLLM, or the bundled mock when no ``--engine`` is given) to be
discovered, then loads the tokenizer its model id names; failures stop the process with a
message saying what to fix, instead of serving a gateway that can only answer 503.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from app import __version__
from app.access_log import AccessLog
from app.admission import AdmissionCollector
from app.auth import install_access
from app.clients import ClientWatch
from app.errors import install_error_handlers
from app.fastpath import FastPath, FastPathApp
from app.gateway import Engine, Gateway, ServingOptions
from app.metrics import EngineProbe, GatewayMetrics
from app.observe import RequestObserver
from app.prepare.media import MediaHook
from app.prepare.tokenizer import TokenizerNotFound, locate_tokenizer
from app.routes import chat, completions, models, ops
from app.schemas.openapi import install_openapi
from app.settings import GatewaySettings
from app.shutdown import Shutdown
from multimodal import MediaPreparer
from sidecar.admission import Admission
from sidecar.errors import SidecarError
from sidecar.routing.shared_load import SharedLoadBoard
from sidecar.types import EngineInfo

if TYPE_CHECKING:
    from mocker.config import MockEngineConfig

log = logging.getLogger(__name__)

MOCK_MODEL = "rankgate-mock"
MOCK_DP = 2


def tiny_tokenizer_dir() -> Path:
    """The tokenizer shipped inside the package for the embedded mock engine."""
    import mocker

    return Path(mocker.__file__).resolve().parent / "assets" / "tiny-tokenizer"


def _free_port_pair() -> int:
    """A base port P with P and P+1 free (one KV-event socket per mock DP rank)."""
    for _ in range(64):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + MOCK_DP > 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port pair for the mock engine's KV events")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def create_app(
    settings: GatewaySettings,
    *,
    engine: Engine | None = None,
    media: MediaHook | None = None,
    shared_load: SharedLoadBoard | None = None,
) -> FastAPI:
    """Build the app; ``engine`` replaces the sidecar (tests), which is then not started here.

    ``shared_load`` is this worker's row of the per-rank load board (``--workers`` > 1).
    """
    registry = CollectorRegistry()
    shutdown = Shutdown(settings.shutdown_grace)
    options = ServingOptions(
        tokenizer=settings.tokenizer,
        chat_template=settings.chat_template,
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
        image_token_id=settings.routing.image_token_id,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            try:
                if settings.tokenizer is not None:
                    # Fail before starting anything when the operator's path is wrong.
                    locate_tokenizer(settings.tokenizer, "")
                serving = engine
                if serving is None:
                    serving = await _start_sidecar(settings, registry, options, stack, shared_load)
                hook = media
                if hook is None:
                    preparer = MediaPreparer(settings.media)
                    stack.push_async_callback(preparer.aclose)
                    hook = preparer
                app.state.gateway = await asyncio.to_thread(Gateway, serving, options, hook)
                close = getattr(serving, "close", None)
                if close is not None and engine is None:
                    # Queued requests get 503; pre-empted engine streams end with an error
                    # event, not a cut.
                    shutdown.on_expiry(close)
                app.state.metrics.watch_engine(_engine_probe(serving))
            except (TokenizerNotFound, SidecarError, ValueError, OSError) as exc:
                log.error("startup failed: %s", getattr(exc, "message", None) or exc)
                raise
            try:
                yield
            finally:
                app.state.metrics.watch_engine(None)
                app.state.gateway = None

    app = FastPathApp(
        title="Rankgate",
        version=__version__,
        description="OpenAI-compatible gateway in front of vLLM with KV-cache-aware DP routing.",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.gateway = None
    app.state.registry = registry
    app.state.metrics = GatewayMetrics(registry)
    app.state.observer = RequestObserver(
        app.state.metrics, AccessLog() if settings.access_log else None
    )
    app.state.started_at = int(time.time())
    app.state.limits = settings.limits
    registry.register(AdmissionCollector(lambda: _admission_of(app)))
    app.state.shutdown = shutdown
    install_error_handlers(app)
    hot = {
        "/v1/chat/completions": chat.create_chat_completion,
        "/v1/completions": completions.create_completion,
    }
    app.add_middleware(FastPath, routes=hot)
    app.serve_directly(hot)
    app.add_middleware(ClientWatch, paths=hot, stall_timeout=settings.stream_stall_timeout)
    install_access(app, settings.access)
    for module in (chat, completions, models, ops):
        app.include_router(module.router)
    install_openapi(app)
    return app


async def _start_sidecar(
    settings: GatewaySettings,
    registry: CollectorRegistry,
    options: ServingOptions,
    stack: AsyncExitStack,
    shared_load: SharedLoadBoard | None,
) -> Engine:
    from sidecar.config import SidecarConfig
    from sidecar.engine import Sidecar
    from sidecar.routing.policy import build_router

    if settings.split_serving:
        return await _start_disaggregated(settings, registry, stack, shared_load)
    endpoint = settings.engine
    if endpoint is None:
        endpoint = await _start_mock(settings, stack)
    router = build_router(
        settings.routing_config(),
        registry,
        shared_load,
    )
    sidecar = Sidecar(
        SidecarConfig(
            endpoint=endpoint,
            startup_timeout=settings.startup_timeout,
            served_model_name=settings.served_model_name,
            health_interval=settings.health_interval,
            decode_handoff_timeout=settings.decode_handoff_timeout,
        ),
        router,
        Admission(settings.admission, settings.workers),
    )
    await sidecar.start()
    stack.push_async_callback(sidecar.close)
    return sidecar


def _admission_of(app: FastAPI) -> Admission | None:
    """The serving engine's admission, when it has one (an injected test engine may not)."""
    gateway: Gateway | None = app.state.gateway
    admission: Admission | None = getattr(gateway.engine, "admission", None) if gateway else None
    return admission


def _engine_probe(engine: Engine) -> EngineProbe:
    def probe() -> tuple[bool, EngineInfo | None]:
        ready = engine.ready
        return ready, engine.info if ready else None

    return probe


async def _start_disaggregated(
    settings: GatewaySettings,
    registry: CollectorRegistry,
    stack: AsyncExitStack,
    shared_load: SharedLoadBoard | None,
) -> Engine:
    """Two sidecars, each with its own router. Only the decode side's routing metrics are
    exported and shared between workers: both sides' ranks would share the same labels and
    load-board slots."""
    from sidecar.config import SidecarConfig
    from sidecar.disagg import DisaggregatedEngine, routing_for
    from sidecar.engine import Sidecar
    from sidecar.routing.policy import build_router

    prefill, decode = settings.prefill_engine, settings.decode_engine
    if prefill is None or decode is None:
        prefill = await _start_mock(settings, stack, role="prefill")
        decode = await _start_mock(settings, stack, role="decode")

    routing = routing_for(settings.routing_config())

    def side(endpoint: str, metrics: CollectorRegistry, load: SharedLoadBoard | None) -> Sidecar:
        config = SidecarConfig(
            endpoint=endpoint,
            startup_timeout=settings.startup_timeout,
            served_model_name=settings.served_model_name,
            health_interval=settings.health_interval,
            decode_handoff_timeout=settings.decode_handoff_timeout,
        )
        admission = Admission(settings.admission, settings.workers)
        return Sidecar(config, build_router(routing, metrics, load), admission)

    engine = DisaggregatedEngine(
        side(prefill, CollectorRegistry(), None), side(decode, registry, shared_load)
    )
    await engine.start()
    stack.push_async_callback(engine.close)
    return engine


async def _start_mock(settings: GatewaySettings, stack: AsyncExitStack, role: str = "both") -> str:
    from mocker.testing import running_mock_engine

    config = mock_engine_config(settings, role)
    handle = await asyncio.to_thread(stack.enter_context, running_mock_engine(config))
    log.info(
        "started the bundled mock engine (DP=%d, KV events on, role %s) at %s",
        MOCK_DP,
        role,
        handle.target,
    )
    return str(handle.target)


def mock_engine_config(settings: GatewaySettings, role: str = "both") -> MockEngineConfig:
    """The bundled mock engine's configuration (no ``--engine``): DP=2 on free loopback ports;
    ``role`` prefill or decode for the ``--disaggregated`` pair."""
    from mocker.config import MockEngineConfig

    tokenizer = settings.tokenizer or str(tiny_tokenizer_dir())
    return MockEngineConfig(
        host="127.0.0.1",
        port=_free_port(),
        dp_size=MOCK_DP,
        model=MOCK_MODEL,
        tokenizer=tokenizer,
        model_id=tokenizer,
        kv_events_port=_free_port_pair(),
        kv_replay_port=_free_port_pair(),
        speed=settings.mock_speed,
        role=role,  # type: ignore[arg-type]
    )
