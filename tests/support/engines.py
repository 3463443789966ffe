"""One description of "a vLLM endpoint under test", whether it is the mocker or real vLLM.

The conformance suite is written against this type only, so the very same tests pin down the
facts on both engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class EngineUnderTest:
    kind: Literal["mock", "real"]
    target: str
    dp_size: int
    block_size: int
    served_model_name: str
    tokenizer_dir: Path
    kv_events_base_port: int | None
    kv_replay_base_port: int | None
    # The mocker's in-process handle (counters, faults); None for real vLLM.
    mock: Any = None
    # Real vLLM's own OpenAI HTTP server on the same engine (empty for the mocker).
    http_url: str = ""
    # "split": KV-event discovery moved from vllm.Control to vllm.KvTransfer (vLLM main).
    grpc_services: Literal["combined", "split"] = "combined"

    @property
    def host(self) -> str:
        return self.target.rsplit(":", 1)[0]
