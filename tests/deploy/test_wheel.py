"""The wheel: everything it installs lives under ``rankgate/``, so no generic top-level name
(``app``, ``sidecar``) can collide with another distribution's, and its console script runs
from the wheel alone, not from the checkout."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the Dockerfile copies into its build context, and so all a build may read.
SOURCES = ("pyproject.toml", "README.md", "setup.py", "rankgate")

pytestmark = pytest.mark.timeout(600)


def build_wheel(source: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(source)],
        check=True,
        timeout=300,
    )  # fmt: skip
    (built,) = out.glob("rankgate-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    context = tmp_path_factory.mktemp("context")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, context / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(src, context / name)
    return build_wheel(context, tmp_path_factory.mktemp("dist"))


def _contents(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_a_checkout_without_symlinks_builds_the_same_wheel(tmp_path: Path) -> None:
    """Windows' default git writes a symlink as a text file holding its target; the wheel built
    from such a checkout must be this one, byte for byte."""
    wheels = []
    for symlinks in ("true", "false"):
        clone = tmp_path / f"symlinks-{symlinks}"
        subprocess.run(
            ["git", "-c", f"core.symlinks={symlinks}", "clone", "-q", str(ROOT), str(clone)],
            check=True,
            timeout=120,
        )
        wheels.append(_contents(build_wheel(clone, tmp_path / f"dist-{symlinks}")))
    with_links, without = wheels
    assert sorted(with_links) == sorted(without)
    assert with_links == without


def test_everything_installs_under_rankgate(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    dist_info = {top for top in tops if top.endswith(".dist-info")}
    assert tops - dist_info == {"rankgate"}
    for part in ("app", "sidecar", "multimodal", "mocker", "wire"):
        assert f"rankgate/{part}/__init__.py" in names
    assert "rankgate/wire/proto/vllm/inference_pb2.py" in names
    assert "rankgate/mocker/assets/tiny-tokenizer/tokenizer.json" in names
    assert "rankgate/py.typed" in names


def test_the_console_script_runs_from_the_wheel(wheel: Path, tmp_path: Path) -> None:
    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    (dist_info,) = installed.glob("*.dist-info")
    entry_points = configparser.ConfigParser()
    entry_points.read(dist_info / "entry_points.txt")
    target = entry_points["console_scripts"]["rankgate"]
    module, _, function = target.partition(":")
    # The script pip would write: the wheel's target, with the wheel first on the path and the
    # checkout nowhere on it (the test environment's own packages give the dependencies).
    script = (
        "import sys, rankgate\n"
        f"assert rankgate.__file__.startswith({str(installed)!r}), rankgate.__file__\n"
        f"from {module} import {function}\n"
        f"sys.argv[0] = 'rankgate'\n"
        f"sys.exit({function}())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(installed)}
    for argv in (["--version"], ["serve", "--help"], ["mock-engine", "--help"]):
        done = subprocess.run(
            [sys.executable, "-c", script, *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip(), argv
    assert not (installed / "app").exists()
