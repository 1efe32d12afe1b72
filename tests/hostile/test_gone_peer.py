"""Every timer and refusal of the connection protocol survives a peer that has already gone.

The race these tests pin down: a client sends half a request and closes just as one of the protocol's timers
fires, or its close is still unread when the parser refuses what it sent. The answer we write then draws a
reset from the client's kernel (synchronously, on loopback), and the half-close that follows
(``transport.write_eof``) raised ``OSError: [Errno 107] Transport endpoint is not connected`` out of the
timer: "Exception in callback LimitedProtocol._head_timed_out()" and a traceback in the log.

The window is too narrow to hit reliably from outside, so each test makes it certain: a real TCP connection on
127.0.0.1 served by the real protocol class (uvicorn's config, inferd's limits), the client closed first, then
the timer callback or the parser fed in the same loop step, as the event loop runs them when the close is not
yet read. Nothing may raise, nothing may reach the loop's exception handler or the error log, and the
connection is closed at the end.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from inferd.server.http import LINGER_S, ConnectionLimits, LimitedProtocol, protocol_class

MAX_HEADER_BYTES = 1024
HEAD = b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
              send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """Reads the whole body, then answers: a request whose body never completes keeps it waiting."""
    if scope["type"] != "http":
        return
    while True:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def connected(loop: asyncio.AbstractEventLoop) -> tuple[socket.socket, LimitedProtocol]:
    config = uvicorn.Config(app, log_config=None, lifespan="off", access_log=False)
    config.load()
    cls = protocol_class(ConnectionLimits(MAX_HEADER_BYTES, header_timeout_s=60, body_timeout_s=60,
                                          limit_concurrency=None))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        served, _ = listener.accept()
    served.setblocking(False)
    _, proto = await loop.connect_accepted_socket(
        lambda: cls(config=config, server_state=ServerState(), app_state={}), served)
    return client, proto  # type: ignore[return-value]


def run_gone(drive: Callable[[socket.socket, LimitedProtocol], Awaitable[None]],
             caplog: pytest.LogCaptureFixture) -> LimitedProtocol:
    """Run one scenario on a fresh loop; return the protocol after its linger, with every error collected."""
    problems: list[str] = []

    async def scenario() -> LimitedProtocol:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, ctx: problems.append(f"{ctx.get('message')}: {ctx.get('exception')!r}"))
        client, proto = await connected(loop)
        try:
            await drive(client, proto)
        finally:
            client.close()
        await asyncio.sleep(LINGER_S + 0.3)  # the linger's close, or anything scheduled after the refusal
        return proto

    with caplog.at_level(logging.DEBUG):
        proto = asyncio.run(scenario())
    problems += [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not problems, problems
    assert proto.transport.is_closing(), "the connection was left open"
    return proto


async def settle() -> None:
    """Let the loop read what the client sent (and nothing more is sent after it)."""
    await asyncio.sleep(0.05)


def test_head_timeout_after_the_peer_closed(caplog: pytest.LogCaptureFixture) -> None:
    async def drive(client: socket.socket, proto: LimitedProtocol) -> None:
        client.sendall(HEAD)  # half a head: no blank line yet
        await settle()
        client.close()
        proto._head_timed_out()  # fires in the loop step before the close is read

    proto = run_gone(drive, caplog)
    assert proto._refusal is not None and proto._refusal[0] == 408


def test_body_timeout_after_the_peer_closed(caplog: pytest.LogCaptureFixture) -> None:
    async def drive(client: socket.socket, proto: LimitedProtocol) -> None:
        client.sendall(HEAD + b"Content-Length: 500\r\n\r\n" + b'{"texts": ["ha')
        await settle()
        assert proto.cycle is not None and not proto.cycle.response_started
        client.close()
        proto._body_timed_out()

    proto = run_gone(drive, caplog)
    assert proto.cycle is not None and proto.cycle.disconnected  # the app saw the client go


@pytest.mark.parametrize("data, status", [
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
    (HEAD + b"X-Filler: " + b"a" * (2 * MAX_HEADER_BYTES) + b"\r\n", 431),
], ids=["invalid-http", "head-too-large"])
def test_refusal_after_the_peer_closed(data: bytes, status: int, caplog: pytest.LogCaptureFixture) -> None:
    async def drive(client: socket.socket, proto: LimitedProtocol) -> None:
        client.close()
        proto.data_received(data)  # read in the same step as the close, which comes next

    proto = run_gone(drive, caplog)
    assert proto._refusal is not None and proto._refusal[0] == status


def test_shutdown_refusal_after_the_peer_closed(caplog: pytest.LogCaptureFixture) -> None:
    async def drive(client: socket.socket, proto: LimitedProtocol) -> None:
        client.sendall(HEAD + b"Content-Length: 500\r\n\r\n" + b'{"texts": ["ha')
        await settle()
        client.close()
        proto.shutdown()  # the server stops while this body is still uploading: answered 503

    proto = run_gone(drive, caplog)
    assert proto.cycle is not None and proto.cycle.disconnected
