"""The prefill and decode roles over gRPC: signed connector params, the checks a decode role
makes on them, the simulated KV transfer, the prefill side's lease on the KV it holds for a
decode engine, and the stranded-transfer counter."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from rankgate.mocker.config import ConfigError
from rankgate.mocker.transfer import DIGEST_KEY
from rankgate.sidecar.convert import decode_transfer_params, encode_transfer_params
from rankgate.wire.proto.vllm import inference_pb2
from tests.mocker.conftest import Client, engine, make_config, prompt, request
from tests.support.mock_engine import MockEngineHandle
from tests.support.polling import wait_until


@pytest.fixture(scope="module")
def prefill() -> Iterator[MockEngineHandle]:
    with engine(role="prefill") as handle:
        yield handle


@pytest.fixture(scope="module")
def decode() -> Iterator[MockEngineHandle]:
    with engine(role="decode", speed=1.0, kv_transfer_seconds=0.3) as handle:
        yield handle


def issued(handle: MockEngineHandle, ids: list[int]) -> dict[str, Any]:
    """A prefill of ``ids`` on ``handle``, and the params it finished with (as a gateway
    decodes them: integral numbers as ints)."""
    req = request(ids, max_new_tokens=1)
    req.kv.kv_transfer_params.update({"do_remote_decode": True})
    c = Client(handle.target)
    try:
        finish = c.stream(req)[-1].outputs.finish_info
    finally:
        c.close()
    return decode_transfer_params(finish.kv_transfer_params)


def decode_request(ids: list[int], params: dict[str, Any], **fields: Any) -> Any:
    req = request(ids, max_new_tokens=3, **fields)
    encode_transfer_params(req.kv.kv_transfer_params, params)
    return req


def refused(handle: MockEngineHandle, req: Any) -> str:
    c = Client(handle.target)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            c.stream(req)
    finally:
        c.close()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.details() or ""


def test_prefill_issues_signed_params(prefill: MockEngineHandle) -> None:
    params = issued(prefill, prompt(1, 40))
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert len(params[DIGEST_KEY]) == 32
    # vLLM 0.32's layout: block ids per KV group, the prompt length, the side channel's port.
    assert [len(group) for group in params["remote_block_ids"]] == [3]
    assert params["remote_num_tokens"] == 40
    assert isinstance(params["remote_port"], int)
    assert params["remote_port"] > 0


def held(handle: MockEngineHandle) -> int:
    return sum(handle.stats(rank).held_transfers for rank in handle.ranks)


def test_prefill_holds_the_kv_until_the_decode_reads_it(
    prefill: MockEngineHandle, decode: MockEngineHandle
) -> None:
    ids = prompt(11, 40)
    before = sum(prefill.stats(rank).transfers_released for rank in prefill.ranks)
    params = issued(prefill, ids)
    assert held(prefill) >= 1
    c = Client(decode.target)
    try:
        c.stream(decode_request(ids, params))
    finally:
        c.close()
    wait_until(
        lambda: sum(prefill.stats(rank).transfers_released for rank in prefill.ranks) == before + 1,
        5,
        lambda: f"prefill: {prefill.all_stats()}",
    )


def test_unread_kv_is_freed_when_its_lease_expires() -> None:
    with engine(role="prefill", kv_lease_seconds=0.2) as handle:
        issued(handle, prompt(12, 40))
        assert held(handle) == 1
        wait_until(lambda: held(handle) == 0, 5, lambda: f"{held(handle)} transfers held")
        stats = [handle.stats(rank) for rank in handle.ranks]
        assert sum(s.leases_expired for s in stats) == 1
        assert sum(s.transfers_released for s in stats) == 0


def test_prefill_role_takes_only_remote_decode_requests(prefill: MockEngineHandle) -> None:
    assert "do_remote_decode true" in refused(prefill, request(prompt(2, 20)))
    req = decode_request(prompt(2, 20), {"do_remote_prefill": True})
    assert "cannot take a remote prefill" in refused(prefill, req)


def test_decode_accepts_params_forwarded_with_their_json_types(
    prefill: MockEngineHandle, decode: MockEngineHandle
) -> None:
    ids = prompt(3, 40)
    c = Client(decode.target)
    try:
        started = time.monotonic()
        messages = c.stream(decode_request(ids, issued(prefill, ids)))
        elapsed = time.monotonic() - started
    finally:
        c.close()
    assert messages[-1].outputs.finish_info.num_output_tokens == 3
    assert elapsed >= 0.3  # the KV transfer comes before the first step
    totals = [decode.stats(rank) for rank in decode.ranks]
    assert sum(s.transfers_completed for s in totals) >= 1
    assert sum(s.stranded_transfers for s in totals) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p.pop(DIGEST_KEY), "carry no transfer_digest"),
        # Blocks the prefill did not issue, whichever it did.
        (
            lambda p: p.update(
                remote_block_ids=[[block + 10_000 for block in g] for g in p["remote_block_ids"]]
            ),
            "do not match a prefill",
        ),
        (lambda p: p.update(remote_host="10.9.9.9"), "do not match a prefill"),
    ],
)
def test_decode_refuses_params_that_were_altered(
    prefill: MockEngineHandle, decode: MockEngineHandle, change: Any, message: str
) -> None:
    ids = prompt(4, 40)
    params = issued(prefill, ids)
    change(params)
    assert message in refused(decode, decode_request(ids, params))


def test_decode_refuses_another_prompt_or_salt(
    prefill: MockEngineHandle, decode: MockEngineHandle
) -> None:
    ids = prompt(5, 40)
    params = issued(prefill, ids)
    assert "do not match a prefill" in refused(decode, decode_request(ids[:-1], params))
    salted = decode_request(ids, params, kv=inference_pb2.KVCacheParameters(cache_salt="x"))
    assert "do not match a prefill" in refused(decode, salted)


@pytest.mark.parametrize("field", ["remote_port", "dcp_size", "tp_size", "remote_num_tokens"])
def test_decode_fails_numbers_sent_as_strings(
    prefill: MockEngineHandle, decode: MockEngineHandle, field: str
) -> None:
    """vLLM's NIXL handshake compares these (``remote_dcp_size > 1``): strings raise there."""
    ids = prompt(6, 40)
    params = issued(prefill, ids)
    params[field] = str(params[field])
    c = Client(decode.target)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            c.stream(decode_request(ids, params))
    finally:
        c.close()
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert field in (caught.value.details() or "")


