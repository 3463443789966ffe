"""lm-eval scores the same through Rankgate as straight from vLLM's own server, on real vLLM.

The loglikelihood task of the client suite runs twice on the same engine: through a gateway,
and against vLLM's own OpenAI server. Every request's loglikelihood must agree to float
tolerance, and so must the scores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.server import create_app
from tests.app.serving import serve_app
from tests.clients.harness import lm_eval
from tests.support.engines import EngineUnderTest

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def real_gateway(real_vllm: EngineUnderTest) -> Iterator[str]:
    settings = GatewaySettings(engine=real_vllm.target, tokenizer=str(real_vllm.tokenizer_dir))
    with serve_app(create_app(settings), timeout=300) as url:
        yield url


def test_lm_eval_loglikelihood_agrees_with_vllms_own_server(
    clients_bin: Path,
    client_env: dict[str, str],
    real_vllm: EngineUnderTest,
    real_gateway: str,
    tmp_path: Path,
) -> None:
    # Text prompts: vLLM's Rust frontend refuses a batch of token-id prompts, the shape
    # lm-eval sends when it tokenizes (the gateway takes both).
    tokenizer = (
        f",tokenizer_backend=huggingface,tokenizer={real_vllm.tokenizer_dir}"
        ",tokenized_requests=False"
    )
    runs = {}
    for name, base in (("rankgate", real_gateway), ("vllm", real_vllm.http_url)):
        runs[name] = lm_eval(
            clients_bin,
            client_env,
            tmp_path / name,
            model="local-completions",
            endpoint=f"{base}/v1/completions",
            task="rankgate_mc",
            extra_model_args=tokenizer,
            served=real_vllm.served_model_name,
        )
    (ours, our_samples), (theirs, their_samples) = runs["rankgate"], runs["vllm"]
    by_doc = {sample["doc_id"]: sample for sample in their_samples}
    for sample in our_samples:
        other = by_doc[sample["doc_id"]]
        assert len(sample["resps"]) == len(other["resps"])
        for [[mine, my_greedy]], [[vllm, vllm_greedy]] in zip(
            sample["resps"], other["resps"], strict=True
        ):
            assert float(mine) == pytest.approx(float(vllm), abs=1e-3), sample["doc_id"]
            assert my_greedy == vllm_greedy, sample["doc_id"]
    task = "rankgate_mc"
    assert ours["results"][task] == pytest.approx(theirs["results"][task]), (
        ours["results"][task],
        theirs["results"][task],
    )
    print(f"lm-eval {task}: rankgate {ours['results'][task]} vllm {theirs['results'][task]}")
