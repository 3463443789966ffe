"""The in-process bridge between a prepared request and vLLM's gRPC services.

It discovers the engine, watches its health, routes each request to a data-parallel rank and
streams the result back as typed deltas. It never imports ``app``.

What is listed in ``__all__`` is the whole of it that other packages use; the modules behind
it are free to change. The wire code it shares with the mock engine lives in
:mod:`rankgate.wire`, so loading the mock never loads this package.
"""

from rankgate.sidecar.admission import GROUP as ADMISSION_GROUP
from rankgate.sidecar.admission import Admission, AdmissionConfig
from rankgate.sidecar.config import DisaggConfig, SidecarConfig
from rankgate.sidecar.disagg import DisaggregatedEngine, routing_for
from rankgate.sidecar.disagg_metrics import DisaggMetrics
from rankgate.sidecar.engine import Sidecar
from rankgate.sidecar.errors import (
    BadEngineResponse,
    DiscoveryError,
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    FailedPrecondition,
    GatewayOverloaded,
    InvalidRequest,
    NotFound,
    SidecarError,
)
from rankgate.sidecar.fan_in import merge_batch
from rankgate.sidecar.plain_metrics import PlainHistogram, merge_count
from rankgate.sidecar.routing.base import Router
from rankgate.sidecar.routing.config import RoutingConfig
from rankgate.sidecar.routing.events import IntakeSettings
from rankgate.sidecar.routing.metrics import RouteTally, routing_metrics
from rankgate.sidecar.routing.policies import build_router
from rankgate.sidecar.routing.shared_load import SharedLoadBoard
from rankgate.sidecar.types import (
    Delta,
    DeltaSink,
    EngineInfo,
    MediaInput,
    Metadata,
    OutputOptions,
    PreparedRequest,
    RequestTrace,
    SamplingParams,
    StoppingParams,
    StructuredOutput,
    TokenLogprob,
)

__all__ = [
    "ADMISSION_GROUP",
    "Admission",
    "AdmissionConfig",
    "BadEngineResponse",
    "Delta",
    "DeltaSink",
    "DisaggConfig",
    "DisaggMetrics",
    "DisaggregatedEngine",
    "DiscoveryError",
    "EngineFailure",
    "EngineInfo",
    "EngineOverloaded",
    "EngineUnavailable",
    "FailedPrecondition",
    "GatewayOverloaded",
    "IntakeSettings",
    "InvalidRequest",
    "MediaInput",
    "Metadata",
    "NotFound",
    "OutputOptions",
    "PlainHistogram",
    "PreparedRequest",
    "RequestTrace",
    "RouteTally",
    "Router",
    "RoutingConfig",
    "SamplingParams",
    "SharedLoadBoard",
    "Sidecar",
    "SidecarConfig",
    "SidecarError",
    "StoppingParams",
    "StructuredOutput",
    "TokenLogprob",
    "build_router",
    "merge_batch",
    "merge_count",
    "routing_for",
    "routing_metrics",
]
