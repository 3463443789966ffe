"""tests.support.stalls: a prefill KV lease that ran out is the gateway's fault or the engines'.

The lines are vLLM 0.32's own, from a real pair's logs (the Rust frontend's gRPC call lines and
the NIXL worker's lease line), with the times changed.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.real_vllm import RealVllm, RealVllmPair
from tests.support.stalls import (
    Call,
    EngineStalled,
    answered_in_time,
    call,
    expired_request_ids,
    judge_lease_wait,
)

RID = "754f9a5e6d4242ff402203a2-0"
CALL = (
    "(RustFrontend pid=3286) INFO 12-02 {at} [inference.rs:{line}] grpc_inference{{request_id="
    '{rid} rpc="{rpc}" model=rankgate-tiny-llava lora_name= media_count=0 '
    "data_parallel_rank=Some(0)}}: gRPC inference {what}"
)
EXPIRY = (
    "(Worker pid=8335) WARNING 12-02 {at} [base_worker.py:3032] Releasing expired KV blocks for "
    "request {rid}-25bc8869 which were retrieved by 0 remote worker(s) before lease expired."
)


def prefill_lines(rid: str = RID) -> list[str]:
    return [
        CALL.format(at="12:51:12", line=132, rid=rid, rpc="Generate", what="request received"),
        CALL.format(
            at="12:51:12", line=271, rid=rid, rpc="Generate", what="request completed elapsed_ms=88"
        ),
        EXPIRY.format(at="12:51:42", rid=rid),
    ]


def decode_lines(received_at: str, rid: str = RID) -> list[str]:
    return [
        CALL.format(
            at=received_at, line=132, rid=rid, rpc="GenerateStream", what="request received"
        ),
        CALL.format(at=received_at, line=368, rid=rid, rpc="GenerateStream", what="stream closed"),
    ]


def pair(tmp_path: Path, prefill: list[str], decode: list[str]) -> RealVllmPair:
    def side(name: str, lines: list[str]) -> RealVllm:
        log = tmp_path / f"{name}.log"
        log.write_text("\n".join(lines) + "\n")
        return RealVllm(
            target="127.0.0.1:1",
            dp_size=1,
            block_size=32,
            served_model_name="m",
            model_dir=tmp_path,
            kv_events_base_port=0,
            kv_replay_base_port=0,
            log_path=log,
        )

    return RealVllmPair(prefill=side("prefill", prefill), decode=side("decode", decode))


def test_the_lease_line_names_the_callers_request() -> None:
    assert expired_request_ids(prefill_lines()) == [RID]
    assert expired_request_ids(prefill_lines("bbdb100bb4dace8a2a15359a.0-0")) == [
        "bbdb100bb4dace8a2a15359a.0-0"
    ]


def test_a_call_is_dated_by_its_arrival_and_end(tmp_path: Path) -> None:
    pd = pair(tmp_path, prefill_lines(), decode_lines("12:51:13"))
    prefilled, decoded = call(pd.prefill, RID), call(pd.decode, RID)
    assert prefilled.received is not None
    assert prefilled.ended is not None
    assert decoded.received is not None
    assert (decoded.received - prefilled.ended).total_seconds() == 1
    assert call(pd.decode, "another-0") == Call(None, None)


def test_a_decode_handed_off_in_time_makes_the_wait_a_stall(tmp_path: Path) -> None:
    pd = pair(tmp_path, prefill_lines(), decode_lines("12:51:13"))
    with pytest.warns(UserWarning, match="handed off in time"):
        verdict = judge_lease_wait(pd, prefill_lines()[-1:], 31.0)
    assert isinstance(verdict, EngineStalled)
    assert "\n" not in str(verdict)


def test_a_lease_with_no_decode_is_the_gateways_fault(tmp_path: Path) -> None:
    pd = pair(tmp_path, prefill_lines(), decode_lines("12:51:13", rid="other-0"))
    with pytest.warns(UserWarning, match="never handed off") as warned:
        verdict = judge_lease_wait(pd, prefill_lines()[-1:], 31.0)
    assert not isinstance(verdict, EngineStalled)
    assert "never handed off" in str(verdict)
    # CI prints a failure's whole message last: one line there, the engines' logs above.
    assert "\n" not in str(verdict)
    assert "Releasing expired KV blocks" in str(warned[0].message)


def test_a_late_hand_off_is_the_gateways_fault(tmp_path: Path) -> None:
    pd = pair(tmp_path, prefill_lines(), decode_lines("12:51:40"))
    with pytest.warns(UserWarning, match="handed off late"):
        verdict = judge_lease_wait(pd, prefill_lines()[-1:], 31.0)
    assert not isinstance(verdict, EngineStalled)
    assert "handed off late" in str(verdict)


def test_kv_freed_late_by_a_notice_that_came_is_a_stall(tmp_path: Path) -> None:
    pd = pair(tmp_path, prefill_lines()[:2], decode_lines("12:51:13"))
    with pytest.warns(UserWarning, match="freed only after 10 s"):
        verdict = judge_lease_wait(pd, [], 14.0)
    assert isinstance(verdict, EngineStalled)


def test_an_engine_route_past_its_timeout_is_a_stall() -> None:
    with (
        pytest.warns(UserWarning, match="did not answer in time"),
        pytest.raises(EngineStalled),
        answered_in_time("a probe"),
    ):
        raise httpx.ReadTimeout("timed out")


def test_other_errors_of_an_engine_route_are_not() -> None:
    with pytest.raises(httpx.ConnectError), answered_in_time("a probe"):
        raise httpx.ConnectError("refused")
