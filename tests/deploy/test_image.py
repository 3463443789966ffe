"""The container image, without Docker: the Dockerfile's own commands build it, and it serves.

``docker build`` cannot run on these machines, so the test reads the Dockerfile and carries out
its build stage here: WORKDIR, COPY from the repository (the build context) and every RUN
command verbatim through ``/bin/sh -c``, with the image's absolute paths moved under a
temporary directory. The runtime stage's ENV, USER, ENTRYPOINT, HEALTHCHECK and STOPSIGNAL
then start the gateway from that environment against the mock engine, as ``docker run`` would,
with only host, port, engine and tokenizer given as ``-e`` variables.

The one difference from Docker: ``PIP_NO_CACHE_DIR`` is dropped, so pip may reuse this
machine's wheel cache (an image layer has none to reuse; here it saves minutes).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rankgate.mocker.config import MockEngineConfig
from tests.app.processes import wait_ready
from tests.deploy.dockerfile import Dockerfile, Stage, parse
from tests.support.mock_engine import MockEngineHandle, running_mock_engine
from tests.support.ports import free_port, free_port_range

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
TINY_TOKENIZER = ROOT / "rankgate" / "mocker" / "assets" / "tiny-tokenizer"
# The top-level directories the image's build writes to; anything else is refused.
IMAGE_DIRS = ("opt", "src")
_IMAGE_PATH = re.compile(r"(?<![\w./-])/(" + "|".join(IMAGE_DIRS) + r")(?=/|\s|$|:|\"|')")
_ANY_ABSOLUTE = re.compile(r"(?<![\w./$-])/[\w.-]+")
_SYSTEM_PATHS = ("/bin", "/usr", "/etc", "/nonexistent", "/dev", "/tmp")
BUILD_KEYWORDS = {"WORKDIR", "COPY", "RUN", "ENV", "LABEL"}
RUNTIME_KEYWORDS = BUILD_KEYWORDS | {
    "USER",
    "EXPOSE",
    "HEALTHCHECK",
    "STOPSIGNAL",
    "ENTRYPOINT",
}
MODEL = "tiny-llama"

pytestmark = pytest.mark.timeout(900)


@dataclass(frozen=True)
class BuiltImage:
    root: Path
    dockerfile: Dockerfile

    def path(self, image_path: str) -> str:
        return relocate(image_path, self.root)


def relocate(text: str, root: Path) -> str:
    """Move every image path in ``text`` (a path or a shell command) under ``root``."""
    return _IMAGE_PATH.sub(lambda m: f"{root}/{m.group(1)}", text)


def _check_paths(text: str, line: int) -> None:
    for match in _ANY_ABSOLUTE.finditer(text):
        path = match.group(0)
        top = path.split("/")[1]
        assert top in IMAGE_DIRS or path.startswith(_SYSTEM_PATHS), (
            f"Dockerfile line {line} uses {path}; add its top directory to IMAGE_DIRS"
        )


def _copy(sources: list[str], destination: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for source in sources:
        src = ROOT / source
        assert src.exists(), f"COPY source {source} is not in the build context"
        if src.is_dir():
            shutil.copytree(src, destination, symlinks=True, ignore=ignore, dirs_exist_ok=True)
        else:
            destination.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, destination / src.name)


def _readable_by_all(path: str) -> bool:
    parents = Path(path).parents
    return all(p.stat().st_mode & 0o005 == 0o005 for p in parents) and os.access(path, os.X_OK)


def base_python(dockerfile: Dockerfile) -> str:
    """A Python of the base image's minor version, preferably one that the image's non-root
    user can run (this interpreter may live under root's home)."""
    tag = dockerfile.stage("build").base.partition(":")[2]
    version = re.match(r"\d+\.\d+", tag)
    assert version, f"cannot tell the Python version from the base image {tag!r}"
    mine = os.path.realpath(sys.executable)
    found = shutil.which(f"python{version.group(0)}", path="/usr/local/bin:/usr/bin:/bin")
    candidates = [found] if found else []
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version.group(0):
        candidates.append(mine)
    assert candidates, f"no Python {version.group(0)} on this machine"
    reachable = [c for c in candidates if _readable_by_all(c)]
    return (reachable or candidates)[0]


def _build_env(dockerfile: Dockerfile, root: Path) -> dict[str, str]:
    """The builder's environment: this machine's (pip's index settings live there), the
    stage's ENV, and a ``python`` of the base image's version on PATH."""
    base_bin = root / "usr" / "local" / "bin"
    base_bin.mkdir(parents=True, exist_ok=True)
    (base_bin / "python").symlink_to(base_python(dockerfile))
    stage = dockerfile.stage("build")
    env = {
        k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    }
    env["PATH"] = f"{base_bin}:/usr/local/bin:/usr/bin:/bin"
    env.update({k: relocate(v, root) for k, v in stage.env(env).items()})
    env.pop("PIP_NO_CACHE_DIR", None)
    return env


def build(root: Path) -> Dockerfile:
    dockerfile = parse(DOCKERFILE)
    stage = dockerfile.stage("build")
    env = _build_env(dockerfile, root)
    cwd = root
    for instruction in stage.instructions:
        _check_paths(instruction.arguments, instruction.line)
        assert instruction.keyword in BUILD_KEYWORDS, (
            f"line {instruction.line}: teach this test what {instruction.keyword} means"
        )
        if instruction.keyword == "WORKDIR":
            cwd = Path(relocate(instruction.arguments, root))
            cwd.mkdir(parents=True, exist_ok=True)
        elif instruction.keyword == "COPY":
            *sources, destination = shlex.split(instruction.arguments)
            assert not any(s.startswith("--") for s in sources), "COPY flags in the build stage"
            target = Path(relocate(destination, root))
            _copy(sources, target if target.is_absolute() else cwd / target)
        elif instruction.keyword == "RUN":
            command = relocate(instruction.arguments, root)
            done = subprocess.run(
                ["/bin/sh", "-c", command],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=720,
                check=False,
            )
            assert done.returncode == 0, (
                f"RUN at Dockerfile line {instruction.line} failed ({done.returncode}):\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
    runtime = dockerfile.stage("runtime")
    for copy in runtime.all("COPY"):
        flags, paths = _split_flags(copy.arguments)
        assert flags.get("from") == "build", "the runtime stage copies only from the build stage"
        # The venv's scripts name their interpreter by absolute path: it must not move.
        assert paths[0] == paths[1], "the venv must keep its path between the stages"
    return dockerfile


def _split_flags(arguments: str) -> tuple[dict[str, str], list[str]]:
    flags: dict[str, str] = {}
    paths: list[str] = []
    for word in shlex.split(arguments):
        if word.startswith("--"):
            key, _, value = word[2:].partition("=")
            flags[key] = value
        else:
            paths.append(word)
    return flags, paths


@pytest.fixture(scope="module")
def image() -> Iterator[BuiltImage]:
    root = Path(tempfile.mkdtemp(prefix="rankgate-image-"))
    root.chmod(0o755)  # the image's non-root user must be able to read it
    try:
        yield BuiltImage(root=root, dockerfile=build(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def mock() -> Iterator[MockEngineHandle]:
    config = MockEngineConfig(
        host="127.0.0.1",
        port=free_port(),
        dp_size=2,
        block_size=16,
        model=MODEL,
        tokenizer=str(TINY_TOKENIZER),
        kv_events_port=free_port_range(2),
        kv_replay_port=free_port_range(2),
        speed=0.0,
    )
    with running_mock_engine(config) as handle:
        yield handle


def _runtime_env(image: BuiltImage, overrides: dict[str, str]) -> dict[str, str]:
    base = {"PATH": "/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/nonexistent"}
    env = image.dockerfile.stage("runtime").env(base)
    return {**base, **{k: image.path(v) for k, v in env.items()}, **overrides}


def _healthcheck(stage: Stage) -> tuple[list[str], float]:
    """The HEALTHCHECK's exec-form command and its start period in seconds."""
    text = stage.one("HEALTHCHECK").arguments
    options, _, command = text.partition("CMD ")
    period = re.search(r"--start-period=(\d+)s", options)
    argv = json_argv(command)
    return argv, float(period.group(1)) if period else 0.0


def json_argv(text: str) -> list[str]:
    from tests.deploy.dockerfile import Instruction

    argv = Instruction("CMD", text, 0).exec_form()
    assert argv is not None, "use the exec (JSON) form"
    return argv


def _user(stage: Stage) -> tuple[int, int]:
    user, _, group = stage.one("USER").arguments.partition(":")
    assert user.isdigit(), "a numeric USER lets Kubernetes check runAsNonRoot"
    assert group.isdigit(), "USER names the group by number too"
    return int(user), int(group)


def _installed_tokenizer(image: BuiltImage) -> Path:
    found = list(
        Path(image.path("/opt/rankgate")).glob("lib/python*/site-packages/rankgate/mocker/assets/*")
    )
    assert found, "the mocker's tiny tokenizer is not in the installed package"
    return found[0]


def test_image_user_matches_the_useradd(image: BuiltImage) -> None:
    runtime = image.dockerfile.stage("runtime")
    uid, gid = _user(runtime)
    assert uid != 0
    commands = " ".join(i.arguments for i in runtime.all("RUN"))
    assert f"--uid {uid}" in commands
    assert f"--gid {gid}" in commands


def test_the_build_stage_compiles_for_the_runtime_python() -> None:
    """The compiled modules and the environment's interpreter link come from the build stage's
    Python; the runtime stage must run the same minor version, from the same distribution."""
    dockerfile = parse(DOCKERFILE)
    build_tag = dockerfile.stage("build").base.partition(":")[2]
    runtime_tag = dockerfile.stage("runtime").base.partition(":")[2]
    version = re.compile(r"(\d+\.\d+)-(?:slim-)?(\w+)$")
    built, runs = version.match(build_tag), version.match(runtime_tag)
    assert built, build_tag
    assert runs, runtime_tag
    assert built.groups() == runs.groups(), (build_tag, runtime_tag)


def test_the_image_routes_with_the_compiled_router(image: BuiltImage) -> None:
    """The build stage compiles the route decision's modules (setup.py's list); the runtime
    imports them compiled, and nothing it needs went with the build tools."""
    site = Path(image.path("/opt/rankgate")).glob("lib/python*/site-packages")
    packages = next(site)
    compiled = {
        str(path.relative_to(packages)).split(".")[0]
        for path in (packages / "rankgate" / "sidecar" / "routing").rglob("*.so")
    }
    assert "rankgate/sidecar/routing/policies/kv" in compiled, compiled
    assert "rankgate/sidecar/routing/index" in compiled, compiled
    assert not list(packages.glob("mypy/")), "mypy left in the image"
    python = image.path("/opt/rankgate/bin/python")
    probe = subprocess.run(
        [python, "-c", "import rankgate.sidecar.routing.policies.kv as m; print(m.__file__)"],
        env=_runtime_env(image, {}),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().endswith(".so"), probe.stdout


def test_gateway_from_the_image_serves_the_mock_engine(
    image: BuiltImage, mock: MockEngineHandle
) -> None:
    runtime = image.dockerfile.stage("runtime")
    port = free_port()
    env = _runtime_env(
        image,
        {
            # What `docker run -e ...` would set; the host stays on loopback in tests.
            "RANKGATE_HOST": "127.0.0.1",
            "RANKGATE_PORT": str(port),
            "RANKGATE_ENGINE": mock.target,
            "RANKGATE_TOKENIZER": str(_installed_tokenizer(image)),
        },
    )
    entrypoint = runtime.one("ENTRYPOINT").exec_form()
    assert entrypoint is not None
    program = shutil.which(entrypoint[0], path=env["PATH"])
    assert program is not None
    assert program.startswith(str(image.root)), f"{entrypoint[0]} resolves outside the image"
    uid, gid = _user(runtime)
    interpreter = os.path.realpath(image.path("/opt/rankgate/bin/python"))
    # As the image's user when this machine allows it: proves nothing needs root or writes.
    switch = os.geteuid() == 0 and _readable_by_all(interpreter)
    as_user = {"user": uid, "group": gid, "extra_groups": []} if switch else {}
    log = image.root / "gateway.log"
    with log.open("wb") as out:
        gateway = subprocess.Popen(  # type: ignore[call-overload]
            [program, *entrypoint[1:]],
            env=env,
            cwd="/",
            stdout=out,
            stderr=subprocess.STDOUT,
            **as_user,
        )
    try:
        healthcheck, start_period = _healthcheck(runtime)
        base = f"http://127.0.0.1:{port}"
        # The HEALTHCHECK asks /ready too: once the gateway is ready it passes.
        wait_ready(base, gateway, max(start_period, 30.0), log)
        probe = subprocess.run(healthcheck, env=env, capture_output=True, timeout=10)
        assert probe.returncode == 0, f"HEALTHCHECK failed:\n{probe.stderr.decode()[-2000:]}"
        ready = httpx.get(f"{base}/ready", timeout=5)
        assert ready.status_code == 200
        assert ready.json() == {
            "ready": True,
            "model": MODEL,
            "engine_version": ready.json()["engine_version"],
            "dp_size": 2,
        }
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello from the image"}],
                "max_tokens": 5,
                "temperature": 0,
            },
            timeout=30,
        )
        assert reply.status_code == 200, f"{reply.text}\n{log.read_text()[-4000:]}"
        assert reply.json()["usage"]["completion_tokens"] == 5

        stop = getattr(signal, runtime.one("STOPSIGNAL").arguments)
        gateway.send_signal(stop)
        # uvicorn drains, then re-raises the signal: Docker reports 128 + signal, not 0.
        assert gateway.wait(35) in (0, -stop), log.read_text()[-4000:]
        assert "Application shutdown complete" in log.read_text()
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait(10)


def test_the_image_refuses_to_start_without_an_engine(image: BuiltImage) -> None:
    """`docker run rankgate` with no RANKGATE_ENGINE exits at once naming the variable,
    instead of serving the bundled demo engine on 0.0.0.0."""
    runtime = image.dockerfile.stage("runtime")
    env = _runtime_env(image, {"RANKGATE_PORT": str(free_port())})
    assert "RANKGATE_ENGINE" not in env
    entrypoint = runtime.one("ENTRYPOINT").exec_form()
    assert entrypoint is not None
    program = shutil.which(entrypoint[0], path=env["PATH"])
    assert program is not None
    done = subprocess.run(
        [program, *entrypoint[1:]], env=env, cwd="/", capture_output=True, timeout=120
    )
    assert done.returncode != 0
    assert b"RANKGATE_ENGINE" in done.stderr, done.stderr[-2000:]
