"""A decode that misses its prefill's KV lease on a real prefill/decode pair is never answered
from that KV.

The pair's prefill engine holds a finished prefill's KV for ``SHORT_KV_LEASE`` seconds
(vLLM's ``kv_lease_duration``). The decode engine is stopped (SIGSTOP on its process group)
before the request is sent, so the prefill finishes and its decode cannot start; the prefill
engine's log then says the lease ended with the KV read by no one. Only after that is the
decode engine let go on. Whatever the late decode reads then is not the prompt's KV: the
client must get the decode engine's own prefill of the prompt instead, the same answer the
decode engine gives alone.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from typing import Any

import httpx
import pytest

from rankgate.sidecar import DisaggConfig
from tests.conftest import SHORT_KV_LEASE
from tests.disagg.test_real_vllm_pd import body, gateway_for, metrics, unique_text
from tests.support.metrics import metric_total
from tests.support.polling import wait_until
from tests.support.real_vllm import LEASE_ENDED, RealVllm, RealVllmPair

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]


def lease_ended_unread(server: RealVllm, request_id: str) -> bool:
    """Whether the engine logged the end of a lease on KV of the gateway request
    ``request_id`` (its engine ids extend it) that no decode had read."""
    text = server.log_path.read_text(errors="replace")
    return any(
        f"{LEASE_ENDED}{request_id}-" in line and "retrieved by 0 " in line
        for line in text.splitlines()
    )


def ask(url: str, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=300)


def test_a_decode_that_misses_the_lease_is_prefilled_again_on_the_decode_engine(
    real_pd_short_lease: RealVllmPair,
) -> None:
    pd = real_pd_short_lease
    model = pd.decode.served_model_name
    payload = body(model, unique_text(), max_tokens=12, request_id=f"lease-{time.monotonic_ns()}")
    # No health check may find the stopped engine: this is about the lease, not readiness.
    remote = DisaggConfig(prefill_mode="remote", kv_lease=SHORT_KV_LEASE, seed_first_token=False)
    alone = DisaggConfig(prefill_mode="local")
    with gateway_for(pd, disagg=alone) as url:
        reference = ask(url, {**payload, "request_id": payload["request_id"] + "-alone"})
    assert reference.status_code == 200, reference.text
    served = metrics(pd.prefill)["request_success_total"]
    with (
        gateway_for(pd, disagg=remote, health_interval=120.0) as url,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        os.killpg(pd.decode.pid, signal.SIGSTOP)
        try:
            answer = pool.submit(ask, url, payload)
            wait_until(
                lambda: metrics(pd.prefill)["request_success_total"] > served, 60, "the prefill"
            )
            # The prefill engine ends the lease with the KV read by no decode.
            wait_until(
                lambda: lease_ended_unread(pd.prefill, payload["request_id"]),
                SHORT_KV_LEASE + 30.0,
                "the prefill engine ending the lease",
            )
        finally:
            os.killpg(pd.decode.pid, signal.SIGCONT)
        response = answer.result(timeout=240)
        assert response.status_code == 200, response.text
        assert response.json()["choices"] == reference.json()["choices"]
        with httpx.Client(base_url=url) as client:
            assert metric_total(client, "rankgate_pd_kv_lease_missed_total", stage="sent") == 1
