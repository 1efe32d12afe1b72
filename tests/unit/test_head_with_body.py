"""An answer's head leaves the worker with its body, in one write: a worker that dies between them sent nothing.

Why it matters: nginx retries a request on another worker only while it holds no byte of the answer. A worker
killed -9 after writing a head but before its body (uvicorn wrote them apart, and the event loop's thread can
wait for the GIL between the two) left nginx with half an answer, which it can neither retry nor finish: it
closed the client's connection (tests/fleet/test_fleet_service.py's kill -9 under load lost one request in about
5,000). Here the real protocol class serves a real loopback connection; the app sends its head, then waits, and
the worker "dies" there (its transport aborted): the client must read nothing at all. The interim
``100 Continue`` still goes out before the body is read, and a HEAD request's head (no body write) still goes out.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from inferd.server.http import ConnectionLimits, LimitedProtocol, protocol_class

REQUEST = b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class HeldApp:
    """Reads the body, sends its head, then waits for ``release`` before the body (``head_sent`` says when)."""

    def __init__(self) -> None:
        self.head_sent = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"13")]})
        self.head_sent.set()
        await self.release.wait()
        await send({"type": "http.response.body", "body": b'{"ok": "yes"}'})


async def serve_one(app: HeldApp) -> tuple[socket.socket, LimitedProtocol]:
    config = uvicorn.Config(app, log_config=None, lifespan="off", access_log=False)
    config.load()
    cls = protocol_class(ConnectionLimits(16_384, header_timeout_s=60, body_timeout_s=60, limit_concurrency=None))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        served, _ = listener.accept()
    served.setblocking(False)
    client.setblocking(False)
    _, proto = await asyncio.get_running_loop().connect_accepted_socket(
        lambda: cls(config=config, server_state=ServerState(), app_state={}), served)
    return client, proto  # type: ignore[return-value]


async def received(client: socket.socket, seconds: float = 0.3) -> bytes:
    """Everything the client can read within ``seconds`` (b"" if the server closed without a byte)."""
    loop = asyncio.get_running_loop()
    out = b""
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        try:
            chunk = client.recv(65536)
        except BlockingIOError:
            await asyncio.sleep(0.01)
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return out


def test_a_worker_dying_between_head_and_body_has_sent_nothing() -> None:
    async def scenario() -> bytes:
        app = HeldApp()
        client, proto = await serve_one(app)
        try:
            client.sendall(REQUEST)
            await asyncio.wait_for(app.head_sent.wait(), 5)
            await asyncio.sleep(0.05)  # the loop runs on between the two writes, as a GIL wait lets it
            proto.transport.abort()  # the process dies: the kernel closes its socket
            return await received(client)
        finally:
            client.close()

    assert asyncio.run(scenario()) == b""


def test_the_head_goes_out_with_the_body_and_the_answer_is_whole() -> None:
    async def scenario() -> tuple[bytes, bytes]:
        app = HeldApp()
        client, _ = await serve_one(app)
        try:
            client.sendall(REQUEST)
            await asyncio.wait_for(app.head_sent.wait(), 5)
            early = await received(client, 0.1)
            app.release.set()
            return early, await received(client)
        finally:
            client.close()

    early, answer = asyncio.run(scenario())
    assert early == b""
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b'\r\n\r\n{"ok": "yes"}'), answer


def test_100_continue_is_not_held_and_a_head_request_gets_its_head() -> None:
    async def scenario() -> tuple[bytes, bytes]:
        app = HeldApp()
        app.release.set()
        client, _ = await serve_one(app)
        try:
            client.sendall(REQUEST[:-2].replace(b"Content-Length", b"Expect: 100-continue\r\nContent-Length"))
            interim = await received(client)  # asked before the body is sent: the app is waiting to read it
            client.sendall(b"{}")
            await received(client)
            client.sendall(b"HEAD /predict HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            return interim, await received(client)
        finally:
            client.close()

    interim, head = asyncio.run(scenario())
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n"), head
