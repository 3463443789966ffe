"""Untrusted media is parsed in decoder processes, never in the gateway's own.

Pillow and FFmpeg parse attacker-chosen bytes in C. In the gateway's process a segfault there
would end every stream the process carries, a hang would hold a thread for good and a leak
would grow the process. So each gateway process owns a small :class:`DecoderPool`: decoder
processes started on its first media item and reused, each with an address-space limit and a
CPU-time limit per job of its own (:mod:`rankgate.multimodal.worker`). A job's bytes are sent
once and a small result comes back, checked against its type; a job that crashes its decoder,
outlives its deadline or passes a limit fails alone, as a 400 naming the item, and its decoder
is replaced on the next job. When every decoder is busy and the queue is full a job is refused
at once with a 503, rather than queued without bound.

A decoder is a fresh interpreter started with :mod:`subprocess`, which forks and execs at once
and so is safe from a process with threads and an event loop. It is not a ``multiprocessing``
child: a spawned one imports the parent's ``__main__`` (the whole gateway) and a fork server
needs a writable temporary directory, which a read-only container does not have.
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from typing import TypeVar

import msgspec

from rankgate.multimodal.errors import MediaRefused

DEFAULT_HANDLER = "rankgate.multimodal.worker:handle"
# Exit status of a decoder whose job ran out of memory: the gateway names the limit.
OUT_OF_MEMORY = 86
# The first byte of a reply: the handler's result, a refusal, or another exception.
RESULT, REFUSED, FAILED = b"o", b"r", b"f"
BUSY = "the gateway's decoders are busy; retry shortly"
_SHUTTING_DOWN = "the gateway is shutting down"
# A decoder gets this long to import Pillow and FFmpeg and say it is ready.
STARTUP_S = 60.0
# How long a decoder that closed its socket gets to be seen exiting.
_REAP_S = 5.0
_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
    "from rankgate.multimodal.worker import main; main(int(sys.argv[1]))"
)

_T = TypeVar("_T")


class DecoderLimits(msgspec.Struct, frozen=True, kw_only=True):
    """How many decoder processes, how many jobs may wait for one, and what one job may use:
    ``timeout`` seconds of wall time, ``cpu_seconds`` of CPU, ``memory_bytes`` of address
    space (the whole decoder's, Pillow and FFmpeg included)."""

    workers: int = 2
    queue: int = 64
    timeout: float = 20.0
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30


class Settings(msgspec.Struct, frozen=True):
    """What the gateway tells a decoder once, before its first job."""

    handler: str
    memory_bytes: int
    cpu_seconds: int


class DecoderFailure(RuntimeError):
    """A decoder's handler raised something other than a refusal: a bug, not a bad file."""


class _Decoder:
    __slots__ = ("conn", "process")

    def __init__(self, process: subprocess.Popen[bytes], conn: Connection) -> None:
        self.process = process
        self.conn = conn


class _Idle:
    """The decoders waiting for a job, and the places whose decoder is yet to start (or to
    replace): a job gets an idle decoder when there is one, so a decoder starts only when
    every started one is busy."""

    def __init__(self, places: int) -> None:
        self._ready = threading.Condition()
        self._decoders: list[_Decoder] = []
        self._empty = places
        self.closed = False

    def take(self) -> _Decoder | None:
        """An idle decoder, or None for an empty place to start one in; waits for either."""
        with self._ready:
            self._ready.wait_for(lambda: self._decoders or self._empty or self.closed)
            if self.closed:
                raise MediaRefused(_SHUTTING_DOWN, status=503)
            if self._decoders:
                return self._decoders.pop()
            self._empty -= 1
            return None

    def give(self, decoder: _Decoder) -> bool:
        """Whether ``decoder`` went back to wait for a job (not once closed)."""
        with self._ready:
            if self.closed:
                return False
            self._decoders.append(decoder)
            self._ready.notify()
            return True

    def free(self) -> None:
        """A place whose decoder ended."""
        with self._ready:
            self._empty += 1
            self._ready.notify()

    def close(self) -> list[_Decoder]:
        """The idle decoders, for their end; every job still waiting gets a 503."""
        with self._ready:
            self.closed = True
            idle, self._decoders = self._decoders, []
            self._ready.notify_all()
            return idle


class DecoderPool:
    """Decoder processes for one gateway process; :meth:`run` blocks, so call it from a thread.

    ``handler`` names the function a decoder runs for each job (``module:function``); only the
    test suite names another than the product's.
    """

    def __init__(self, limits: DecoderLimits, handler: str = DEFAULT_HANDLER) -> None:
        self.limits = limits
        self._handler = handler
        self._idle = _Idle(limits.workers)
        self._lock = threading.Lock()
        self._admitted = 0
        self._live: set[_Decoder] = set()
        self._finalizer = weakref.finalize(self, _end_all, self._live)
        # Decoders started, replacements included; and decoders a job crashed, outlasted
        # its deadline in, or took past a limit.
        self.started = 0
        self.lost = 0

    @property
    def pids(self) -> tuple[int, ...]:
        """The process ids of the decoders running now."""
        with self._lock:
            return tuple(decoder.process.pid for decoder in self._live)

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """A place for one job, running or waiting; a 503 refusal when there is none."""
        with self._lock:
            if self._admitted >= self.limits.workers + self.limits.queue:
                raise MediaRefused(BUSY, status=503)
            self._admitted += 1
        try:
            yield
        finally:
            with self._lock:
                self._admitted -= 1

    def run(self, op: str, params: bytes, data: bytes, result: type[_T]) -> _T:
        """``op`` on ``data`` in a decoder, its answer checked to be a ``result``.

        Raises :class:`MediaRefused`: the handler's own refusal, or a 400 when the job crashed
        its decoder, outlived its deadline or passed a limit (the decoder is replaced).
        """
        for _ in range(2):
            decoder = self._take()
            try:
                reply = self._reply(decoder) if self._sent(decoder, op, params, data) else None
                if reply is not None:
                    answer = _answer(reply, result)
            except BaseException:
                self._retire(decoder)
                raise
            if reply is None:
                # It had died while idle (killed from outside): not this job's doing.
                self._retire(decoder)
                continue
            self._give_back(decoder)
            if isinstance(answer, BaseException):
                raise answer
            return answer
        raise MediaRefused("no decoder process could take the job", status=503)

    def close(self) -> None:
        """Ends every decoder; jobs still waiting get a 503."""
        for decoder in self._idle.close():
            self._retire(decoder)
        self._finalizer()

    def _take(self) -> _Decoder:
        decoder = self._idle.take()
        if decoder is not None:
            return decoder
        try:
            return self._start()
        except BaseException:
            self._idle.free()
            raise

    def _start(self) -> _Decoder:
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno()), json.dumps(sys.path)],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        except OSError as exc:
            ours.close()
            raise MediaRefused(f"no decoder process could be started: {exc}", 503) from None
        finally:
            theirs.close()
        # A decoder that stops reading or writing mid-message is as lost as a silent one.
        seconds = int(self.limits.timeout)
        timeval = struct.pack("ll", seconds, int((self.limits.timeout - seconds) * 1e6))
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        decoder = _Decoder(process, Connection(ours.detach()))
        settings = Settings(self._handler, self.limits.memory_bytes, self.limits.cpu_seconds)
        try:
            decoder.conn.send_bytes(msgspec.msgpack.encode(settings))
            if not decoder.conn.poll(STARTUP_S) or decoder.conn.recv_bytes(16) != RESULT:
                raise EOFError
        except (OSError, EOFError):
            _end(decoder)
            raise MediaRefused("no decoder process could be started", 503) from None
        with self._lock:
            self._live.add(decoder)
            self.started += 1
        return decoder

    def _sent(self, decoder: _Decoder, op: str, params: bytes, data: bytes) -> bool:
        try:
            decoder.conn.send_bytes(op.encode())
            decoder.conn.send_bytes(params)
            decoder.conn.send_bytes(data)
        except OSError:
            return False
        return True

    def _reply(self, decoder: _Decoder) -> bytes:
        conn = decoder.conn
        if not conn.poll(self.limits.timeout):
            decoder.process.kill()
            raise self._lost(f"the decoder took longer than {self.limits.timeout:g} s on it")
        try:
            return conn.recv_bytes(self.limits.memory_bytes)
        except (EOFError, OSError):
            raise self._lost(self._cause(decoder)) from None

    def _lost(self, reason: str) -> MediaRefused:
        with self._lock:
            if self._idle.closed:
                return MediaRefused(_SHUTTING_DOWN, status=503)
            self.lost += 1
        return MediaRefused(reason)

    def _cause(self, decoder: _Decoder) -> str:
        """Why a decoder stopped answering mid-job, from how it ended."""
        try:
            code = decoder.process.wait(_REAP_S)
        except subprocess.TimeoutExpired:
            decoder.process.kill()
            return "the decoder stopped answering on it"
        if code == OUT_OF_MEMORY:
            mib = self.limits.memory_bytes / (1 << 20)
            return f"the decoder needed more than {mib:g} MiB of memory for it"
        if code == -signal.SIGXCPU:
            return f"the decoder used more than {self.limits.cpu_seconds} s of CPU time on it"
        if code < 0:
            return f"the decoder crashed on it ({_signal_name(-code)})"
        return f"the decoder exited on it (status {code})"

    def _give_back(self, decoder: _Decoder) -> None:
        if not self._idle.give(decoder):
            self._retire(decoder)

    def _retire(self, decoder: _Decoder) -> None:
        """Ends ``decoder`` and frees its place for a fresh one."""
        _end(decoder)
        with self._lock:
            self._live.discard(decoder)
        self._idle.free()


