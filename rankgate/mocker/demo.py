"""The demo engine: the mock vLLM that ``rankgate serve`` runs when it is given no engine.

With it the gateway answers out of the box: a DP=2 engine with KV events on, on free loopback
ports, serving the small tokenizer shipped in this package (or the operator's), on a thread of
the gateway's own process. This is the one entry point the product uses; tests and benches
start the mock through ``tests/support/mock_engine.py`` instead.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import zmq

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
# Starts tried when a KV-event port run, free when probed, was taken before the engine bound it.
_START_TRIES = 8


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
    for attempt in range(_START_TRIES):
        config = MockEngineConfig(
            host=_HOST,
            # The kernel picks the gRPC port as it binds: no window for another socket to take it.
            port=0,
            dp_size=DP_SIZE,
            model=MODEL,
            tokenizer=directory,
            model_id=directory,
            # KV-event sockets sit at consecutive ports (one per rank), which only a probe finds.
            kv_events_port=_free_port_run(DP_SIZE),
            kv_replay_port=_free_port_run(DP_SIZE),
            # A concrete host: the publishers connect to the gateway's loopback sockets and the
            # replay sockets bind on loopback, as vLLM does; '*' would bind every interface.
            kv_events_host=_HOST,
            speed=speed,
            role=role,
            eos_probability=EOS_PROBABILITY,
        )
        stack = ExitStack()
        try:
            server, _ = stack.enter_context(serving_in_thread(config))
        except (OSError, zmq.ZMQError) as exc:
            if exc.errno != errno.EADDRINUSE or attempt == _START_TRIES - 1:
                raise
            continue
        with stack:
            yield DemoEngine(server.target, directory)
        return


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
