"""The committed stubs are exactly what ``scripts/gen_protos.py`` produces from ``protos/``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    written = _load_generator().generate(tmp_path)
    committed = ROOT / "rankgate" / "wire" / "proto"
    fresh_names = {p.name for p in written}
    committed_names = {p.name for p in (committed / "vllm").iterdir() if p.is_file()}
    assert fresh_names == committed_names, "stub set changed: run scripts/gen_protos.py"
    stale = [p.name for p in written if p.read_text() != (committed / "vllm" / p.name).read_text()]
    assert not stale, f"stale stubs {stale}: run scripts/gen_protos.py and commit"


def test_wire_numbers_match_vllm() -> None:
    """Spot-check the field numbers everything else relies on (SPEC.md section 2)."""
    from rankgate.wire.proto.vllm import control_pb2, inference_pb2

    def numbers(message: type) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert numbers(inference_pb2.GenerateRequest) == {
        "request_id": 1, "model": 2, "text": 3, "token_ids": 4, "temperature": 5,
        "sampling": 6, "decoding": 7, "stopping": 8, "response": 9, "kv": 10,
        "truncate_prompt_tokens": 11, "priority": 12, "session_id": 13, "media": 14,
        "lora_name": 15,
    }  # fmt: skip
    assert numbers(inference_pb2.MediaItem) == {
        "modality": 1, "url": 2, "data_uri": 3, "raw_bytes": 4, "mime_type": 5, "uuid": 6,
        "features": 7,
    }  # fmt: skip
    assert numbers(inference_pb2.FinishInfo)["ec_transfer_params"] == 8
    assert numbers(control_pb2.ServerInfo)["effective_attention_block_size"] == 14
    assert numbers(control_pb2.ModelInfo)["tool_call_parser"] == 25
    assert numbers(control_pb2.KvEventSource)["data_parallel_rank"] == 5
    services = {s.full_name for s in inference_pb2.DESCRIPTOR.services_by_name.values()}
    assert services == {"vllm.Inference"}
