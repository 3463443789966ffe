"""Fixtures for the image tests: a preparer whose DNS answers come from a table, not a network."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

import pytest

from rankgate.multimodal import MediaConfig, MediaPreparer

# Names the tests fetch from, and the addresses the fake resolver gives them.
PUBLIC_HOST = "images.example.com"
PUBLIC_IP = "93.184.215.14"
DNS: dict[str, list[str]] = {
    PUBLIC_HOST: [PUBLIC_IP],
    "cdn.example.com": ["2606:2800:21f:cb07:6820:80da:af6b:8b2c", PUBLIC_IP],
    "intranet.example.com": ["10.1.2.3"],
    "mixed.example.com": [PUBLIC_IP, "192.168.0.7"],
    "metadata.example.com": ["169.254.169.254"],
}


async def table_resolver(host: str, port: int) -> Sequence[str]:
    if host not in DNS:
        raise OSError(f"no such host {host}")
    return DNS[host]


MakePreparer = Callable[..., MediaPreparer]


@pytest.fixture
async def make_preparer() -> AsyncIterator[MakePreparer]:
    made: list[MediaPreparer] = []

    def make(model_id: str = "", resolver=table_resolver, **config: object) -> MediaPreparer:
        preparer = MediaPreparer(MediaConfig(**config), model_id=model_id, resolver=resolver)  # type: ignore[arg-type]
        made.append(preparer)
        return preparer

    yield make
    for preparer in made:
        await preparer.aclose()
