"""The names of the LoRA adapters vLLM has loaded, asked of ``Control.ListLoras``.

Requests that name an adapter are checked against this list, so it is cached for a few seconds
and callers that miss the cache at the same moment share one fetch.
"""

from __future__ import annotations

import asyncio

import grpc

from rankgate.sidecar.config import CONTROL_RPC_TIMEOUT_S
from rankgate.sidecar.errors import FailedPrecondition
from rankgate.sidecar.lifecycle import Lifecycle
from rankgate.sidecar.status import error_from_rpc
from rankgate.wire.proto.vllm import control_pb2

LORA_CACHE_TTL_S = 5.0

_LIST_LORAS_REQUEST = control_pb2.ListLorasRequest()


class LoraNames:
    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle
        self._cached: tuple[float, tuple[str, ...]] | None = None
        self._fetch: asyncio.Task[tuple[str, ...]] | None = None

    async def get(self) -> tuple[str, ...]:
        """The loaded adapters' names, sorted; () when LoRA is off."""
        loop = asyncio.get_running_loop()
        cached = self._cached
        if cached is not None and loop.time() - cached[0] < LORA_CACHE_TTL_S:
            return cached[1]
        if self._lifecycle.pool is None:
            raise self._lifecycle.unavailable()
        if self._fetch is None or self._fetch.done():
            self._fetch = loop.create_task(self._list())
        return await asyncio.shield(self._fetch)

    def close(self) -> None:
        if self._fetch is not None:
            self._fetch.cancel()

    async def _list(self) -> tuple[str, ...]:
        lifecycle = self._lifecycle
        assert lifecycle.pool is not None
        try:
            response = await lifecycle.pool.first.control.ListLoras(
                _LIST_LORAS_REQUEST, timeout=CONTROL_RPC_TIMEOUT_S
            )
            names = tuple(sorted(adapter.lora_name for adapter in response.adapters))
        except grpc.aio.AioRpcError as error:
            mapped = error_from_rpc(error, lifecycle.retry_after)
            if not isinstance(mapped, FailedPrecondition):
                raise mapped from None
            names = ()
        self._cached = (asyncio.get_running_loop().time(), names)
        return names
