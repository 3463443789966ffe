"""KV-event intake: one ZMQ SUB per rank feeding the :class:`EventIndex` (SPEC.md section 6).

All sockets of one engine are served by one dedicated thread with a ``zmq.Poller``. Waiting in
``poll``/``recv`` releases the GIL, and decoding plus hashing a burst of events runs there
instead of as callbacks on the event loop, where a large batch would sit in front of request
handling; the thread is the index's only writer, so the route path reads it without locks.
The thread drains at most ``burst`` messages per socket per turn, so one busy rank cannot
starve the others or a pending replay.

Sequence numbers are tracked per rank. A gap asks the rank's replay ROUTER for the missing
batches (live batches are held back meanwhile, bounded); when replay cannot cover the gap, or
there is no replay endpoint, the rank's index is purged and rebuilt from live events. A
sequence that goes backwards is a restarted publisher: purge, then backfill from its start.
ZMQ reconnects SUB and DEALER sockets on its own. A publisher that connects rather than binds
(``KvEventSource.bind``) is served by binding its address here; while that address is taken
(a previous intake still closing, another process) the bind is retried. Such a publisher drops
what it sends before its connection is up, and nothing tells the subscriber when that is, so
until its first batch arrives the rank's replay buffer is polled for what was missed.

The thread sleeps in ``poll`` until a socket is readable or its next deadline (a bind retry, a
replay's end, a probe) falls due, and ``stop`` wakes it through a socket pair. An idle gateway
spends nothing here once every rank has sent a batch; until then a bind-mode rank is probed
once a second. With ``--workers`` only the first worker runs one; the others read its index
from shared memory (:mod:`rankgate.sidecar.routing.shared_index`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol, cast

import msgspec
import zmq

from rankgate.sidecar.routing.event_batches import batch_events, block_id, event_fields
from rankgate.sidecar.routing.hashing import chain_hashes, chain_seed, event_block_keys
from rankgate.sidecar.routing.index import DEVICE, EventIndex, medium_tier
from rankgate.sidecar.routing.metrics import RoutingMetrics
from rankgate.sidecar.types import KvEventSource

log = logging.getLogger(__name__)

END_OF_REPLAY = b"\xff" * 8
BIND_RETRY_S = 0.5
SYNC_PROBE_S = 1.0
RESTART_PAUSE_S = 0.1
MAX_RESTART_PAUSE_S = 5.0


class IntakeSettings(msgspec.Struct, frozen=True, kw_only=True):
    replay_timeout: float = 2.0
    max_held_batches: int = 10_000
    coalesce: float = 0.005
    burst: int = 256
    receive_hwm: int = 100_000
    # A batch larger than this is never taken in (vLLM's largest are a long prompt's blocks:
    # well under a megabyte).
    max_batch_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.replay_timeout <= 0:
            raise ValueError("replay_timeout must be positive")
        if self.max_batch_bytes < 1024:
            raise ValueError("max_batch_bytes must be at least 1024")
        if self.max_held_batches < 1:
            raise ValueError("max_held_batches must be at least 1")
        if not 0 <= self.coalesce <= 1:
            raise ValueError("coalesce must be between 0 and 1 second")
        if self.burst < 1:
            raise ValueError("burst must be at least 1")
        if self.receive_hwm < 1:
            raise ValueError("receive_hwm must be at least 1 (the socket's queue stays bounded)")


class IntakeObserver(Protocol):
    """What else hears of a rank's events (:class:`~rankgate.sidecar.routing.regret.RegretMeter`);
    called from the intake thread."""

    def stored(self, slot: int, keys: Sequence[int]) -> None: ...

    def removed(self, slot: int, keys: Sequence[int]) -> None: ...

    def batch(self, slot: int, clean: bool) -> None: ...

    def purged(self, slot: int, reason: str) -> None: ...

    def rejected(self, slot: int, reason: str) -> None: ...

    def refuses(self, reason: str) -> bool: ...


class _Feed:
    """One rank's subscription and sequence state; touched only by the intake thread.

    It keeps the rank's children of the per-batch and per-event metrics: a ``labels()`` call
    takes the family's lock and builds a key, a few microseconds each, with the GIL held."""

    def __init__(self, slot: int, source: KvEventSource, metrics: RoutingMetrics) -> None:
        self.slot = slot
        self.source = source
        self.label = str(source.rank)
        self.lag_gauge = metrics.event_lag.labels(self.label)
        self.sequence_gauge = metrics.event_sequence.labels(self.label)
        self.batch_counters = {
            origin: metrics.event_batches.labels(self.label, origin)
            for origin in ("live", "replay")
        }
        self.event_counters = {
            kind: metrics.events.labels(self.label, kind)
            for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
        }
        self.sub: zmq.Socket[bytes] | None = None
        self.expected: int | None = None
        self.replay: zmq.Socket[bytes] | None = None
        self.replay_deadline = 0.0
        self.held: deque[tuple[int, bytes]] = deque()
        self.batches = 0
        # Whether ``expected`` comes from a saved index, whose missed batches are replayed first.
        self.resumed = False
        # Whether the batch being applied had an event refused (its rank's view then misses it),
        # and whether it stored blocks (what shows the view is being built right again).
        self.unclean = False
        self.stored = False
        self.last_lag = 0.0
        # Set while a bind-mode subscription waits for its address (retried at ``bind_at``).
        self.unbound = False
        self.bind_at = 0.0
        # A bind-mode feed with nothing applied yet asks replay for batch 0 on at ``probe_at``;
        # ``probing`` marks such a replay, which fails quietly.
        self.probe_at = 0.0
        self.probing = False

    def reset(self) -> None:
        """Forget the sockets and sequence state, as at the start (the intake restarts)."""
        self.sub = None
        self.replay = None
        self.expected = None
        self.held.clear()
        self.unbound = False
        self.probing = False


