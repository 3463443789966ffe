"""Start-up's objects are frozen out of the cyclic collector's passes once the app is up."""

from __future__ import annotations

import gc

import httpx


def test_startup_objects_are_frozen_once_the_gateway_is_up(scripted_http: httpx.Client) -> None:
    assert scripted_http.get("/ready").status_code == 200
    # The app, its routes and models, the tokenizer tables and the sidecar's state.
    assert gc.get_freeze_count() > 10_000
