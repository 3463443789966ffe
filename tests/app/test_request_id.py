"""Made-up request ids: 96 random bits each, never repeated, in a forked worker too."""

from __future__ import annotations

import os
import re

from rankgate.app.edge.request_id import from_header, new_request_id


def test_made_up_ids_are_24_hex_digits_and_do_not_repeat_across_batches() -> None:
    ids = [new_request_id() for _ in range(5000)]
    assert all(re.fullmatch(r"[0-9a-f]{24}", rid) for rid in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_does_not_hand_out_its_parents_ids() -> None:
    new_request_id()  # the parent holds a batch it has barely begun
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.write(write, " ".join(new_request_id() for _ in range(8)).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    with os.fdopen(read) as pipe:
        theirs = pipe.read().split()
    ours = [new_request_id() for _ in range(8)]
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(theirs) == 8
    assert not set(theirs) & set(ours)


def test_a_missing_header_gets_a_made_up_id_and_a_bad_one_an_error() -> None:
    made_up, problem = from_header(None)
    assert problem is None
    assert re.fullmatch(r"[0-9a-f]{24}", made_up)
    assert from_header("client-7") == ("client-7", None)
    replaced, refused = from_header("bad id\r\n")
    assert replaced != "bad id\r\n"
    assert refused is not None
    assert refused.status == 400
