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
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.app.test_demo import ROOT, process, wait_ready
from tests.support.ports import free_port

CLIENTS = ROOT / ".venv-clients"
HERE = Path(__file__).resolve().parent
TASKS = HERE / "lm_eval_tasks"
DRIVERS = HERE / "drivers"
TINY_TOKENIZER = ROOT / "mocker" / "assets" / "tiny-tokenizer"
# The name the tokenizer goes by in the clients' hub cache, for aiperf: in offline mode it
# looks a tokenizer up there by name and cannot load a folder. The others are given the folder
# (transformers, offline, cannot load a hub entry that lacks a model config).
CACHED_TOKENIZER = "rankgate/tiny-tokenizer"
MODEL = "rankgate-mock"
DOCS = 5
CLIENT_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def clients_bin() -> Path:
    """``.venv-clients/bin``; a skip (a failure in CI) when the environment is missing."""
    if (CLIENTS / "bin" / "python").exists():
        return CLIENTS / "bin"
    message = f"{CLIENTS.name} is missing: create it with scripts/client-env"
    if os.environ.get("CI") or os.environ.get("RANKGATE_REQUIRE_CLIENTS") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A bare ``rankgate serve`` (the bundled mock engine, loopback, zero latency); it must
    outlive the clients and log no traceback for anything they sent."""
    port = free_port()
    log = tmp_path_factory.mktemp("gateway") / "serve.log"
    with process(["serve", "--port", str(port), "--mock-speed", "0"], log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc, log)
        yield base
        assert proc.poll() is None, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text(), log.read_text()[-6000:]


@pytest.fixture(scope="module")
def client_env(tmp_path_factory: pytest.TempPathFactory, clients_bin: Path) -> dict[str, str]:
    """The clients' environment: offline, caches in a scratch folder, the tokenizer cached."""
    home = tmp_path_factory.mktemp("clients-home")
    hf_home = home / "hf"
    repo = hf_home / "hub" / f"models--{CACHED_TOKENIZER.replace('/', '--')}"
    revision = "0" * 40
    shutil.copytree(TINY_TOKENIZER, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("RANKGATE_", "PYTHON", "VIRTUAL_ENV", "HF_", "OPENAI_"))
    }
    env.update(
        PATH=f"{clients_bin}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(CLIENTS),
        HOME=str(home),
        XDG_CACHE_HOME=str(home / "cache"),
        MPLCONFIGDIR=str(home / "matplotlib"),
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
        # litellm fetches its model price list at import unless told to use its bundled copy.
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        OPENAI_AGENTS_DISABLE_TRACING="1",
        OPENAI_API_KEY="unused",
        NO_COLOR="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_client(
    name: str, argv: list[str], env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        check=False,
    )
    if run.returncode != 0:
        raise AssertionError(f"{name} exited {run.returncode}:\n{output_of(run)}")
    return run


def output_of(run: subprocess.CompletedProcess[str]) -> str:
    """The client's first error lines (the cause, before the tracebacks), then its last lines."""
    lines = (run.stdout + run.stderr).splitlines()
    errors = [line[:600] for line in lines if "error" in line.lower() or "fail" in line.lower()]
    return "\n".join(["first error lines:", *errors[:8], "last lines:", *lines[-60:]])[-8000:]


def only(paths: list[Path]) -> Path:
    assert len(paths) == 1, paths
    return paths[0]


# lm-eval

# lm-eval's own command line (its ``lm_eval`` entry point), except that the task index holds
# only the ``--include_path`` tasks: indexing the thousands of built-in ones took 9 s a run.
LM_EVAL_CLI = """
import sys
from lm_eval.tasks import TaskManager
init = TaskManager.__init__
def included_only(self, *args, **kwargs):
    init(self, *args, **{**kwargs, "include_defaults": False})
TaskManager.__init__ = included_only
from lm_eval.__main__ import cli_evaluate
sys.exit(cli_evaluate())
"""


def lm_eval(
    clients_bin: Path,
    env: dict[str, str],
    out: Path,
    *,
    model: str,
    endpoint: str,
    task: str,
    extra_model_args: str = "",
    extra: tuple[str, ...] = (),
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``task`` and return lm-eval's results and its samples, checked to cover every doc."""
    # max_retries=1: an errored request fails the run instead of being retried into a pass.
    model_args = f"model={MODEL},base_url={endpoint},num_concurrent=2,max_retries=1"
    argv = [
        str(clients_bin / "python"),
        "-c",
        LM_EVAL_CLI,
        "--model",
        model,
        "--model_args",
        model_args + extra_model_args,
        "--tasks",
        task,
        "--include_path",
        str(TASKS),
        "--output_path",
        str(out),
        "--log_samples",
        *extra,
    ]
    # The tasks name their data files relative to their own folder.
    run = run_client("lm_eval", argv, env, cwd=TASKS)
    assert "API request failed" not in run.stdout + run.stderr, output_of(run)
    results = json.loads(only(sorted(out.rglob("results_*.json"))).read_text())
    samples = [
        json.loads(line)
        for line in only(sorted(out.rglob(f"samples_{task}_*.jsonl"))).read_text().splitlines()
    ]
    assert results["n-samples"][task] == {"original": DOCS, "effective": DOCS}, results
    assert results["results"][task]["sample_len"] == DOCS, results["results"]
    assert sorted(sample["doc_id"] for sample in samples) == list(range(DOCS)), samples
    return results, samples


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
    summary = run_driver(clients_bin, client_env, gateway, "drive_agents.py", tmp_path)
    assert summary["requests"] == 2, summary
