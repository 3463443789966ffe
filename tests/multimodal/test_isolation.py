"""Decoder processes: each job's failure stays its own, whatever the decoder does on it.

The handler in :mod:`tests.multimodal.hostile` crashes, hangs, spins or allocates without bound
when the bytes ask it to; the pool must answer that job with a refusal naming what happened,
replace the decoder, and go on serving the next job as if nothing had happened.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from rankgate.multimodal.decode import DecodeLimits, ImageFacts
from rankgate.multimodal.errors import MediaRefused
from rankgate.multimodal.identity import content_identity
from rankgate.multimodal.isolation import BUSY, DecoderFailure, DecoderLimits, DecoderPool
from tests.multimodal import hostile
from tests.multimodal.pictures import encode, noise
from tests.support.polling import wait_until

IMAGE = msgspec.msgpack.encode(DecodeLimits(("PNG",), 1 << 20))
PNG = encode(noise(24, 16), "PNG")

ROOT = Path(__file__).resolve().parents[2]

MakePool = Callable[..., DecoderPool]


@pytest.fixture
def make_pool() -> Iterator[MakePool]:
    made: list[DecoderPool] = []

    def make(**limits: object) -> DecoderPool:
        settings = {"workers": 1, "timeout": 30.0, "memory_bytes": 512 << 20, **limits}
        pool = DecoderPool(DecoderLimits(**settings), hostile.HANDLER)  # type: ignore[arg-type]
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def decode(pool: DecoderPool, data: bytes = PNG) -> ImageFacts:
    return pool.run("image", IMAGE, data, ImageFacts)


def refusal(pool: DecoderPool, data: bytes) -> MediaRefused:
    with pytest.raises(MediaRefused) as caught:
        decode(pool, data)
    return caught.value


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not yet reaped counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_decoder_runs_under_its_limits(make_pool: MakePool) -> None:
    pool = make_pool(memory_bytes=384 << 20, cpu_seconds=7)
    limits = pool.run("image", IMAGE, hostile.LIMITS, hostile.Limits)
    assert limits.memory == (384 << 20, 384 << 20)
    assert limits.core == (0, 0)
    # Armed from the CPU time used when the job began, whole seconds rounded up.
    assert limits.cpu_used - 1 < limits.cpu[0] - 7 <= math.ceil(limits.cpu_used)
    assert pool.pids
    assert os.getpid() not in pool.pids


def test_an_image_decodes_to_its_facts_without_its_bytes_coming_back(make_pool: MakePool) -> None:
    facts = decode(make_pool())
    assert (facts.uuid, facts.width, facts.height) == (content_identity(PNG), 24, 16)
    assert (facts.reencoded, facts.header) == (None, (24, 16))


def test_a_decoder_starts_only_when_every_started_one_is_busy(make_pool: MakePool) -> None:
    pool = make_pool(workers=2)
    for _ in range(3):
        decode(pool)
    assert pool.started == 1


def test_a_crash_fails_its_job_alone_and_the_decoder_is_replaced(make_pool: MakePool) -> None:
    pool = make_pool()
    decode(pool)
    first = pool.pids
    crashed = refusal(pool, hostile.CRASH)
    assert (crashed.reason, crashed.status) == ("the decoder crashed on it (SIGSEGV)", 400)
    assert decode(pool).width == 24
    assert (pool.started, pool.lost) == (2, 1)
    assert pool.pids != first


def test_a_hang_is_killed_at_the_deadline(make_pool: MakePool) -> None:
    pool = make_pool(timeout=1.0)
    hung = refusal(pool, hostile.HANG)
    assert (hung.reason, hung.status) == ("the decoder took longer than 1 s on it", 400)
    assert decode(pool).width == 24
    assert pool.lost == 1


def test_a_job_past_its_cpu_time_is_ended_by_the_kernel(make_pool: MakePool) -> None:
    pool = make_pool(cpu_seconds=1)
    spun = refusal(pool, hostile.SPIN)
    assert spun.reason == "the decoder used more than 1 s of CPU time on it"
    assert decode(pool).width == 24


def test_a_memory_bomb_ends_at_the_address_space_limit(make_pool: MakePool) -> None:
    pool = make_pool(memory_bytes=512 << 20)
    bomb = refusal(pool, hostile.BOMB)
    assert bomb.reason == "the decoder needed more than 512 MiB of memory for it"
    assert decode(pool).width == 24


def test_refusals_and_bugs_keep_their_decoder(make_pool: MakePool) -> None:
    pool = make_pool()
    assert refusal(pool, b"not an image").reason.startswith("corrupt or unrecognised")
    with pytest.raises(DecoderFailure, match="KeyError: 'boom'"):
        decode(pool, hostile.FAIL)
    decode(pool)
    assert (pool.started, pool.lost) == (1, 0)


def test_a_decoder_killed_while_idle_is_replaced_before_the_next_job(make_pool: MakePool) -> None:
    pool = make_pool()
    decode(pool)
    (pid,) = pool.pids
    os.kill(pid, 9)
    wait_until(lambda: gone(pid), 10, f"decoder {pid} to exit")
    assert decode(pool).width == 24
    assert (pool.started, pool.lost) == (2, 0)


def test_a_full_queue_refuses_at_once_with_a_503(make_pool: MakePool) -> None:
    pool = make_pool(workers=1, queue=1)
    with pool.admitted(), pool.admitted():
        with pytest.raises(MediaRefused) as caught, pool.admitted():
            pass
        assert (caught.value.reason, caught.value.status) == (BUSY, 503)
    with pool.admitted():
        pass


def test_closing_ends_every_decoder_and_refuses_later_jobs(make_pool: MakePool) -> None:
    pool = make_pool(workers=2)
    decode(pool)
    pids = pool.pids
    pool.close()
    wait_until(lambda: all(gone(pid) for pid in pids), 10, f"decoders {pids} to exit")
    assert refusal(pool, PNG).status == 503


def test_a_decoder_stuck_in_a_job_dies_with_a_gateway_killed_outright() -> None:
    """A hang that uses no CPU escapes the CPU limit; the decoder must not outlive its gateway."""
    code = (
        "from rankgate.multimodal.decode import ImageFacts\n"
        "from rankgate.multimodal.isolation import DecoderLimits, DecoderPool\n"
        f"pool = DecoderPool(DecoderLimits(workers=1, timeout=600), {hostile.HANDLER!r})\n"
        f"pool.run('image', b'', {hostile.HANG!r}, ImageFacts)\n"
    )
    gateway = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        assert gateway.stderr is not None
        said = gateway.stderr.readline().split()
        assert said[:1] == [b"decoder"], said
        pid = int(said[1])
    finally:
        gateway.kill()
        gateway.wait()
    wait_until(lambda: gone(pid), 10, f"decoder {pid} to die with its gateway")
