"""A real prefill/decode pair that stops keeping time, told apart from a gateway fault.

Fresh-clone CI runs on two cores have, in four submissions, caught vLLM's prefill engine
answering probes only after tens of seconds, or never hearing a decode's read notice before
its 30 s KV lease ended although that decode had read the whole prompt. No run here did, with
or without both cores kept busy, over shared memory or over TCP only. Such a case says nothing
about KV lifetimes either way, so it raises :class:`EngineStalled`: a warning carries what both
engines logged (the report shows it even when a rerun passes) and ``RERUN_ON_STALLS`` runs the
test again, at most twice. A gateway that really leaves KV to its lease does so on every run
and still fails; so does any other error.

Errors raised here carry one line. CI prints each failure's whole message in the summary that
ends the output, so the engines' logs go in a warning, printed above it, and a failure's name
and what it asserts stay among the last lines.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.support.real_vllm import LEASE_ENDED, RealVllm, RealVllmPair, tail


class EngineStalled(AssertionError):
    """The engines, not the gateway, kept a case from saying anything about the KV."""


RERUN_ON_STALLS = pytest.mark.flaky(reruns=2, only_rerun=[EngineStalled])
# A finished prefill's decode reaches the decode engine within this (log seconds, 1 s steps).
HAND_OFF_LIMIT_S = 10.0

# vLLM's Rust frontend logs each gRPC call's arrival and end:
# "... INFO 12-02 13:34:35 [inference.rs:132] grpc_inference{request_id=ID rpc="Generate" ...}:
# gRPC inference request received".
_CALL = re.compile(
    r"(\d\d-\d\d \d\d:\d\d:\d\d) \[[^\]]*\] grpc_inference\{request_id=(\S+) .*?"
    r"gRPC inference (request received|request completed|stream closed)"
)
# vLLM's worker names a lease it ended by its own request id: the caller's plus "-" and 8 hex.
_EXPIRED = re.compile(re.escape(LEASE_ENDED) + r"(\S+)-[0-9a-f]{8} which")


def explained(error: type[AssertionError], headline: str, details: str) -> AssertionError:
    """``error`` with ``headline`` alone; the warning in the report adds ``details``."""
    warnings.warn(f"{headline}\n{details}" if details else headline, stacklevel=3)
    return error(headline)


def stalled(headline: str, details: str = "") -> EngineStalled:
    """An :class:`EngineStalled` of one line, the report's warning adding ``details``."""
    error = explained(EngineStalled, headline, details)
    assert isinstance(error, EngineStalled)
    return error


@contextlib.contextmanager
def answered_in_time(what: str) -> Iterator[None]:
    """An engine's HTTP route (``/metrics``, ``/reset_prefix_cache``) that ran past its timeout
    has stalled: the case learns nothing from it."""
    try:
        yield
    except httpx.TimeoutException as error:
        raise stalled(f"{what}: vLLM did not answer in time ({error!r})") from error


@dataclass(frozen=True)
class Call:
    """What one engine's log says of one request: when it arrived and ended (log seconds)."""

    received: datetime | None
    ended: datetime | None


def call(server: RealVllm, request_id: str) -> Call:
    received = ended = None
    for line in _lines(server.log_path):
        found = _CALL.search(line)
        if found is None or found[2] != request_id:
            continue
        at = datetime.strptime(found[1], "%m-%d %H:%M:%S")
        if found[3] == "request received":
            received = received or at
        else:
            ended = at
    return Call(received, ended)


def expired_request_ids(lines: list[str]) -> list[str]:
    """The caller's request ids of vLLM's "Releasing expired KV blocks" lines."""
    return [found[1] for line in lines if (found := _EXPIRED.search(line))]


def related_lines(server: RealVllm, request_ids: Sequence[str], limit: int = 30) -> str:
    """The log lines naming any of ``request_ids``, or warning and erring, newest last."""
    lines = [
        line
        for line in _lines(server.log_path)
        if any(rid in line for rid in request_ids) or " WARNING " in line or " ERROR " in line
    ]
    return "\n".join(lines[-limit:])


def diagnosis(pair: RealVllmPair, request_ids: Sequence[str] = ()) -> str:
    """What both engines and the machine were doing, for a stall's report."""
    busiest = subprocess.run(
        ["ps", "-eo", "pid,ppid,psr,pcpu,stat,etimes,comm", "--sort=-pcpu"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.splitlines()[:15]
    parts = [f"first hand-off {pair.first_hand_off_s} s"]
    for name, side in (("prefill", pair.prefill), ("decode", pair.decode)):
        if request_ids:
            parts += [f"{name} engine's lines on {list(request_ids)}:"]
            parts.append(related_lines(side, request_ids))
        parts += [f"{name} engine's log:", tail(side.log_path, 20)]
    return "\n".join([*parts, "busiest processes:", *busiest])


def judge_lease_wait(pd: RealVllmPair, late: list[str], waited: float) -> AssertionError:
    """The error for KV the prefill side kept long after the request.

    The gateway's part is to hand every finished prefill's KV to a decode at once; after that,
    freeing it is the engines' own business (the decode's read notice over NIXL). A lease that
    ended with no decode handed off, or one handed off late, is the gateway's fault; one whose
    decode arrived in time, or KV freed late by a notice that did come, is
    :class:`EngineStalled`."""
    rids = expired_request_ids(late)
    settled = f"(settled after {waited:.1f} s)"
    report = f"{late}\n{diagnosis(pd, rids)}"
    if len(rids) < len(late):
        headline = f"prefill KV waited out its lease, of a request unnamed {settled}"
        return explained(AssertionError, headline, report)
    for rid in rids:
        prefilled, decoded = call(pd.prefill, rid), call(pd.decode, rid)
        done = prefilled.ended or prefilled.received
        if decoded.received is None:
            return explained(
                AssertionError,
                f"prefill KV of {rid} waited out its lease, never handed off {settled}",
                report,
            )
        if done is not None and (decoded.received - done).total_seconds() > HAND_OFF_LIMIT_S:
            return explained(
                AssertionError,
                f"prefill KV of {rid} waited out its lease, handed off late {settled}",
                report,
            )
    what = "prefill KV waited out its lease" if late else "prefill KV freed only after 10 s"
    return stalled(f"{what} although each decode was handed off in time {settled}", report)


def _lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines()
