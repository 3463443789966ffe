"""The load test runs in a plain locust install against a bare ``rankgate serve``.

A user who only ran ``pip install locust`` has neither orjson nor Pillow, so the locust run is
started with them made unimportable (Pillow stays for a run with images, which documents that
it needs it); locust's own exit status counts every failed request.
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.app.processes import wait_ready
from tests.app.test_demo import ROOT, process
from tests.support.ports import free_port


def plain_locust(*blocked: str) -> str:
    """A locust entry point that cannot import ``blocked``, as in a plain install."""
    hide = "".join(f"sys.modules[{name!r}] = None; " for name in blocked)
    return f"import sys; {hide}from locust.main import main; sys.exit(main())"


def warm_decoders(base: str) -> None:
    """One image served before the run: a gateway's decoder processes start with its first
    image (about a second), which a three-second run must not spend waiting."""
    png = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 40)).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    ("images", "blocked"), [(0, ("orjson", "PIL")), (1, ("orjson",))], ids=["text", "images"]
)
def test_the_load_test_streams_through_the_gateway_without_rankgates_dependencies(
    tmp_path: Path, images: int, blocked: tuple[str, ...]
) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with process(["serve", "--port", str(port), "--mock-speed", "0"], log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc, 90, log)
        if images:
            warm_decoders(base)
        options = (
            f"--headless -H {base} -u 2 -r 2 -t 3s --stream --max-tokens 8 --only-summary "
            f"--shared-prefix-words 40 --images {images} --image-size 32 --think-seconds 0.05"
        )
        locustfile = str(ROOT / "bench" / "locustfile.py")
        run = subprocess.run(
            [sys.executable, "-c", plain_locust(*blocked), "-f", locustfile, *options.split()],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    summary = output[output.index("LLM summary") :]
    completed = int(summary.split(", ", 1)[1].split(" completed", 1)[0])
    assert completed > 0, summary
    assert "TTFT ms" in summary, summary
