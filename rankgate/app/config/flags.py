"""One way to declare a ``rankgate serve`` setting, and the settings built from the flags.

A :class:`Flag` names its command-line flag and the field of :class:`GatewaySettings` it sets
(a dotted path into the settings and their sections, ``"limits.max_body_bytes"``); the flag's
default is that field's default, its ``RANKGATE_<FLAG>`` twin and its row in
``docs/configuration.md`` follow from the declaration, and :func:`settings_from_args` places
every parsed value on its path, so no second list of names can drift from the first.
Validation stays with the settings types themselves; a value they refuse stops the gateway
with their message, prefixed by the flag that set it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from rankgate.app.config.settings import GatewaySettings
from rankgate.app.edge.auth import load_keys

ENV_PREFIX = "RANKGATE_"


def env_name(flag: str) -> str:
    """``--max-images`` -> ``RANKGATE_MAX_IMAGES``."""
    return ENV_PREFIX + flag.removeprefix("--").upper().replace("-", "_")


def env_default(flag: str, default: Any, convert: Callable[[str], Any] = str) -> Any:
    """The flag's default: its environment twin's value when that is set and not empty."""
    name = env_name(flag)
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return convert(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(f"{name}={raw!r} is invalid: {exc}") from None


def on_off(text: str) -> bool:
    """A switch's environment value."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def comma_list(text: str) -> list[str]:
    """A repeatable flag's environment value."""
    return [part.strip() for part in text.split(",") if part.strip()]


@dataclass(frozen=True, slots=True)
class Flag:
    """One ``serve`` flag and the settings field ``to`` it sets.

    ``convert`` parses the flag's value (and the variable's); an :func:`on_off` flag is a
    switch. ``env`` parses the variable instead when it differs (a list, a lowered name).
    ``repeat`` flags may be given more than once and set a tuple. ``to`` None: the flag feeds a
    field derived from several (``--api-key`` and ``--api-key-file``); ``no_env``: no variable.
    ``group`` files the flag under a heading of ``--help`` and the reference.
    """

    flag: str
    to: str | None
    help: str
    convert: Callable[[str], Any] = str
    env: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    repeat: bool = False
    metavar: str | None = None
    no_env: bool = False
    group: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def field(self) -> str | None:
        return None if self.to is None else self.to.rsplit(".", 1)[-1]

    def default(self, defaults: GatewaySettings) -> Any:
        """The settings' own default for the field (None for repeatable flags)."""
        if self.repeat:
            return None
        return self._field_default(defaults)

    def _field_default(self, defaults: GatewaySettings) -> Any:
        if self.to is None:
            return None
        value: Any = defaults
        for part in self.to.split("."):
            value = getattr(value, part)
        return value

    def add(self, parser: argparse.ArgumentParser | Any, defaults: GatewaySettings) -> None:
        options: dict[str, Any] = {"help": self.help, "dest": self.dest}
        if self.convert is on_off:
            options["action"] = argparse.BooleanOptionalAction
        elif self.convert is not str:
            options["type"] = self.convert
        if self.repeat:
            options["action"] = "append"
        if self.choices is not None:
            options["choices"] = self.choices
        if self.metavar is not None:
            options["metavar"] = self.metavar
        if not self.no_env:
            default = self.default(defaults)
            options["default"] = env_default(self.flag, default, self.env or self.convert)
        parser.add_argument(self.flag, **options)

    def value(self, args: argparse.Namespace, defaults: GatewaySettings) -> Any:
        value = getattr(args, self.dest)
        if self.repeat:
            # Not given at all: the settings' own default, which need not be empty.
            return self._field_default(defaults) if value is None else tuple(value)
        if value == "" and self.default(defaults) is None:
            return None
        return value


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Every flag, each under its group's heading (groups in their first flag's order)."""
    defaults = GatewaySettings()
    groups: dict[str, Any] = {}
    for flag in flags:
        target: Any = parser
        if flag.group is not None:
            if flag.group not in groups:
                title, _, description = flag.group.partition(": ")
                groups[flag.group] = parser.add_argument_group(title, description or None)
            target = groups[flag.group]
        flag.add(target, defaults)


def settings_from_args(args: argparse.Namespace, flags: Sequence[Flag]) -> GatewaySettings:
    """The settings the parsed ``flags`` amount to; SystemExit naming the flag of a value the
    settings refuse."""
    defaults = GatewaySettings()
    tree: dict[str, Any] = {}
    for flag in flags:
        if flag.to is not None:
            _place(tree, flag.to, flag.value(args, defaults))
    try:
        _place(tree, "access.api_keys", load_keys(args.api_key, args.api_key_file))
        _place(tree, "routing.policy", tree.get("policy", defaults.policy))
        built: GatewaySettings = _build(GatewaySettings, tree, defaults)
    except (ValueError, TypeError, OSError, msgspec.ValidationError) as exc:
        raise SystemExit(f"invalid options: {_name_flag(str(exc), flags)}") from None
    return built


def _place(tree: dict[str, Any], path: str, value: Any) -> None:
    *sections, name = path.split(".")
    for section in sections:
        tree = tree.setdefault(section, {})
    tree[name] = value


def _build(kind: Callable[..., Any], tree: dict[str, Any], defaults: Any) -> Any:
    """``kind`` from ``tree``, each nested dict built as the type of the default it replaces."""
    values = {
        name: (
            _build(type(getattr(defaults, name)), value, getattr(defaults, name))
            if isinstance(value, dict)
            else value
        )
        for name, value in tree.items()
    }
    return kind(**values)


def _name_flag(message: str, flags: Sequence[Flag]) -> str:
    """The settings' message, led by the flag whose field it is about."""
    for flag in flags:
        if flag.field is not None and message.startswith(flag.field + " "):
            return f"{flag.flag}: {message}"
    return message
