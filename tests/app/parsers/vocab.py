"""Small tokenizers that carry one output format's special tokens, built from the tiny one.

Each format's markers must be single tokens, as they are in the real models, because some of
vLLM's parsers (and the chunkings of the differential tests) work on token ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from rankgate.app.parsers.json_calls import deepseek_token
from tests.conftest import TINY_TOKENIZER

# Markers per family: (special, ordinary added). The tiny tokenizer already has
# <think>, </think>, <tool_call> and </tool_call> as added tokens.
FAMILY_TOKENS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "chatml": ((), ()),
    "llama": (("<|python_tag|>", "<|eom_id|>", "<|eot_id|>"), ()),
    "llama4": (("<|python_start|>", "<|python_end|>", "<|eom|>", "<|eot|>"), ()),
    "mistral": (("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"), ()),
    # Tokenizers before v11 have the call marker only.
    "mistral_v7": (("[TOOL_CALLS]",), ()),
    "deepseek": (
        tuple(
            deepseek_token(words)
            for words in (
                "tool calls begin",
                "tool calls end",
                "tool call begin",
                "tool call end",
                "tool sep",
                "end of sentence",
            )
        ),
        (),
    ),
    "kimi": (
        (
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
        (),
    ),
    "glm": ((), ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
    "granite": (("<|tool_call|>",), ()),
    "step3": ((), ()),
    # gpt-oss's harmony markers on the tiny vocabulary (the real o200k one is not needed: the
    # gateway parses detokenized text).
    "gptoss": (
        (
            "<|start|>",
            "<|channel|>",
            "<|message|>",
            "<|end|>",
            "<|call|>",
            "<|return|>",
            "<|constrain|>",
        ),
        (),
    ),
}


def build_tokenizer(family: str, into: Path) -> Path:
    """Write a tokenizer directory for ``family`` under ``into`` and return it."""
    target = into / f"tokenizer-{family}"
    if (target / "tokenizer.json").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    special, ordinary = FAMILY_TOKENS[family]
    tok = Tokenizer.from_file(str(TINY_TOKENIZER / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ordinary])
    tok.save(str(target / "tokenizer.json"))
    config = json.loads((TINY_TOKENIZER / "tokenizer_config.json").read_text())
    decoder = config.setdefault("added_tokens_decoder", {})
    for content in (*special, *ordinary):
        token_id = tok.token_to_id(content)
        decoder[str(token_id)] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": content in special,
        }
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(TINY_TOKENIZER / "special_tokens_map.json", target)
    return target
