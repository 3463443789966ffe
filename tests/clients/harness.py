"""What the client-suite modules share: the clients' environment, running one, lm-eval."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.app.test_demo import ROOT

CLIENTS = ROOT / ".venv-clients"
HERE = Path(__file__).resolve().parent
TASKS = HERE / "lm_eval_tasks"
DRIVERS = HERE / "drivers"
TINY_TOKENIZER = ROOT / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
# The name the tokenizer goes by in the clients' hub cache, for aiperf: in offline mode it
# looks a tokenizer up there by name and cannot load a folder. The others are given the folder
# (transformers, offline, cannot load a hub entry that lacks a model config).
CACHED_TOKENIZER = "rankgate/tiny-tokenizer"
MODEL = "rankgate-mock"
DOCS = 5
CLIENT_TIMEOUT_S = 180


def clients_bin() -> Path:
    """``.venv-clients/bin``; a skip (a failure in CI) when the environment is missing."""
    if (CLIENTS / "bin" / "python").exists():
        return CLIENTS / "bin"
    message = f"{CLIENTS.name} is missing: create it with scripts/client-env"
    if os.environ.get("CI") or os.environ.get("RANKGATE_REQUIRE_CLIENTS") == "1":
        pytest.fail(message)
    pytest.skip(message)


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
    served: str = MODEL,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``task`` and return lm-eval's results and its samples, checked to cover every doc."""
    # max_retries=1: an errored request fails the run instead of being retried into a pass.
    model_args = f"model={served},base_url={endpoint},num_concurrent=2,max_retries=1"
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
