"""Which names a request's ``model`` may use: the served name, its aliases, and loaded LoRAs.

LoRA adapters come and go in vLLM at runtime (``Control.ListLoras``). The list is cached and
refreshed when a request names something unknown (at most once per ``refresh_interval``, and
only one refresh at a time), so a freshly loaded adapter is usable at once without polling
vLLM on every request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from rankgate.app.errors import model_not_found

LoraLister = Callable[[], Awaitable[Sequence[str]]]


@dataclass(frozen=True, slots=True)
class ModelTarget:
    """What a request's model name resolved to; ``lora_name`` is sent to vLLM when set."""

    name: str
    lora_name: str | None


@dataclass(frozen=True, slots=True)
class ModelCard:
    id: str
    root: str
    parent: str | None


class ModelRegistry:
    def __init__(
        self,
        served_name: str,
        aliases: Sequence[str],
        model_id: str,
        list_loras: LoraLister | None,
        refresh_interval: float = 1.0,
    ) -> None:
        self.served_name = served_name
        self.model_id = model_id
        self.aliases = tuple(a for a in dict.fromkeys(aliases) if a and a != served_name)
        self._names = frozenset((served_name, *self.aliases))
        self._list_loras = list_loras
        self._refresh_interval = refresh_interval
        self._loras: frozenset[str] = frozenset()
        self._loras_order: tuple[str, ...] = ()
        self._refreshed_at = -1e18
        self._refreshing: asyncio.Task[None] | None = None

    async def resolve(self, name: str) -> ModelTarget:
        if name in self._names:
            return ModelTarget(name=name, lora_name=None)
        if name in self._loras:
            return ModelTarget(name=name, lora_name=name)
        if self._list_loras is not None and name:
            if time.monotonic() - self._refreshed_at >= self._refresh_interval:
                await self.refresh()
            if name in self._loras:
                return ModelTarget(name=name, lora_name=name)
        raise model_not_found(name)

    async def refresh(self) -> None:
        """Reload the LoRA list; concurrent callers share one ``ListLoras`` call."""
        if self._list_loras is None:
            return
        task = self._refreshing
        if task is None or task.done():
            task = asyncio.ensure_future(self._load())
            self._refreshing = task
        await asyncio.shield(task)

    async def _load(self) -> None:
        assert self._list_loras is not None
        try:
            names = tuple(dict.fromkeys(await self._list_loras()))
        finally:
            self._refreshed_at = time.monotonic()
        self._loras_order = names
        self._loras = frozenset(names)

    async def cards(self) -> list[ModelCard]:
        await self.refresh()
        cards = [ModelCard(id=self.served_name, root=self.model_id, parent=None)]
        cards += [ModelCard(id=a, root=self.model_id, parent=None) for a in self.aliases]
        cards += [
            ModelCard(id=lora, root=lora, parent=self.served_name)
            for lora in self._loras_order
            if lora not in self._names
        ]
        return cards
