"""Shared fixtures: the engines under test (mocker and real vLLM) and their gRPC stubs."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import grpc
import pytest

from tests.support.engines import EngineUnderTest
from tests.support.ports import free_port, free_port_range

if TYPE_CHECKING:
    from tests.support.real_vllm import RealVllm, RealVllmPair

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
TINY_TOKENIZER = ROOT / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
CONFORMANCE_DP = 2
CONFORMANCE_BLOCK = 32
# KV blocks a rank of the small-cache engines holds: a few prompts fill it.
SMALL_CACHE_BLOCKS = 48


class RealEngines:
    """The session's real vLLM servers, one at a time (two cores and 23 GiB cannot hold the
    tiny Llama, the LLaVA and a prefill/decode pair at once).

    Asking for another kind stops the running one. :func:`pytest_collection_modifyitems`
    orders the tests by the kind they need, so each kind starts at most once per session.
    """

    def __init__(self) -> None:
        self._name: str | None = None
        self._value: Any = None
        self._stack = contextlib.ExitStack()

    def get(self, name: str, start: Callable[[], contextlib.AbstractContextManager[T]]) -> T:
        if self._name != name:
            self.close()
            self._value = self._stack.enter_context(start())
            self._name = name
        value: T = self._value
        return value

    def close(self) -> None:
        self._name = None
        self._value = None
        self._stack.close()


# The real engines besides the tiny Llama, in the order their tests run (after all others),
# each with the parametrized fixtures whose "real" case stands for it.
LATER_REAL_ENGINES = (
    ("real_small_cache", "small_cache_engine"),
    ("real_llava", "image_engine"),
    ("real_asr", "audio_engine"),
    ("real_vl", "video_engine"),
    ("real_pd", "pd_pair"),
    ("real_pd_short_lease", "pd_short_lease"),
)
# The prefill engine's KV lease (seconds) of the pair that tests what happens when it ends.
SHORT_KV_LEASE = 4


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests of the small-cache Llama, the LLaVA, the Qwen3-ASR, the Qwen3-VL, then of the
    prefill/decode pairs, run last (stable otherwise)."""

    def group(item: pytest.Item) -> int:
        names = getattr(item, "fixturenames", ())
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec is not None else {}
        for index, (name, stand_in) in enumerate(LATER_REAL_ENGINES, start=1):
            if name in names or params.get(stand_in) == "real":
                return index
        return 0

    items.sort(key=group)


@pytest.fixture(scope="session")
def real_engines() -> Iterator[RealEngines]:
    engines = RealEngines()
    yield engines
    engines.close()


def _engine_cpus() -> str | None:
    """Every real engine runs on the fair placement's engine CPU (core 0 on two cores)."""
    from tests.support.placement import placement_for_tests

    return placement_for_tests().engine_cpus


def _under_test(server: RealVllm) -> EngineUnderTest:
    """A real engine as the conformance suite sees it."""
    return EngineUnderTest(
        kind="real",
        target=server.target,
        dp_size=server.dp_size,
        block_size=server.block_size,
        served_model_name=server.served_model_name,
        tokenizer_dir=server.model_dir,
        kv_events_base_port=server.kv_events_base_port,
        kv_replay_base_port=server.kv_replay_base_port,
        http_url=server.http_url,
    )


@pytest.fixture(scope="session")
def real_vllm(real_engines: RealEngines) -> EngineUnderTest:
    from tests.support.real_vllm import start_real_vllm

    # On the fair placement so that the latency-sensitive tests can use it too
    # (tests/support/placement.py); the others do not mind.
    server = real_engines.get(
        "llama",
        lambda: start_real_vllm(
            dp_size=CONFORMANCE_DP, block_size=CONFORMANCE_BLOCK, cpus=_engine_cpus(), eager=True
        ),
    )
    return _under_test(server)


@pytest.fixture(scope="session")
def real_small_cache(real_engines: RealEngines) -> EngineUnderTest:
    """The tiny Llama with ``SMALL_CACHE_BLOCKS`` KV blocks a rank, DP=2, vLLM's dev routes
    open (``/reset_prefix_cache``)."""
    from tests.support.real_vllm import start_real_vllm

    server = real_engines.get(
        "small_cache",
        lambda: start_real_vllm(
            dp_size=CONFORMANCE_DP,
            block_size=CONFORMANCE_BLOCK,
            dev_endpoints=True,
            cpus=_engine_cpus(),
            eager=True,
            kv_blocks=SMALL_CACHE_BLOCKS,
        ),
    )
    return _under_test(server)


@pytest.fixture(scope="session")
def real_llava(real_engines: RealEngines) -> RealVllm:
    """The tiny LLaVA on real vLLM, DP=2, KV events on, vLLM's dev routes open."""
    from tests.support.real_vllm import start_real_vllm

    return real_engines.get(
        "llava",
        lambda: start_real_vllm(
            dp_size=CONFORMANCE_DP,
            block_size=CONFORMANCE_BLOCK,
            model="llava",
            dev_endpoints=True,
            cpus=_engine_cpus(),
            eager=True,
        ),
    )


@pytest.fixture(scope="session")
def real_asr(real_engines: RealEngines) -> RealVllm:
    """A tiny Qwen3-ASR on real vLLM (audio, random weights), DP=2, KV events on."""
    from tests.support.real_vllm import start_real_vllm

    return real_engines.get(
        "asr",
        lambda: start_real_vllm(
            dp_size=CONFORMANCE_DP,
            block_size=CONFORMANCE_BLOCK,
            model="asr",
            dev_endpoints=True,
            cpus=_engine_cpus(),
            eager=True,
        ),
    )


