"""Prefill/decode KV hand-off, the same facts on a mock pair and on a real pair over NIXL.

A one-token prefill marked ``do_remote_decode`` finishes with ``kv_transfer_params`` whose
numbers arrive as ``google.protobuf.Struct`` numbers (doubles), and forwarding them as they
came serves the decode. The prefill side holds the prompt's KV until the decode side has read
it, then frees it at once; KV that no decode reads is freed when the lease ends (vLLM's
``kv_lease_duration``, 30 s; the mock pair runs with 3 s), and the prefill side says so.

Only the mock is asked about its KV while a lease runs. vLLM's prefill engine, on a busy
two-core CI machine, has more than once answered nothing for a finished prefill's whole lease:
four of five prefills in one fresh-clone run, each probe answered the moment the lease ended,
never on a quiet machine. There the facts come from what the engine logs when a lease ends
("... retrieved by N remote worker(s) before lease expired"), which it writes on time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest

from rankgate.mocker.config import MockEngineConfig
from rankgate.wire.proto.vllm import inference_pb2
from tests.conformance import helpers
from tests.conftest import TINY_TOKENIZER
from tests.support.mock_engine import MockEngineHandle, running_mock_engine
from tests.support.polling import wait_until, wait_until_or_not
from tests.support.ports import free_port
from tests.support.real_vllm import KV_LEASE_S, LEASE_ENDED, RealVllm, RealVllmPair
from tests.support.stalls import (
    RERUN_ON_STALLS,
    EngineStalled,
    answered_in_time,
    diagnosis,
    stalled,
)

MOCK_LEASE_S = 3.0
NUMBERS = ("remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens")


@dataclass(frozen=True)
class Side:
    target: str
    held: Callable[[], bool]
    # Leases ended of the prefills whose request id starts with the one given (the mock pair
    # serves one request at a time and counts all of them).
    expired: Callable[[str], int]
    # Decodes that read each ended lease's KV, by the engine's own word; None where the engine
    # does not say (the mock, which counts reads as freed transfers instead).
    lease_reads: Callable[[str], list[int]] | None
    # Whether ``held`` may be asked while a lease runs (see the module's docstring).
    answers_during_lease: bool


@dataclass(frozen=True)
class PdPair:
    kind: str
    prefill: Side
    decode: Side
    lease_s: float
    # What the engines and the machine were doing, for a stall's report.
    diagnose: Callable[[], str]


def _real_side(server: RealVllm) -> Side:
    def expired(request_id: str) -> int:
        return server.log_path.read_text(errors="replace").count(f"{LEASE_ENDED}{request_id}")

    def lease_reads(request_id: str) -> list[int]:
        return server.lease_reads(request_id)

    # A stalled engine answers once the lease ends: wait that long rather than time out.
    def held() -> bool:
        return not server.blocks_free(timeout=KV_LEASE_S + 15)

    return Side(server.target, held, expired, lease_reads, answers_during_lease=False)


def _mock_side(handle: MockEngineHandle) -> Side:
    def stats() -> list[object]:
        return [handle.stats(rank) for rank in handle.ranks]

    return Side(
        handle.target,
        lambda: any(s.held_transfers for s in stats()),  # type: ignore[attr-defined]
        lambda _: sum(s.leases_expired for s in stats()),  # type: ignore[attr-defined]
        lease_reads=None,
        answers_during_lease=True,
    )


def _mock_config(role: str) -> MockEngineConfig:
    return MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=1,
        block_size=32,
        model="tiny-llama",
        tokenizer=str(TINY_TOKENIZER),
        speed=0.0,
        max_model_len=512,
        role=role,  # type: ignore[arg-type]
        kv_lease_seconds=MOCK_LEASE_S,
    )


@pytest.fixture(scope="module")
def mock_pair() -> Iterator[PdPair]:
    with (
        running_mock_engine(_mock_config("prefill")) as prefill,
        running_mock_engine(_mock_config("decode")) as decode,
    ):
        yield PdPair(
            "mock",
            _mock_side(prefill),
            _mock_side(decode),
            MOCK_LEASE_S,
            lambda: f"prefill {prefill.stats(0)}; decode {decode.stats(0)}",
        )


@pytest.fixture(scope="module", params=["mock", pytest.param("real", marks=pytest.mark.real_vllm)])
def pd_pair(request: pytest.FixtureRequest) -> PdPair:
    if request.param == "mock":
        pair: PdPair = request.getfixturevalue("mock_pair")
        return pair
    real: RealVllmPair = request.getfixturevalue("real_pd")
    return PdPair(
        "real",
        _real_side(real.prefill),
        _real_side(real.decode),
        KV_LEASE_S,
        lambda: diagnosis(real),
    )


def prefill(pair: PdPair, ids: list[int]) -> tuple[str, inference_pb2.GenerateResponse]:
    """The request id and reply of a one-token prefill marked for a remote decode."""
    request = helpers.make_request(ids, tag="prefill", max_new_tokens=1)
    request.stopping.min_new_tokens = 1
    request.kv.kv_transfer_params.update({"do_remote_decode": True})
    with grpc.insecure_channel(pair.prefill.target) as channel:
        return request.request_id, helpers.unary(channel, request)


@dataclass(frozen=True)
class Probe:
    asked: float  # seconds since the case began
    answered: float
    held: bool


def probe(side: Side, since: float) -> Probe:
    asked = time.monotonic() - since
    with answered_in_time(f"a probe asked {asked:.2f} s into the case"):
        held = side.held()
    return Probe(asked, time.monotonic() - since, held)


def stalled_probes(pair: PdPair, what: str, probes: list[Probe]) -> EngineStalled:
    return stalled(what, f"{probes}\n{pair.diagnose()}")


@RERUN_ON_STALLS
def test_forwarded_params_serve_the_decode_and_free_the_prefill_kv(pd_pair: PdPair) -> None:
    wait_until(lambda: not pd_pair.prefill.held(), pd_pair.lease_s + 10)
    ids = helpers.fresh_prompt(100)
    started = time.monotonic()
    rid, reply = prefill(pd_pair, ids)
    params = reply.outputs.finish_info.kv_transfer_params
    assert params["do_remote_prefill"] is True
    for name in NUMBERS:
        assert params.fields[name].WhichOneof("kind") == "number_value", name
    if pd_pair.prefill.answers_during_lease:
        after = probe(pd_pair.prefill, started)
        assert after.held, f"the prefill's KV read as free before any decode: {after}"
    leases_ended = pd_pair.prefill.expired(rid)
    request = helpers.make_request(ids, tag="decode", max_new_tokens=3)
    request.kv.kv_transfer_params.CopyFrom(params)  # as they came: numbers stay doubles
    with grpc.insecure_channel(pd_pair.decode.target) as channel:
        generation = helpers.stream(channel, request)
    assert generation.finish is not None
    assert generation.finish.num_output_tokens == 3
    # A stalled real engine answers this only at the lease's end; the log then tells whether
    # the read or the lease freed the KV.
    freed = wait_until_or_not(lambda: not pd_pair.prefill.held(), pd_pair.lease_s / 2)
    lease_ended = pd_pair.prefill.expired(rid) > leases_ended
    if pd_pair.kind == "real" and lease_ended:
        # The decode above read all of it (num_output_tokens checked, and vLLM's decode fails a
        # request whose KV load fails): the missing read notice is the engines'.
        raise stalled_probes(pd_pair, "the read KV was kept until its lease ended", [])
    assert not lease_ended, "a lease ended, not the read"
    assert freed, "the read KV was kept past half its lease"


@RERUN_ON_STALLS
def test_kv_no_decode_reads_is_held_until_the_lease_ends(pd_pair: PdPair) -> None:
    """The engine's own word dates the release (the mock's counter, vLLM's "Releasing expired
    KV blocks" line); the mock reads as held at every sample answered well before it."""
    wait_until(lambda: not pd_pair.prefill.held(), pd_pair.lease_s + 10)
    started = time.monotonic()
    rid, _ = prefill(pd_pair, helpers.fresh_prompt(100))
    expired = pd_pair.prefill.expired(rid)
    samples: list[Probe] = []

    def ended() -> bool:
        if pd_pair.prefill.expired(rid) != expired:
            return True
        if pd_pair.prefill.answers_during_lease:
            samples.append(probe(pd_pair.prefill, started))
        return False

    wait_until(ended, pd_pair.lease_s + 15, lambda: f"the lease never ended: {samples}")
    released = time.monotonic() - started
    assert released >= pd_pair.lease_s * 0.8
    assert pd_pair.prefill.expired(rid) == expired + 1
    if pd_pair.prefill.lease_reads is not None:
        assert pd_pair.prefill.lease_reads(rid) == [0], "the engine says a decode read the KV"
    if pd_pair.prefill.answers_during_lease:
        early = [sample for sample in samples if sample.answered < pd_pair.lease_s * 0.8]
        assert early, f"no probe was answered before the lease's end: {samples}"
        assert all(sample.held for sample in early), f"the KV read as free early: {samples}"
    wait_until(lambda: not pd_pair.prefill.held(), 10)


