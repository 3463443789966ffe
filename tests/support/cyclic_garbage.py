"""What a block of code leaves for CPython's cyclic collector, by type.

An object in a reference cycle outlives its last use until a collector pass finds it; the
gateway's passes run on the event loop, so what a request leaves there costs every request
in flight. Reference counting frees everything else the moment it is dropped.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cyclic_garbage(*modules: str) -> Iterator[Counter[str]]:
    """Counts, by ``module.type``, the unreachable objects the block leaves in cycles, for
    types defined in one of ``modules`` (prefixes). The collector is off meanwhile."""
    found: Counter[str] = Counter()
    gc.collect()
    gc.disable()
    try:
        yield found
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        for thing in gc.garbage:
            kind = type(thing)
            name = f"{kind.__module__}.{kind.__qualname__}"
            if name.startswith(modules):
                found[name] += 1
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