class KvEventIntake:
    """Subscribes to every rank's publisher and keeps ``index`` in step with the engine."""

    def __init__(
        self,
        sources: Sequence[KvEventSource],
        slots: dict[int, int],
        index: EventIndex,
        block_size: int,
        metrics: RoutingMetrics,
        settings: IntakeSettings | None = None,
        observer: IntakeObserver | None = None,
    ) -> None:
        self.index = index
        self.observer = observer
        self.block_size = block_size
        self.settings = settings or IntakeSettings()
        self._metrics = metrics
        self._feeds = [_Feed(slots[source.rank], source, metrics) for source in sources]
        self._decoder = msgspec.msgpack.Decoder()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        # A private context, used and terminated by the intake thread only.
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket[bytes], _Feed] = {}
        # Made by start() and closed by the thread, so an intake never started holds no FDs.
        self._wake: tuple[socket.socket, socket.socket] | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._wake = socket.socketpair()
        for end in self._wake:
            end.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="rankgate-kv-events", daemon=True)
        self._thread.start()

    def wait_subscribed(self, timeout: float) -> bool:
        """True once every SUB socket exists and is connecting (for tests and start-up)."""
        return self._ready.wait(timeout)

    def stop(self) -> None:
        """Ask the thread to exit; it wakes at once and closes its sockets."""
        self._stop.set()
        if self._wake is None:
            return
        # Closed already when the thread has ended; a full buffer means a wake-up is pending.
        with contextlib.suppress(OSError):
            self._wake[1].send(b"\0")

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def positions(self) -> dict[int, int]:
        """The next sequence number each slot's publisher is expected to send (read once the
        thread has ended): where a restarted gateway resumes, replaying what it missed."""
        return {feed.slot: feed.expected for feed in self._feeds if feed.expected is not None}

    def resume(self, positions: dict[int, int]) -> None:
        """Before :meth:`start`: the index holds each slot's events up to ``positions``, so
        a later first batch is a gap that replay fills, and an earlier one a restart."""
        for feed in self._feeds:
            if feed.slot in positions:
                feed.expected = positions[feed.slot]
                feed.resumed = True

    def lag(self, slot: int) -> float:
        for feed in self._feeds:
            if feed.slot == slot:
                return feed.last_lag
        return 0.0

    # --- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        """Serve until stopped. A fault that escapes serving (none should: every batch and
        event is checked) does not end the intake: every rank's index is purged, since
        events may be lost meanwhile, and the sockets are made anew after a pause that
        doubles with each fault in a row."""
        up = self._metrics.intake_up
        pause = RESTART_PAUSE_S
        try:
            while not self._stop.is_set():
                up.set(1)
                try:
                    self._serve()
                    return
                except Exception:
                    log.exception("KV-event intake failed; restarting it in %.1f s", pause)
                up.set(0)
                self._close_sockets()
                for feed in self._feeds:
                    self._purge(feed, "intake_restart")
                    feed.reset()
                # Counted once the views are purged: whoever sees the restart sees the purge.
                self._metrics.intake_restarts.inc()
                if self._stop.wait(pause):
                    return
                pause = min(pause * 2, MAX_RESTART_PAUSE_S)
        finally:
            up.set(0)
            self._close_sockets()
            self._context.term()
            if self._wake is not None:
                for end in self._wake:
                    end.close()
            self._ready.set()

    def _close_sockets(self) -> None:
        for sock in list(self._by_socket):
            with contextlib.suppress(KeyError, zmq.ZMQError):
                self._poller.unregister(sock)
            sock.close(linger=0)
        self._by_socket.clear()

    def _serve(self) -> None:
        for feed in self._feeds:
            sub = self._context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self.settings.receive_hwm)
            # A larger message (a batch no engine sends) drops the connection; ZMQ reconnects
            # and the sequence gap that follows is replayed or purged like any other.
            sub.setsockopt(zmq.MAXMSGSIZE, self.settings.max_batch_bytes)
            sub.setsockopt(zmq.RECONNECT_IVL, 100)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sub.setsockopt(zmq.SUBSCRIBE, feed.source.topic.encode("utf-8"))
            feed.sub = sub
            self._open(feed)
            self._watch(sub, feed)
        for feed in self._feeds:
            if feed.resumed and feed.expected is not None and feed.source.replay_endpoint:
                # What the engine published since the index was saved, asked for at once
                # rather than at the next live batch (an idle engine may send none for long).
                self._begin_replay(feed, feed.expected)
            feed.resumed = False
        assert self._wake is not None
        self._poller.register(self._wake[0], zmq.POLLIN)
        self._ready.set()
        coalesce = self.settings.coalesce
        turns = self._metrics.event_turns
        while not self._stop.is_set():
            ready = self._poller.poll(self._poll_timeout_ms())
            for sock, _ in ready:
                owner = self._by_socket.get(sock)
                if owner is None:
                    continue
                if sock is owner.sub:
                    self._drain_live(owner)
                else:
                    self._drain_replay(owner)
            now = time.monotonic()
            for feed in self._feeds:
                if feed.unbound and now >= feed.bind_at:
                    self._open(feed)
                if feed.replay is not None and feed.probing and now > feed.replay_deadline:
                    self._end_replay(feed)
                    self._release_held(feed)
                elif feed.replay is not None and now > feed.replay_deadline:
                    self._metrics.replays.labels(feed.label, "timeout").inc()
                    self._end_replay(feed)
                    self._purge(feed, "replay")
                    feed.expected = None
                    self._release_held(feed)
                if self._awaits_probe(feed) and now >= feed.probe_at:
                    feed.probe_at = now + SYNC_PROBE_S
                    self._begin_replay(feed, 0, probe=True)
            turns.inc()
            if ready and coalesce:
                # Batches published close together (one per rank per engine step) are
                # then drained in one turn: a wake-up of this thread costs more than
                # applying a small batch.
                self._stop.wait(coalesce)

    def _poll_timeout_ms(self) -> int | None:
        """Milliseconds to the nearest deadline of any feed; None (no limit) when none is set."""
        deadlines = []
        for feed in self._feeds:
            if feed.unbound:
                deadlines.append(feed.bind_at)
            if feed.replay is not None:
                deadlines.append(feed.replay_deadline)
            elif self._awaits_probe(feed):
                deadlines.append(feed.probe_at)
        if not deadlines:
            return None
        return max(1, math.ceil((min(deadlines) - time.monotonic()) * 1000))

    @staticmethod
    def _awaits_probe(feed: _Feed) -> bool:
        return bool(
            feed.source.bind
            and feed.expected is None
            and feed.replay is None
            and feed.source.replay_endpoint
        )

    def _open(self, feed: _Feed) -> None:
        """Connect to a binding publisher, or bind the address a connecting one dials."""
        assert feed.sub is not None
        endpoint = feed.source.endpoint
        if not feed.source.bind:
            feed.sub.connect(endpoint)
            return
        try:
            feed.sub.bind(endpoint)
        except zmq.ZMQError as error:
            if not feed.unbound:
                log.warning(
                    "rank %s publishes KV events by connecting to %s, which this gateway cannot "
                    "bind (%s); retrying every %.1f s",
                    feed.label,
                    endpoint,
                    error,
                    BIND_RETRY_S,
                )
            feed.unbound = True
            feed.bind_at = time.monotonic() + BIND_RETRY_S
            return
        if feed.unbound:
            log.info("bound %s for rank %s's KV events", endpoint, feed.label)
        feed.unbound = False

    def _watch(self, socket: zmq.Socket[bytes], feed: _Feed) -> None:
        self._by_socket[socket] = feed
        self._poller.register(socket, zmq.POLLIN)

    def _drain_live(self, feed: _Feed) -> None:
        sub = feed.sub
        assert sub is not None
        for _ in range(self.settings.burst):
            # Asked first, so an emptied socket does not end every drain in a raised Again.
            if not cast(int, sub.get(zmq.EVENTS)) & zmq.POLLIN:
                return
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2 or len(frames[-2]) != 8:
                self._reject(feed, "frames")
                continue
            seq = int.from_bytes(frames[-2], "big")
            if feed.replay is not None:
                if len(feed.held) < self.settings.max_held_batches:
                    feed.held.append((seq, frames[-1]))
                    continue
                # The replay is too slow for this stream: give it up and go on live.
                self._metrics.replays.labels(feed.label, "overflow").inc()
                self._end_replay(feed)
                self._purge(feed, "replay")
                feed.expected = None
                self._release_held(feed)
            self._on_live(feed, seq, frames[-1], allow_replay=True)

    def _on_live(self, feed: _Feed, seq: int, payload: bytes, allow_replay: bool) -> None:
        expected = feed.expected
        if expected is None or seq == expected:
            if expected is None and seq > 0 and allow_replay and feed.source.replay_endpoint:
                # Joined mid-stream: backfill what the publisher still buffers.
                feed.held.append((seq, payload))
                self._begin_replay(feed, 0)
                return
            self._apply(feed, seq, payload, "live")
            return
        if seq > expected:
            self._metrics.gaps.labels(feed.label).inc()
            if allow_replay and feed.source.replay_endpoint:
                feed.held.append((seq, payload))
                self._begin_replay(feed, expected)
                return
            self._purge(feed, "gap")
            self._apply(feed, seq, payload, "live")
            return
        log.info("KV-event publisher of rank %s restarted (seq %d < %d)", feed.label, seq, expected)
        self._purge(feed, "restart")
        feed.expected = None
        self._on_live(feed, seq, payload, allow_replay)

    def _begin_replay(self, feed: _Feed, start: int, probe: bool = False) -> None:
        feed.probing = probe
        endpoint = feed.source.replay_endpoint
        assert endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        feed.replay = dealer
        feed.replay_deadline = time.monotonic() + self.settings.replay_timeout
        self._watch(dealer, feed)

    def _drain_replay(self, feed: _Feed) -> None:
        assert feed.replay is not None
        for _ in range(self.settings.burst):
            try:
                frames = feed.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) >= 2 and frames[-2] == END_OF_REPLAY:
                if not feed.probing:
                    self._metrics.replays.labels(feed.label, "complete").inc()
                elif feed.expected is not None:
                    self._metrics.replays.labels(feed.label, "sync").inc()
                self._end_replay(feed)
                self._release_held(feed)
                return
            if len(frames) < 3 or len(frames[-2]) != 8:
                self._reject(feed, "replay_frames")
                continue
            seq = int.from_bytes(frames[-2], "big")
            expected = feed.expected
            if expected is not None and seq < expected:
                continue
            if expected is not None and seq > expected:
                # The publisher no longer buffers what we missed.
                self._metrics.replays.labels(feed.label, "incomplete").inc()
                self._purge(feed, "replay")
            self._apply(feed, seq, frames[-1], "replay")

    def _end_replay(self, feed: _Feed) -> None:
        if feed.replay is None:
            return
        self._poller.unregister(feed.replay)
        self._by_socket.pop(feed.replay, None)
        feed.replay.close(linger=0)
        feed.replay = None

    def _release_held(self, feed: _Feed) -> None:
        """Apply the live batches held back during a replay; a gap left now means a purge."""
        held, feed.held = feed.held, deque()
        for seq, payload in held:
            if feed.expected is not None and seq < feed.expected:
                continue
            self._on_live(feed, seq, payload, allow_replay=False)

    def _purge(self, feed: _Feed, reason: str) -> None:
        self.index.clear(feed.slot)
        if self.observer is not None:
            self.observer.purged(feed.slot, reason)
        self._metrics.purges.labels(feed.label, reason).inc()
        log.warning("purged the KV index of rank %s (%s)", feed.label, reason)

    def _reject(self, feed: _Feed, reason: str) -> None:
        self._metrics.rejected.labels(feed.label, reason).inc()
        observer = self.observer
        if observer is not None:
            observer.rejected(feed.slot, reason)
            if observer.refuses(reason):
                feed.unclean = True
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("unusable KV-event data from rank %s: %s", feed.label, reason)

    # --- applying a batch -----------------------------------------------------------------

    def _apply(self, feed: _Feed, seq: int, payload: bytes, origin: str) -> None:
        feed.expected = seq + 1
        feed.sequence_gauge.set(seq)
        feed.unclean = False
        feed.stored = False
        try:
            ts, events = batch_events(self._decoder.decode(payload))
        except Exception:
            # Whatever the bytes are (nested past the decoder's depth, ext types, a map where
            # an array belongs), a batch that cannot be read is counted and dropped.
            self._reject(feed, "batch")
            return
        if ts:
            feed.last_lag = max(0.0, time.time() - ts)
            feed.lag_gauge.set(feed.last_lag)
        for event in events:
            try:
                kind, fields = event_fields(event)
                self._apply_event(feed, kind, fields)
            except Exception:
                self._reject(feed, "event")
        feed.batches += 1
        feed.batch_counters[origin].inc()
        if self.observer is not None:
            self.observer.batch(feed.slot, feed.stored and not feed.unclean)

    def _apply_event(self, feed: _Feed, kind: str, fields: dict[str, Any]) -> None:
        group = fields.get("group_idx")
        if group not in (None, 0):
            # Hybrid models publish one stream per KV-cache group; the first one describes the
            # full-attention prefix that decides reuse.
            return
        if kind == "BlockStored":
            self._stored(feed, fields)
        elif kind == "BlockRemoved":
            tier = medium_tier(fields.get("medium"))
            remove = self.index.remove
            slot = feed.slot
            keys = [
                remove(slot, tier, block_id(block)) for block in fields.get("block_hashes") or ()
            ]
            if tier == DEVICE and self.observer is not None:
                self.observer.removed(slot, [key for key in keys if key is not None])
        elif kind == "AllBlocksCleared":
            self.index.clear(feed.slot)
        else:
            log.debug("skipping KV event of unknown type %r from rank %s", kind, feed.label)
            self._reject(feed, "event_type")
            return
        feed.event_counters[kind].inc()

    def _stored(self, feed: _Feed, fields: dict[str, Any]) -> None:
        blocks = fields.get("block_hashes") or ()
        if not blocks:
            return
        block_size = fields.get("block_size") or self.block_size
        if block_size != self.block_size:
            self._reject(feed, "block_size")
            return
        lora_name = fields.get("lora_name")
        if not isinstance(lora_name, str) or not lora_name:
            lora_name = None
        salt, images = event_block_keys(fields.get("extra_keys"), lora_name)
        parent = fields.get("parent_block_hash")
        if parent is None:
            key = chain_seed(salt, lora_name)
        else:
            found = self.index.parent_key(feed.slot, block_id(parent))
            if found is None:
                self._reject(feed, "unknown_parent")
                return
            key = found
        tokens = fields.get("token_ids") or ()
        keys = chain_hashes(tuple(tokens), block_size, key, images, limit=len(blocks))
        tier = medium_tier(fields.get("medium"))
        store = self.index.store
        slot = feed.slot
        for block, our_key in zip(blocks, keys, strict=False):
            store(slot, tier, block_id(block), our_key)
        feed.stored = True
        if tier == DEVICE and self.observer is not None:
            self.observer.stored(slot, keys)