def _answer(reply: bytes, result: type[_T]) -> _T | BaseException:
    """A decoder's reply as the result it must be, or the exception it stands for."""
    tag, body = reply[:1], memoryview(reply)[1:]
    try:
        if tag == RESULT:
            return msgspec.msgpack.decode(body, type=result)
        if tag == REFUSED:
            reason, status = msgspec.msgpack.decode(body, type=tuple[str, int])
            return MediaRefused(reason, status)
        if tag == FAILED:
            return DecoderFailure(msgspec.msgpack.decode(body, type=str))
    except msgspec.ValidationError as exc:
        raise MediaRefused(f"the decoder answered nonsense on it: {exc}") from None
    raise MediaRefused("the decoder answered nonsense on it")


def _signal_name(number: int) -> str:
    with suppress(ValueError):
        return signal.Signals(number).name
    return f"signal {number}"


def _end(decoder: _Decoder) -> None:
    process = decoder.process
    if process.poll() is None:
        process.kill()
    with suppress(subprocess.TimeoutExpired):
        process.wait(_REAP_S)
    decoder.conn.close()


def _end_all(live: set[_Decoder]) -> None:
    """Kills every decoder still running: what a pool dropped without :meth:`close` leaves."""
    for decoder in list(live):
        process = decoder.process
        if process.poll() is None:
            process.kill()
        with suppress(subprocess.TimeoutExpired):
            process.wait(_REAP_S)
