"""The in-process bridge between a prepared request and vLLM's gRPC services.

It discovers the engine, watches its health, routes each request to a data-parallel rank and
streams the result back as typed deltas. It never imports ``app``.

What is listed in ``__all__`` is the whole of it that other packages use; the modules behind
it are free to change. Names load on first use, so a process that needs only the HTTP/2 core
(the mock engine) does not load the engine client, the router or grpcio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Public name -> (module under rankgate.sidecar, its name there).
_EXPORTS: dict[str, tuple[str, str]] = {
    "ADMISSION_GROUP": ("admission", "GROUP"),
    "Admission": ("admission", "Admission"),
    "AdmissionConfig": ("admission", "AdmissionConfig"),
    "SidecarConfig": ("config", "SidecarConfig"),
    "DisaggConfig": ("config", "DisaggConfig"),
    "DisaggMetrics": ("disagg_metrics", "DisaggMetrics"),
    "DisaggregatedEngine": ("disagg", "DisaggregatedEngine"),
    "merge_batch": ("fan_in", "merge_batch"),
    "routing_for": ("disagg", "routing_for"),
    "Sidecar": ("engine", "Sidecar"),
    "BadEngineResponse": ("errors", "BadEngineResponse"),
    "DiscoveryError": ("errors", "DiscoveryError"),
    "EngineFailure": ("errors", "EngineFailure"),
    "EngineOverloaded": ("errors", "EngineOverloaded"),
    "EngineUnavailable": ("errors", "EngineUnavailable"),
    "FailedPrecondition": ("errors", "FailedPrecondition"),
    "GatewayOverloaded": ("errors", "GatewayOverloaded"),
    "InvalidRequest": ("errors", "InvalidRequest"),
    "NotFound": ("errors", "NotFound"),
    "SidecarError": ("errors", "SidecarError"),
    "PlainHistogram": ("plain_metrics", "PlainHistogram"),
    "merge_count": ("plain_metrics", "merge_count"),
    "Router": ("routing.base", "Router"),
    "IntakeSettings": ("routing.events", "IntakeSettings"),
    "RouteTally": ("routing.metrics", "RouteTally"),
    "routing_metrics": ("routing.metrics", "routing_metrics"),
    "RoutingConfig": ("routing.config", "RoutingConfig"),
    "build_router": ("routing.policies", "build_router"),
    "SharedLoadBoard": ("routing.shared_load", "SharedLoadBoard"),
    "Delta": ("types", "Delta"),
    "DeltaSink": ("types", "DeltaSink"),
    "EngineInfo": ("types", "EngineInfo"),
    "MediaInput": ("types", "MediaInput"),
    "Metadata": ("types", "Metadata"),
    "OutputOptions": ("types", "OutputOptions"),
    "PreparedRequest": ("types", "PreparedRequest"),
    "RequestTrace": ("types", "RequestTrace"),
    "SamplingParams": ("types", "SamplingParams"),
    "StoppingParams": ("types", "StoppingParams"),
    "StructuredOutput": ("types", "StructuredOutput"),
    "TokenLogprob": ("types", "TokenLogprob"),
}

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


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
