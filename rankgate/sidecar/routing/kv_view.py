"""The KV router's view of the engines' caches, and its lifecycle across re-discoveries.

The first worker (or the only one) runs the KV-event intake thread, which feeds an
:class:`~rankgate.sidecar.routing.index.EventIndex`; with ``--workers`` that index writes through to
a shared-memory table, and every other worker reads the table instead of subscribing. A new
engine (re-discovery) gets a new intake and a new table generation while the old intake may
still be stopping, so a table is removed only once no intake can write to it any more.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rankgate.sidecar.routing import index_file
from rankgate.sidecar.routing.events import IntakeObserver, IntakeSettings, KvEventIntake
from rankgate.sidecar.routing.index import DEVICE, OFFLOADED, EventIndex, PrefixMatch
from rankgate.sidecar.routing.metrics import RoutingMetrics
from rankgate.sidecar.routing.shared_index import (
    MAX_SLOTS,
    SharedKvReader,
    SharedKvTable,
    table_name,
)
from rankgate.sidecar.routing.shared_index import remove as remove_table
from rankgate.sidecar.routing.shared_load import SharedLoadBoard
from rankgate.sidecar.types import KvEventSource

log = logging.getLogger(__name__)


class KvView:
    """Which blocks each rank holds, from its KV events: read here, or from another worker."""

    def __init__(
        self,
        metrics: RoutingMetrics,
        settings: IntakeSettings,
        index_file: str | None = None,
        index_max_age: float = 600.0,
    ) -> None:
        self._metrics = metrics
        self._settings = settings
        # Where the index is saved on close and loaded on start (index_file), and for which
        # engine: a file saved beside another one is not loaded.
        self._index_file = index_file
        self._index_max_age = index_max_age
        self._identity = ""
        self.events: EventIndex | None = None
        self.intake: KvEventIntake | None = None
        # The first worker's table, which its index writes through to; the others' view of it.
        self.shared_table: SharedKvTable | None = None
        self.shared_reader: SharedKvReader | None = None
        # Tables whose intake is still stopping: removed once no intake can write to it.
        self._retired: list[SharedKvTable] = []
        self._stopping: list[KvEventIntake] = []
        # The board whose table generation the shared table is.
        self._board: SharedLoadBoard | None = None
        self._started = False

    def configure(
        self,
        sources: tuple[KvEventSource, ...],
        slots: dict[int, int],
        block_size: int,
        device: list[int],
        offloaded: list[int],
        board: SharedLoadBoard | None,
        observer: IntakeObserver | None = None,
        identity: str = "",
    ) -> bool:
        """Rebuild the view for a freshly discovered engine; whether it has KV events at all.

        ``device`` and ``offloaded`` bound the index entries per slot, per tier.
        """
        self._identity = identity
        self._stopping = [intake for intake in self._stopping if intake.running]
        if self.intake is not None:
            self.intake.stop()
            self._stopping.append(self.intake)
            self.intake = None
        self.events = None
        self._close_shared()
        if not sources:
            return False
        if board is not None and (board.workers < 2 or len(slots) > MAX_SLOTS):
            board = None
        if board is not None and board.worker != 0:
            self.shared_reader = SharedKvReader(board, len(slots))
            return True
        if board is not None:
            remove_table(table_name(board, board.kv_generation))
            generation = board.kv_generation + 1
            self.shared_table = SharedKvTable.create(
                table_name(board, generation), len(slots), sum(device) + sum(offloaded)
            )
            board.kv_generation = generation
            self._board = board
        self.events = EventIndex(device, offloaded, self.shared_table)
        self.intake = KvEventIntake(
            sources, slots, self.events, block_size, self._metrics, self._settings, observer
        )
        if self._started:
            self.intake.start()
        return True

    async def start(self) -> None:
        self._started = True
        if self.intake is not None:
            if self._index_file is not None and self.events is not None:
                positions = await asyncio.to_thread(
                    index_file.load,
                    self._index_file,
                    self._identity,
                    self.events,
                    self._index_max_age,
                    time.time(),
                )
                if positions:
                    self.intake.resume(positions)
            self.intake.start()
            await asyncio.to_thread(self.intake.wait_subscribed, 5.0)

    async def close(self) -> None:
        self._started = False
        stopping = self._stopping
        self._stopping = []
        if self.intake is not None:
            stopping.append(self.intake)
            self.intake = None
        for intake in stopping:
            intake.stop()
        for intake in stopping:
            await asyncio.to_thread(intake.join, 5.0)
        current = stopping[-1] if stopping else None
        if (
            self._index_file is not None
            and self.events is not None
            and current is not None
            and not current.running
        ):
            try:
                await asyncio.to_thread(
                    index_file.save,
                    self._index_file,
                    self._identity,
                    self.events,
                    current.positions(),
                    time.time(),
                )
            except OSError as error:
                log.warning("cannot save the KV index to %s: %s", self._index_file, error)
        self._close_shared()

    def sizes(self, slot: int) -> tuple[int, int]:
        """Blocks indexed for ``slot``: on the device, and offloaded."""
        events = self.events
        if events is not None:
            return events.size(slot), events.size(slot, OFFLOADED)
        table = self.shared_reader.table() if self.shared_reader is not None else None
        if table is not None:
            return table.size(slot, DEVICE), table.size(slot, OFFLOADED)
        return 0, 0

    def device_sizes(self) -> list[int] | None:
        """Blocks each slot holds on the device; None while there is no view to ask."""
        events = self.events
        if events is not None:
            return events.device_sizes()
        table = self.shared_reader.table() if self.shared_reader is not None else None
        if table is not None:
            return [table.size(slot, DEVICE) for slot in range(table.slots)]
        return None

    def holds(self, key: int) -> bool:
        """Whether any rank holds the block ``key`` on any tier, as far as the view knows."""
        events = self.events
        if events is not None:
            return key in events.device or key in events.offloaded
        table = self.shared_reader.table() if self.shared_reader is not None else None
        return table is not None and table.get(key) != (0, 0)

    def match(self, hashes: list[int]) -> PrefixMatch | None:
        """Each slot's cached prefix of ``hashes``; None while there is no view to ask."""
        if self.events is not None:
            return self.events.match(hashes)
        table = self.shared_reader.table() if self.shared_reader is not None else None
        return table.match(hashes) if table is not None else None

    def _close_shared(self) -> None:
        """Let go of this worker's shared table or view; a table is removed only once no
        intake thread can write to it any more."""
        if self.shared_table is not None:
            # Readers drop it on their next look (a crashed writer's table is read until its
            # replacement makes the next one).
            board = self._board
            if board is not None:
                board.kv_generation += 1
            self._retired.append(self.shared_table)
            self.shared_table = None
        if not any(intake.running for intake in self._stopping):
            for table in self._retired:
                table.close()
            self._retired = []
        if self.shared_reader is not None:
            self.shared_reader.close()
            self.shared_reader = None