def test_decode_role_prefills_a_request_without_remote_params(decode: MockEngineHandle) -> None:
    """vLLM's NIXL consumer prefills such a request locally (the gateway sends prompt-logprob
    requests this way, tests/disagg/test_real_vllm_pd.py)."""
    before = sum(decode.stats(rank).transfers_completed for rank in decode.ranks)
    c = Client(decode.target)
    try:
        assert len(c.stream(request(prompt(7, 20), max_new_tokens=2))) == 3
    finally:
        c.close()
    assert sum(decode.stats(rank).transfers_completed for rank in decode.ranks) == before


def test_dropping_a_decode_during_its_transfer_strands_it(
    prefill: MockEngineHandle, decode: MockEngineHandle
) -> None:
    ids = prompt(8, 40)
    before = sum(decode.stats(rank).stranded_transfers for rank in decode.ranks)
    c = Client(decode.target)
    try:
        stream = c.inference.GenerateStream(
            decode_request(ids, issued(prefill, ids)),
            metadata=(("x-data-parallel-rank", "0"),),
            timeout=30,
        )
        assert next(stream).HasField("prompt_info")
        stats = decode.stats(0)
        assert (stats.transferring, stats.leaked) == (1, 0)
        stream.cancel()
        wait_until(lambda: not decode.stats(0).active, 5, "the decode dropped")
    finally:
        c.close()
    stats = decode.stats(0)
    assert stats.stranded_transfers == before + 1
    assert (stats.transferring, stats.active, stats.leaked) == (0, 0, 0)


def test_withheld_params_leave_the_finish_without_them(prefill: MockEngineHandle) -> None:
    prefill.faults.withhold_transfer_params(1)
    assert issued(prefill, prompt(9, 20)) == {}
    assert DIGEST_KEY in issued(prefill, prompt(9, 20))


def test_role_is_validated() -> None:
    with pytest.raises(ConfigError, match="role must be one of"):
        make_config(role="router")
    with pytest.raises(ConfigError, match="KV transfer times"):
        make_config(kv_transfer_seconds=-1.0)
