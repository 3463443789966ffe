"""The demo engines ``rankgate serve`` starts when it is given no engine
(:mod:`rankgate.mocker.demo`).

They are started once per gateway: in the serving process, or with ``--workers`` in the
supervisor, so that every worker routes to the same engine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

from rankgate.app.config.settings import GatewaySettings

if TYPE_CHECKING:
    from rankgate.mocker.demo import DemoEngine
    from rankgate.mocker.transfer import Role

log = logging.getLogger(__name__)


@contextmanager
def demo_engines(settings: GatewaySettings) -> Iterator[GatewaySettings]:
    """``settings`` with the endpoints of demo engines started for them, which run until the
    block ends: one engine, or a prefill/decode pair for ``--disaggregated``; ``settings`` as
    they are when they name their engines."""
    if settings.engine is not None or settings.prefill_engine is not None:
        yield settings
        return
    # Imported here: a gateway in front of vLLM never loads the mock.
    from rankgate.mocker.demo import DP_SIZE, demo_engine

    with ExitStack() as stack:

        def start(role: Role) -> DemoEngine:
            engine = stack.enter_context(
                demo_engine(tokenizer=settings.tokenizer, speed=settings.mock_speed, role=role)
            )
            log.warning(
                "DEMO MODE: no --engine given, so this gateway serves the bundled mock engine "
                "(made-up text; DP=%d, KV events on, role %s, on loopback at %s); pass --engine "
                "HOST:PORT (RANKGATE_ENGINE) to serve a vLLM",
                DP_SIZE,
                role,
                engine.target,
            )
            return engine

        if settings.disaggregated:
            prefill, decode = start("prefill"), start("decode")
            yield replace(
                settings,
                prefill_engine=prefill.target,
                decode_engine=decode.target,
                tokenizer=decode.tokenizer,
                demo_engines=True,
            )
        else:
            engine = start("both")
            yield replace(
                settings, engine=engine.target, tokenizer=engine.tokenizer, demo_engines=True
            )