@pytest.fixture(scope="session")
def real_vl(real_engines: RealEngines) -> RealVllm:
    """A tiny Qwen2-VL on real vLLM (video, random weights), DP=2, KV events on."""
    from tests.support.real_vllm import start_real_vllm

    return real_engines.get(
        "vl",
        lambda: start_real_vllm(
            dp_size=CONFORMANCE_DP,
            block_size=CONFORMANCE_BLOCK,
            model="vl",
            dev_endpoints=True,
            cpus=_engine_cpus(),
            eager=True,
        ),
    )


@pytest.fixture(scope="session")
def real_pd(real_engines: RealEngines) -> RealVllmPair:
    """A real prefill/decode pair (the tiny LLaVA, DP=1 each, NIXL over loopback).

    Each engine gets a core of its own: sharing one, their spinning CPU workers starve each
    other's NIXL progress until hand-offs take longer than the 30 s KV lease.
    """
    import os

    from tests.support.real_vllm import start_real_vllm_pair

    cpus = sorted(os.sched_getaffinity(0))
    first, last = str(cpus[0]), str(cpus[-1])

    return real_engines.get(
        "pd",
        lambda: start_real_vllm_pair(
            block_size=CONFORMANCE_BLOCK,
            dev_endpoints=True,
            cpus=first,
            decode_cpus=last,
            eager=True,
        ),
    )


@pytest.fixture(scope="session")
def mock_vllm() -> Iterator[EngineUnderTest]:
    yield from _conformance_mock("combined")


@pytest.fixture(scope="session")
def mock_vllm_split() -> Iterator[EngineUnderTest]:
    """The mocker with vLLM main's split services (KV-event discovery on vllm.KvTransfer)."""
    yield from _conformance_mock("split")


def _conformance_mock(
    services: Literal["combined", "split"], kv_blocks: int | None = None
) -> Iterator[EngineUnderTest]:
    from rankgate.mocker.config import MockEngineConfig
    from tests.support.mock_engine import running_mock_engine

    config = MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=CONFORMANCE_DP,
        block_size=CONFORMANCE_BLOCK,
        model="tiny-llama",
        tokenizer=str(TINY_TOKENIZER),
        kv_events_port=free_port_range(CONFORMANCE_DP),
        kv_replay_port=free_port_range(CONFORMANCE_DP),
        speed=0.0,
        max_model_len=512,
        grpc_services=services,
    )
    if kv_blocks is not None:
        config = dataclasses.replace(config, total_kv_blocks=kv_blocks * config.dp_size)
    with running_mock_engine(config) as handle:
        yield EngineUnderTest(
            kind="mock",
            grpc_services=services,
            target=handle.target,
            dp_size=config.dp_size,
            block_size=config.block_size,
            served_model_name=config.model,
            tokenizer_dir=TINY_TOKENIZER,
            kv_events_base_port=config.kv_events_port,
            kv_replay_base_port=config.kv_replay_port,
            mock=handle,
        )


@pytest.fixture(scope="session")
def mock_small_cache() -> Iterator[EngineUnderTest]:
    yield from _conformance_mock("combined", kv_blocks=SMALL_CACHE_BLOCKS)


@pytest.fixture(scope="session", params=["mock", pytest.param("real", marks=pytest.mark.real_vllm)])
def small_cache_engine(request: pytest.FixtureRequest) -> EngineUnderTest:
    """An engine whose ranks hold ``SMALL_CACHE_BLOCKS`` KV blocks each: the mocker and real
    vLLM (DP=2)."""
    name = "mock_small_cache" if request.param == "mock" else "real_small_cache"
    result: EngineUnderTest = request.getfixturevalue(name)
    return result


@pytest.fixture(
    scope="session",
    params=["mock", "mock_split", pytest.param("real", marks=pytest.mark.real_vllm)],
)
def engine(request: pytest.FixtureRequest) -> EngineUnderTest:
    """Each conformance test runs once per engine: the mocker in vLLM 0.32's service layout
    and in vLLM main's split one, and real vLLM (DP=2)."""
    name = {"mock": "mock_vllm", "mock_split": "mock_vllm_split"}.get(request.param, "real_vllm")
    result: EngineUnderTest = request.getfixturevalue(name)
    return result


@pytest.fixture(scope="session")
def engine_channel(engine: EngineUnderTest) -> Iterator[grpc.Channel]:
    channel = grpc.insecure_channel(
        engine.target,
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    )
    yield channel
    channel.close()


@pytest.fixture(scope="session")
def real_pd_short_lease(real_engines: RealEngines) -> RealVllmPair:
    """A real prefill/decode pair (the tiny Llama) whose prefill engine holds a finished
    prefill's KV for only ``SHORT_KV_LEASE`` seconds."""
    import os

    from tests.support.real_vllm import start_real_vllm_pair

    cpus = sorted(os.sched_getaffinity(0))
    return real_engines.get(
        "pd_short_lease",
        lambda: start_real_vllm_pair(
            block_size=CONFORMANCE_BLOCK,
            model="llama",
            dev_endpoints=True,
            cpus=str(cpus[0]),
            decode_cpus=str(cpus[-1]),
            eager=True,
            kv_lease=SHORT_KV_LEASE,
        ),
    )
