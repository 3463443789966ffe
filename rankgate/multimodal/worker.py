"""A decoder process: where Pillow and FFmpeg parse untrusted media, away from the gateway.

:class:`~rankgate.multimodal.isolation.DecoderPool` starts this as a fresh interpreter and
talks to it over one socket, in length-prefixed frames and msgpack, never pickle: a decoder
that a hostile file took over must not be able to run code in the gateway by what it answers.
The process first applies its own limits (address space, CPU time per job, no core files), then
runs one job at a time until the gateway closes the socket. A job that passes a limit ends the
process (the kernel's SIGXCPU, or exit status ``OUT_OF_MEMORY`` on a failed allocation), which the
gateway reports as that job's failure and replaces.

The work itself is a handler named ``module:function`` (:func:`handle` here); the test suite
names one that crashes, hangs or allocates without bound on purpose. Clients cannot name one.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import os
import resource
import signal
from collections.abc import Callable
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from rankgate.multimodal.clips import ClipLimits, probe_clip
from rankgate.multimodal.decode import DecodeLimits, image_facts, image_size
from rankgate.multimodal.errors import MediaRefused
from rankgate.multimodal.isolation import FAILED, OUT_OF_MEMORY, REFUSED, RESULT, Settings

Handler = Callable[[str, bytes, bytes], object]

_PR_SET_PDEATHSIG = 1

_IMAGE_LIMITS = msgspec.msgpack.Decoder(DecodeLimits)
_CLIP_LIMITS = msgspec.msgpack.Decoder(ClipLimits)


def handle(op: str, params: bytes, data: bytes) -> object:
    """The product's jobs: ``image`` and ``image_size`` with :class:`DecodeLimits`, ``clip``
    with :class:`ClipLimits`, all as msgpack in ``params``. Each result leaves out the bytes
    it was given: the gateway has them."""
    if op == "image":
        return image_facts(data, _IMAGE_LIMITS.decode(params))
    if op == "image_size":
        return image_size(data, _IMAGE_LIMITS.decode(params))
    if op == "clip":
        return msgspec.structs.replace(probe_clip(data, _CLIP_LIMITS.decode(params)), data=b"")
    raise ValueError(f"unknown decoder job {op!r}")


def main(fd: int) -> None:
    """Serve jobs on the socket ``fd`` until the gateway closes it."""
    conn = Connection(fd)
    # Ctrl-C reaches the whole process group; the gateway decides when decoders end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    try:
        settings = msgspec.msgpack.decode(conn.recv_bytes(), type=Settings)
    except EOFError:
        return
    handler = _resolve(settings.handler)
    _confine(settings.memory_bytes)
    conn.send_bytes(RESULT)
    encode = msgspec.msgpack.Encoder().encode
    while _serve_one(conn, handler, settings.cpu_seconds, encode):
        pass


def _serve_one(
    conn: Connection, handler: Handler, cpu_seconds: int, encode: Callable[[object], bytes]
) -> bool:
    """One job, answered; False once the gateway has closed the socket."""
    try:
        op = conn.recv_bytes().decode()
        params = conn.recv_bytes()
        data = conn.recv_bytes()
        _arm_cpu(cpu_seconds)
        try:
            reply = RESULT + encode(handler(op, params, data))
        except MediaRefused as refusal:
            reply = REFUSED + encode((refusal.reason, refusal.status))
        except MemoryError:
            raise
        except Exception as exc:
            reply = FAILED + encode(f"{type(exc).__name__}: {exc}")
        conn.send_bytes(reply)
    except EOFError:
        return False
    except MemoryError:
        os._exit(OUT_OF_MEMORY)
    return True


def _resolve(name: str) -> Handler:
    module, _, function = name.partition(":")
    found: Any = getattr(importlib.import_module(module), function)
    return found  # type: ignore[no-any-return]


def _die_with_parent() -> None:
    """A gateway killed outright cannot close its decoders; one stuck in a job that uses no
    CPU (so no CPU limit ends it) would outlive it. Linux ends it with its parent instead."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _confine(memory_bytes: int) -> None:
    """Address space bounded, no core files (a crash must not fill the disk)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        memory_bytes = min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


def _arm_cpu(seconds: int) -> None:
    """The CPU-time limit counts the process's whole life, so each job's starts from what the
    process has used so far; the kernel sends SIGXCPU past it."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = math.ceil(usage.ru_utime + usage.ru_stime)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = used + seconds
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
