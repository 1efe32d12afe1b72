"""HTTP clients for the load generator: a lean asyncio HTTP/1.1 client (default) and an httpx one.

Why a hand-rolled client: on a 2-core machine the load generator shares the CPU with the server it
measures, so every millisecond it spends per request is taken from the server. Measured against a trivial
uvicorn app on this project's 2-core box, httpx's AsyncClient cost 1.0-4.7 ms of client CPU per request
(growing with concurrency: its pool scans all waiting requests) and capped out at 150-850 requests/s; this
client costs about 0.05 ms per request. httpx stays selectable (``--client httpx``) as a cross-check.

The lean client speaks just what the benchmark needs: keep-alive POST/GET, Content-Length or chunked
bodies, a pool that grows to as many connections as requests in flight (an open loop needs that).
"""

from __future__ import annotations

import asyncio
from typing import Protocol
from urllib.parse import urlsplit


class HTTPClient(Protocol):
    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]: ...
    async def aclose(self) -> None: ...


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.1 the client understands."""


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class LeanClient:
    """Keep-alive HTTP/1.1 over asyncio streams; one request at a time per connection."""

    def __init__(self, base_url: str, timeout: float = 120.0, api_key: str | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only plain http://host:port URLs are supported, not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.timeout = timeout
        self._idle: list[_Conn] = []
        self._all: set[asyncio.StreamWriter] = set()
        self._host_header = f"Host: {self.host}:{self.port}\r\n".encode()
        if api_key:
            self._host_header += f"Authorization: Bearer {api_key}\r\n".encode()

    async def _acquire(self) -> tuple[_Conn, bool]:
        """An idle connection the server has not closed (True: reused), else a new one (False)."""
        while self._idle:
            conn = self._idle.pop()
            if not conn[0].at_eof() and not conn[1].is_closing():
                return conn, True
            self._discard(conn)
        return await self._acquire_new()

    def _discard(self, conn: _Conn) -> None:
        self._all.discard(conn[1])
        conn[1].close()

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        head = f"{method} {path} HTTP/1.1\r\n".encode() + self._host_header
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
        data = head + b"\r\n" + (body or b"")
        async with asyncio.timeout(self.timeout):
            conn, reused = await self._acquire()
            try:
                status, payload, keep = await self._exchange(conn, data)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                # A kept-alive connection the server closed (its keep-alive timeout) just as we reused it:
                # nothing was answered, so send again on a fresh connection, as browsers and httpx do.
                if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                    raise
                conn, _ = await self._acquire_new()
                status, payload, keep = await self._exchange(conn, data)
        if keep:
            self._idle.append(conn)
        else:
            self._discard(conn)
        return status, payload

    async def _acquire_new(self) -> tuple[_Conn, bool]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self._all.add(writer)
        return (reader, writer), False

    async def _exchange(self, conn: _Conn, data: bytes) -> tuple[int, bytes, bool]:
        try:
            conn[1].write(data)
            return await _read_response(conn[0])
        except BaseException:
            self._discard(conn)
            raise

    async def aclose(self) -> None:
        for writer in list(self._all):
            writer.close()
        self._all.clear()
        self._idle.clear()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise ProtocolError(f"bad status line {lines[0][:80]!r}") from None
    length, chunked, keep = None, False, True
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
        elif name == b"connection" and value.strip().lower() == b"close":
            keep = False
    if chunked:
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(data[:-2])
        return status, b"".join(parts), keep
    if length is None:
        return status, await reader.read(), False
    return status, await reader.readexactly(length), keep


class HttpxClient:
    """The same interface over httpx.AsyncClient (heavier; see the module docstring)."""

    def __init__(self, base_url: str, connections: int, timeout: float = 120.0, api_key: str | None = None) -> None:
        import httpx

        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._client = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout, headers=auth)

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        headers = {"content-type": "application/json"} if body is not None else None
        r = await self._client.request(method, path, content=body, headers=headers)
        return r.status_code, r.content

    async def aclose(self) -> None:
        await self._client.aclose()


# What a failed request is counted as (besides an HTTP status): connection and protocol trouble.
CLIENT_ERRORS: tuple[type[BaseException], ...] = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                                                  ProtocolError, TimeoutError)
try:
    import httpx as _httpx

    CLIENT_ERRORS += (_httpx.HTTPError,)
except ImportError:  # pragma: no cover - httpx is a dependency, but the lean client does not need it
    pass


def make_client(kind: str, base_url: str, connections: int, api_key: str | None = None) -> HTTPClient:
    """``api_key``: sent as a Bearer token with every request (a server with keys or tenants)."""
    if kind == "lean":
        return LeanClient(base_url, api_key=api_key)
    if kind == "httpx":
        return HttpxClient(base_url, connections, api_key=api_key)
    raise ValueError(f"unknown client {kind!r}; choose lean or httpx")
