"""ClientWatch under a server that is not the gateway's own: no DisconnectNotice in the scope,
so a waiting ``receive`` is what learns of the hang-up. (Under the gateway's protocol the
hang-up tests of tests/chaos/test_clients.py and tests/app/test_non_streaming.py cover it.)"""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive, Scope, Send

from rankgate.app.serving.clients import ClientWatch

PATH = "/v1/chat/completions"


def scope() -> Scope:
    return {"type": "http", "path": PATH, "headers": []}


class Client:
    """An ASGI client that sends a whole body, then hangs up when told to."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        if not self.sent:
            self.sent.append({"type": "http.request", "body": b"{}", "more_body": False})
            return self.sent[-1]
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)


async def test_a_hang_up_cuts_the_request_through_a_waiting_receive() -> None:
    started = asyncio.Event()
    cancelled: list[bool] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        started.set()
        try:
            await asyncio.Event().wait()  # until the hang-up cancels it
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    watch = ClientWatch(app, [PATH], stall_timeout=0)
    client = Client()
    request = asyncio.ensure_future(watch(scope(), client.receive, client.send))
    await asyncio.wait_for(started.wait(), 5)
    client.left.set()
    await asyncio.wait_for(request, 5)
    assert cancelled == [True]
    assert watch.disconnects == 1


async def test_a_complete_response_is_not_cut_and_leaves_no_watcher() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    watch = ClientWatch(app, [PATH], stall_timeout=0)
    client = Client()
    before = len(asyncio.all_tasks())
    await asyncio.wait_for(watch(scope(), client.receive, client.send), 5)
    client.left.set()
    await asyncio.sleep(0)
    assert watch.disconnects == 0
    assert len(asyncio.all_tasks()) <= before
