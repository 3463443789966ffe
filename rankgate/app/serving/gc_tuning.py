"""The garbage collector, told what start-up built once start-up is done.

Start-up builds tens of thousands of objects that live as long as the process (the app's
routes and models, templates, tables, the sidecar's state), all tracked by CPython's cyclic
collector. Every full collection walks them again, and it runs on the event loop: every
request in flight waits for it. Freezing them after start-up takes them out of every later
pass, so a full pass walks only what requests and caches made since.

Young passes run every ``YOUNG_THRESHOLD`` net allocations of tracked objects instead of
CPython's 700. Most of a request's objects are freed by reference counting, but a young pass
walks every object the requests in flight still hold: at 700, several times per request.
A pass over the larger young generation still walks only what is alive, which is what
requests in flight hold either way.

A request leaves nothing in a reference cycle (``tests/app/test_gc_tuning.py`` holds every
route to it): what it made is freed by reference counting the moment it ends, while still in
the CPU's caches, and the young passes that remain are rare and find little.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def tune_after_startup() -> None:
    """Collect start-up's garbage, freeze what is left out of later passes, and make young
    passes rarer."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