@RERUN_ON_STALLS
def test_a_prefill_sampled_as_the_client_asked_samples_the_decodes_first_token(
    pd_pair: PdPair,
) -> None:
    """What first-token seeding rests on: the prefill's one token, sampled with the request's
    own seed, is the token its decode samples first from the pulled KV, and the decode's
    tokens are those the decode engine gives when it prefills the prompt itself."""
    ids = helpers.fresh_prompt(100)
    sampling = inference_pb2.RandomSampling(seed=9, top_p=0.95)
    request = helpers.make_request(ids, tag="seeded", max_new_tokens=1, temperature=1.0)
    request.sampling.CopyFrom(sampling)
    request.kv.kv_transfer_params.update({"do_remote_decode": True})
    with grpc.insecure_channel(pd_pair.prefill.target) as channel:
        reply = helpers.unary(channel, request)
    seeded = list(reply.outputs.token_ids)
    assert len(seeded) == 1
    decode = helpers.make_request(ids, tag="decode", max_new_tokens=6, temperature=1.0)
    decode.sampling.CopyFrom(sampling)
    decode.kv.kv_transfer_params.CopyFrom(reply.outputs.finish_info.kv_transfer_params)
    alone = helpers.make_request(ids, tag="alone", max_new_tokens=6, temperature=1.0)
    alone.sampling.CopyFrom(sampling)
    # Computed afresh, not from the blocks the decode just pulled and cached.
    alone.kv.bypass_prefix_cache = True
    with grpc.insecure_channel(pd_pair.decode.target) as channel:
        pulled = helpers.stream(channel, decode)
        local = helpers.stream(channel, alone)
    assert pulled.token_ids[:1] == seeded
    assert pulled.token_ids == local.token_ids
