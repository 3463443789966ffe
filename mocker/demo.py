"""The demo engine: the mock vLLM that ``rankgate serve`` runs when it is given no engine.

With it the gateway answers out of the box: a DP=2 engine with KV events on, on free loopback
ports, serving the small tokenizer shipped in this package (or the operator's), on a thread of
the gateway's own process. This is the one entry point the product uses; tests and benches
start the mock through ``tests/support/mock_engine.py`` instead.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rankgate.mocker.config import BUNDLED_TOKENIZER, MockEngineConfig
from rankgate.mocker.threaded import serving_in_thread
from rankgate.mocker.transfer import Role

MODEL = "rankgate-mock"
DP_SIZE = 2
# Chance per token that a turn ends with EOS: answers of about 40 tokens on average, ending
# where a model's would rather than at the token limit (which the Responses API reports as an
# incomplete answer, and agent frameworks refuse).
EOS_PROBABILITY = 1 / 40
_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class DemoEngine:
    # HOST:PORT of its gRPC services.
    target: str
    # The tokenizer directory it serves, which is also the model id it reports.
    tokenizer: str


def tiny_tokenizer_dir() -> Path:
    """The tokenizer shipped inside the package for the demo engine."""
    return BUNDLED_TOKENIZER


@contextmanager
def demo_engine(
    *, tokenizer: str | None = None, speed: float = 1.0, role: Role = "both"
) -> Iterator[DemoEngine]:
    """Run the demo engine until the block ends.

    ``speed`` 0 is zero latency and 1 GPU-like timing; ``role`` prefill or decode makes one
    side of a disaggregated pair.
    """
    directory = tokenizer or str(tiny_tokenizer_dir())
    config = MockEngineConfig(
        host=_HOST,
        port=_free_port(),
        dp_size=DP_SIZE,
        model=MODEL,
        tokenizer=directory,
        model_id=directory,
        kv_events_port=_free_port_run(DP_SIZE),
        kv_replay_port=_free_port_run(DP_SIZE),
        # A concrete host: the publishers connect to the gateway's loopback sockets and the
        # replay sockets bind on loopback, as vLLM does; '*' would bind every interface.
        kv_events_host=_HOST,
        speed=speed,
        role=role,
        eos_probability=EOS_PROBABILITY,
    )
    with serving_in_thread(config) as (server, _):
        yield DemoEngine(server.target, directory)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((_HOST, 0))
        return int(probe.getsockname()[1])


def _free_port_run(count: int) -> int:
    """A base port P with P .. P+count-1 free (one KV-event socket per DP rank)."""
    for _ in range(64):
        base = _free_port()
        if base + count > 65536:
            continue
        probes = [socket.socket() for _ in range(count)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind((_HOST, base + offset))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports for the demo engine's KV events")
