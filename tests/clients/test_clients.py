"""The client suite: real third-party clients against a bare ``rankgate serve`` (demo engine).

lm-eval (``local-completions`` on a loglikelihood task and a generate_until task,
``local-chat-completions``), guidellm and aiperf (short runs), litellm (streamed and not) and
openai-agents (a function tool) each run as a subprocess from ``.venv-clients``, an environment
of their own that ``scripts/client-env`` makes from ``tests/clients/requirements.txt``, so their
dependencies never reach the product's. Each test asserts that the client exited 0 and that no
request errored, by the client's own account: lm-eval's results and samples (every doc
scored), guidellm's JSON report, aiperf's JSON export, the drivers' summaries.

Nothing is downloaded: the tasks' data are the JSON lines files beside their YAML files, the
tokenizer is the demo model's own (given to aiperf as a hub cache entry, since in offline mode it
loads tokenizers only by name from the cache), and the hubs' offline switches are on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.app.processes import wait_ready
from tests.app.test_demo import process
from tests.clients.harness import (
    CACHED_TOKENIZER,
    DRIVERS,
    MODEL,
    TINY_TOKENIZER,
    lm_eval,
    output_of,
    run_client,
)
from tests.support.ports import free_port


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A bare ``rankgate serve`` (the bundled mock engine, loopback, zero latency); it must
    outlive the clients and log no traceback for anything they sent."""
    port = free_port()
    log = tmp_path_factory.mktemp("gateway") / "serve.log"
    with process(["serve", "--port", str(port), "--mock-speed", "0"], log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc, 90, log)
        yield base
        assert proc.poll() is None, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text(), log.read_text()[-6000:]


def test_lm_eval_local_completions_scores_a_loglikelihood_task(
    clients_bin: Path, client_env: dict[str, str], gateway: str, tmp_path: Path
) -> None:
    """Multiple choice: every choice's loglikelihood comes from the prompt's logprobs."""
    _, samples = lm_eval(
        clients_bin,
        client_env,
        tmp_path,
        model="local-completions",
        endpoint=f"{gateway}/v1/completions",
        task="rankgate_mc",
        extra_model_args=f",tokenizer_backend=huggingface,tokenizer={TINY_TOKENIZER}",
    )
    for sample in samples:
        choices = sample["doc"]["choices"]
        assert len(sample["resps"]) == len(choices), sample
        # lm-eval writes each response as strings: [[loglikelihood, is_greedy]] per choice.
        for [[logprob, greedy]] in sample["resps"]:
            assert math.isfinite(float(logprob)), sample
            assert float(logprob) <= 0, sample
            assert greedy in ("True", "False"), sample


def test_lm_eval_local_completions_runs_a_generate_until_task(
    clients_bin: Path, client_env: dict[str, str], gateway: str, tmp_path: Path
) -> None:
    _, samples = lm_eval(
        clients_bin,
        client_env,
        tmp_path,
        model="local-completions",
        endpoint=f"{gateway}/v1/completions",
        task="rankgate_gen",
        extra_model_args=f",tokenizer_backend=huggingface,tokenizer={TINY_TOKENIZER}",
    )
    for sample in samples:
        [[reply]] = sample["resps"]
        assert reply.strip(), sample
        assert "\n" not in reply, sample


def test_lm_eval_local_chat_completions_runs_a_generate_until_task(
    clients_bin: Path, client_env: dict[str, str], gateway: str, tmp_path: Path
) -> None:
    _, samples = lm_eval(
        clients_bin,
        client_env,
        tmp_path,
        model="local-chat-completions",
        endpoint=f"{gateway}/v1/chat/completions",
        task="rankgate_gen",
        extra=("--apply_chat_template",),
    )
    for sample in samples:
        [[reply]] = sample["resps"]
        assert reply.strip(), sample


# Load generators


def test_guidellm_completes_a_short_run_without_errors(
    clients_bin: Path, client_env: dict[str, str], gateway: str, tmp_path: Path
) -> None:
    report = tmp_path / "report.json"
    argv = [
        str(clients_bin / "guidellm"),
        "run",
        "--backend",
        f"kind=openai_http,target={gateway},model={MODEL}",
        "--profile",
        "kind=concurrent,streams=2",
        "--constraint",
        "kind=max_requests,count=12",
        "--tokenizer",
        f"kind=huggingface_auto,model={TINY_TOKENIZER}",
        "--data",
        "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
        "--output",
        f"kind=json,path={report}",
        "--disable-console-interactive",
    ]
    run = run_client("guidellm", argv, client_env, cwd=tmp_path)
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": 12, "errored": 0, "incomplete": 0, "total": 12}, (
        f"{totals}\n{output_of(run)}"
    )
    output_tokens = benchmark["metrics"]["output_token_count"]["successful"]["total_sum"]
    assert output_tokens == 12 * 8, benchmark["metrics"]["output_token_count"]


def test_aiperf_completes_a_short_run_without_errors(
    clients_bin: Path, client_env: dict[str, str], gateway: str, tmp_path: Path
) -> None:
    artifacts = tmp_path / "artifacts"
    argv = [
        str(clients_bin / "aiperf"),
        "profile",
        "--model",
        MODEL,
        "--url",
        gateway,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        CACHED_TOKENIZER,
        "--request-count",
        "12",
        "--concurrency",
        "2",
        "--synthetic-input-tokens-mean",
        "32",
        "--output-tokens-mean",
        "8",
        "--artifact-dir",
        str(artifacts),
        "--ui",
        "none",
        "--no-gpu-telemetry",
    ]
    run = run_client("aiperf", argv, client_env, cwd=tmp_path)
    export = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    context = (
        f"{ {k: export.get(k) for k in ('error_summary', 'request_count')} }\n{output_of(run)}"
    )
    assert export["error_summary"] == [], context
    assert export["request_count"]["avg"] == 12, context
    assert export["is_complete"] is True, context
    assert export["was_cancelled"] is False, context
    records = (artifacts / "profile_export.jsonl").read_text().splitlines()
    assert len(records) == 12, context
    assert not any(json.loads(record).get("error") for record in records), context


# SDKs


def run_driver(
    clients_bin: Path, env: dict[str, str], gateway: str, driver: str, cwd: Path
) -> dict[str, Any]:
    argv = [str(clients_bin / "python"), str(DRIVERS / driver), gateway, MODEL]
    run = run_client(driver, argv, env, cwd=cwd)
    summary: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["errors"] == [], "\n".join(summary["errors"])
    return summary


def test_litellm_chats_streamed_and_not_without_errors(
    clients_bin: Path, client_env: dict[str, str], gateway: str, tmp_path: Path
) -> None:
    summary = run_driver(clients_bin, client_env, gateway, "drive_litellm.py", tmp_path)
    assert summary["requests"] == 5, summary


def test_openai_agents_calls_a_function_tool_without_errors(
    clients_bin: Path, client_env: dict[str, str], gateway: str, tmp_path: Path
) -> None:
    """The SDK's default model (Responses) and its Chat Completions model, streamed and not,
    each a tool round trip to a final answer the demo model ends by itself."""
    summary = run_driver(clients_bin, client_env, gateway, "drive_agents.py", tmp_path)
    assert summary["requests"] == 4, summary
