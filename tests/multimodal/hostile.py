"""A decoder handler that misbehaves on purpose, for the isolation tests.

Named to a :class:`~rankgate.multimodal.isolation.DecoderPool` (or to ``MediaPreparer``'s
``decoder``) as ``tests.multimodal.hostile:handle``, it is imported by the decoder process, never
by the gateway. Bytes that start with a marker choose how the decoder fails; any others are
decoded as the product does.
"""

from __future__ import annotations

import ctypes
import os
import resource
import threading

import msgspec

from rankgate.multimodal.worker import handle as product

HANDLER = "tests.multimodal.hostile:handle"
CRASH = b"CRASH"  # reads address 0: SIGSEGV, as a demuxer bug would
HANG = b"HANG"  # says so on stderr, then waits for ever without using CPU
SPIN = b"SPIN"  # loops for ever on the CPU
BOMB = b"BOMB"  # allocates without bound
FAIL = b"FAIL"  # raises something other than a refusal
LIMITS = b"LIMITS"  # answers the limits the decoder runs under


class Limits(msgspec.Struct, frozen=True, array_like=True):
    memory: tuple[int, int]
    core: tuple[int, int]
    cpu: tuple[int, int]
    cpu_used: float


def handle(op: str, params: bytes, data: bytes) -> object:
    if data.startswith(CRASH):
        ctypes.string_at(0)
    if data.startswith(HANG):
        os.write(2, f"decoder {os.getpid()} hangs\n".encode())
        threading.Event().wait()
    if data.startswith(SPIN):
        while True:
            pass
    if data.startswith(BOMB):
        hoard = []
        while True:
            # Zeroed pages from the kernel: address space, not memory the test machine pays.
            hoard.append(bytes(64 << 20))
    if data.startswith(FAIL):
        raise KeyError("boom")
    if data.startswith(LIMITS):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return Limits(
            resource.getrlimit(resource.RLIMIT_AS),
            resource.getrlimit(resource.RLIMIT_CORE),
            resource.getrlimit(resource.RLIMIT_CPU),
            usage.ru_utime + usage.ru_stime,
        )
    return product(op, params, data)
