"""What one small write to a loopback TCP socket costs the writing core.

Every streamed token is one such write for any gateway, and a non-streaming answer one or two
(its head and body), so this is the floor under the per-token and per-request CPU figures of
``bench/equal_load.py``. The writer is pinned to ``--writer-cpu`` and a reader drains the
socket on ``--reader-cpu``; CPU is the writer thread's own (``time.thread_time``), kernel time
included.

    scripts/in-netns .venv/bin/python bench/loopback_write.py [--sizes 250 400] [--count 50000]
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time


def _drain(sock: socket.socket, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while sock.recv(1 << 20):
        pass


def measure(writer: socket.socket, size: int, count: int, pieces: int) -> float:
    """CPU microseconds per ``size`` bytes written in ``pieces`` sends."""
    payload = b"x" * size
    cut = size // pieces
    parts = [payload[i * cut : (i + 1) * cut if i < pieces - 1 else size] for i in range(pieces)]
    send = writer.send
    start = time.thread_time()
    for _ in range(count):
        for part in parts:
            send(part)
    return (time.thread_time() - start) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[250, 400])
    parser.add_argument("--count", type=int, default=50_000)
    parser.add_argument("--writer-cpu", type=int, default=1)
    parser.add_argument("--reader-cpu", type=int, default=0)
    args = parser.parse_args()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        writer = socket.create_connection(listener.getsockname())
        reader, _ = listener.accept()
    writer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=_drain, args=(reader, args.reader_cpu), daemon=True).start()
    os.sched_setaffinity(0, {args.writer_cpu})
    print("| bytes | one send: CPU us | the same bytes in two sends: CPU us |")
    print("|---:|---:|---:|")
    for size in args.sizes:
        one = measure(writer, size, args.count, 1)
        two = measure(writer, size, args.count, 2)
        print(f"| {size} | {one:.1f} | {two:.1f} |")
    writer.close()


if __name__ == "__main__":
    main()
