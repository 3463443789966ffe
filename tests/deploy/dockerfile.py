"""A small Dockerfile reader: stages and their instructions, so tests follow the real file.

It understands what our Dockerfile uses (parser directives, comments, line continuations, ARG,
FROM ... AS, and JSON or shell forms) and nothing more; hadolint is the linter.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

_CONTINUATION = re.compile(r"\\\s*$")
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON (exec) form's argv, or None for the shell form."""
        text = self.arguments.strip()
        if not text.startswith("["):
            return None
        value = json.loads(text)
        assert isinstance(value, list)
        return [str(item) for item in value]


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert len(found) == 1, f"expected one {keyword} in stage {self.name}, got {found}"
        return found[0]

    def env(self, outer: dict[str, str]) -> dict[str, str]:
        """The stage's ENV values in order, each expanded against ``outer`` and earlier ones."""
        values: dict[str, str] = {}
        for instruction in self.all("ENV"):
            for pair in shlex.split(instruction.arguments):
                key, sep, value = pair.partition("=")
                assert sep, f"line {instruction.line}: use ENV KEY=VALUE"
                values[key] = expand(value, {**outer, **values})
        return values


@dataclass
class Dockerfile:
    args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)


def expand(text: str, values: dict[str, str]) -> str:
    return _VARIABLE.sub(lambda m: values.get(m.group(1) or m.group(2), ""), text)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    lines: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comments inside a continued instruction are dropped, as Docker does
        if not pending:
            start = number
        if _CONTINUATION.search(raw):
            pending.append(_CONTINUATION.sub("", raw))
            continue
        pending.append(raw)
        lines.append((start, " ".join(part.strip() for part in pending)))
        pending = []
    assert not pending, "the Dockerfile ends inside a continued line"
    return lines


def parse(path: Path) -> Dockerfile:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, text in _logical_lines(path.read_text()):
        keyword, _, arguments = text.partition(" ")
        keyword = keyword.upper()
        arguments = arguments.strip()
        if keyword == "ARG" and not stages:
            name, _, default = arguments.partition("=")
            args[name] = default
        elif keyword == "FROM":
            parts = arguments.split()
            base = expand(parts[0], args)
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name=name, base=base))
        else:
            assert stages, f"line {line}: {keyword} before FROM"
            stages[-1].instructions.append(Instruction(keyword, arguments, line))
    return Dockerfile(args=args, stages=stages)
