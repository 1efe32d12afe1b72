"""The HTTP/1.1 connection protocol: uvicorn's httptools protocol with the limits a public listener needs.

uvicorn bounds none of these, and each was a cheap denial of service from one client:

- the request head's size: httptools buffers a header line whole (a 300 MB line grew the process by half a
  GB), so the head is counted as it arrives and refused with 431 once past ``server.max_header_bytes``;
- how long a head may take (``server.header_timeout_s``; 408) and a body (``server.body_timeout_s`` from
  the end of the head; 408): a client that stops mid-request no longer holds its connection for ever;
- concurrency (``server.limit_concurrency``): beyond it uvicorn answers a text/plain 503; here it is the one
  error shape with Retry-After, counted and logged like any request.

Refusals before the app runs (400, 408, 431, 505) are written here in the one error shape, counted in
``inferd_requests_total`` and logged by ``inferd.access``. Beside what httptools refuses, the head must say
HTTP/1.0 or HTTP/1.1 (505; httptools reads ``HTTP/2.0`` as a version like any other) and name one valid
host once (400; RFC 9112 §3.2), which HTTP/1.0 may leave out. A refused request pipelined behind others waits its turn:
HTTP/1.1 answers in request order, so the refusal (and the close) goes out only after the answers to the
requests before it; written at once, a client would read it as the first request's answer.

A refusal while the app waits for the body (408, or 503 at shutdown) is written here too and the app sees the
client go (``http.disconnect``); the request context middleware logs it with the status for the reason this
module put in the scope (``ABORT_STATUS``).

httptools rather than h11: h11 caps the head too (``h11_max_incomplete_event_size``) but answers a text/plain
400 there, has no timeouts either, and costs more CPU per request (it is pure Python).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any

import httptools
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from inferd.api.errors import error_body
from inferd.api.middleware import ABORT_STATUS, context, new_request_id

access_log = logging.getLogger("inferd.access")
log = logging.getLogger(__name__)

# After a refusal the connection reads (and drops) what the client still sends for this long before
# closing: closing with unread data would reset the connection and the client could lose the answer.
LINGER_S = 1.0
LIVENESS_PATH = b"/health/live"


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    limit_concurrency: int | None


class HeadWithBody:
    """The transport as a request's response cycle sees it: the response head goes out with the first body bytes,
    in one write.

    uvicorn writes the head and the body in two writes, and between them the event loop's thread may wait for the
    GIL (the inference thread holds it) for milliseconds. A worker killed there (kill -9, the OOM killer) has
    sent a head without its body: nginx, holding the start of an answer, may neither retry the request on another
    worker nor answer it, and closes the client's connection (one request in about 5,000 lost while a fleet
    worker was killed under load, tests/fleet/test_fleet_service.py). Written at once, an answer that fits the
    socket's buffer is either all sent or not at all, and nginx retries a request that got nothing.
    """

    def __init__(self, transport: asyncio.Transport, cycle: RequestResponseCycle) -> None:
        self._transport = transport
        self._cycle = cycle
        self._head: bytes | None = None
        self._held = False  # the head has been held once: every later write goes straight out

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._cycle.response_started and not self._held:
            # uvicorn marks the response started, then writes its head: this is the head (a 100 Continue
            # interim answer is written before, when the response has not started).
            self._held = True
            self._head = bytes(data)
            return
        if self._head is not None:
            data, self._head = self._head + bytes(data), None
        self._transport.write(data)

    def flush(self) -> None:
        """Write a head still held (a HEAD request's answer has no body write)."""
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, ...: the transport's own
        return getattr(self._transport, name)


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the refusal itself is in ``LimitedProtocol._refusal``."""


class LimitedProtocol(HttpToolsProtocol):
    """Subclassed per server by ``protocol_class`` with its limits, its metrics and its 503 app."""

    limits: ConnectionLimits
    metrics: Any = None
    overloaded_app: ASGIApp | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own check would answer text/plain; on_headers_complete does it instead.
        self.limit_concurrency = None
        self._in_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str, str] | None = None
        self._lingering = False
        # The cycle whose app runs: with pipelining, self.cycle is the newest request's, maybe still queued.
        self._running: RequestResponseCycle | None = None
        self._held = False  # a refusal waiting for the answers to the requests before it

    # -- connection events -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        running = self._running
        if running is not None and running is not self.cycle and not running.response_complete:
            # uvicorn tells only the newest cycle; a running one behind queued ones would never learn.
            running.disconnected = True
            running.message_event.set()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering or self._held:
            return  # a refused request's remainder: read and dropped until the linger ends
        self._unset_keepalive_if_required()
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_timer is None:
                self._arm_head_timer()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            if self._refusal is None:
                self._refusal = (400, "invalid_http", f"the request is not valid HTTP/1.1: {exc}")
            self._refuse()
            return
        # A head still incomplete after this data counts everything since it began: refuse before
        # httptools buffers more of it.
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            self._refusal = _too_large(self.limits.max_header_bytes)
            self._refuse()

    def send_400_response(self, msg: str) -> None:  # uvicorn's, should anything still call it
        self._refusal = self._refusal or (400, "invalid_http", msg)
        self._refuse()

    # -- parser callbacks ----------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers) + 16
        if size > self.limits.max_header_bytes:
            self._refusal = _too_large(self.limits.max_header_bytes)
            raise _Refused
        self._refusal = _version_or_host_refusal(self.parser.get_http_version(), self.headers)
        if self._refusal is not None:
            raise _Refused
        self._in_head = False
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        limit = self.limits.limit_concurrency
        over = limit is not None and (len(self.connections) > limit or len(self.tasks) >= limit)
        # Liveness is exempt: a flood of connections must not make Kubernetes restart a healthy process
        # (readiness is not: its 503 tells the load balancer to send less).
        if over and self.url.split(b"?", 1)[0] == LIVENESS_PATH:
            over = False
        if over:
            log.warning("over server.limit_concurrency (%d): answering 503", limit)
        self.app = self.overloaded_app if over and self.overloaded_app else self.config.loaded_app
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not None and self.cycle is not before:  # a new request (not an upgrade refused)
            self.cycle.transport = HeadWithBody(self.transport, self.cycle)  # type: ignore[assignment]

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)
        if cycle.more_body:
            # The body's time starts when its request runs: queued behind another (pipelined), it may not be
            # read until then (uvicorn pauses reading), and a 408 would go out before the earlier answer.
            if self._body_timer is not None:
                self._body_timer.cancel()
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def on_response_complete(self) -> None:
        running = self._running
        if running is not None and isinstance(running.transport, HeadWithBody):
            running.transport.flush()  # before anything the next request writes
        last = not self.pipeline
        super().on_response_complete()  # starts the next pipelined request, if any
        if self._held and last:
            self._held = False
            self._unset_keepalive_if_required()
            self._refuse()

    def on_body(self, body: bytes) -> None:
        if self.cycle is not None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self.cycle is not None:
            super().on_message_complete()
        self._in_head = True

    # -- timers ------------------------------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined head behind a running request: its time starts after
        elif self._head_bytes == 0:
            self.transport.close()  # connected and never sent a byte (or idle): nothing to answer
        else:
            self._refusal = (408, "header_timeout", f"the request head did not arrive within "
                             f"{self.limits.header_timeout_s:g} s (server.header_timeout_s)")
            self._refuse()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None:
            return
        if cycle.response_complete:
            self.transport.close()  # answered without reading the body, which is still trickling in
        elif not cycle.response_started:
            self.abort("body_timeout", f"the request body did not arrive within "
                       f"{self.limits.body_timeout_s:g} s (server.body_timeout_s)")

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    # -- refusing ----------------------------------------------------------------------------------------

    def abort(self, reason: str, message: str) -> None:
        """Answer a request whose body the app is still reading, and let the app see the client go."""
        cycle = self.cycle
        status = ABORT_STATUS[reason]
        ctx = context(cycle.scope)  # type: ignore[arg-type]
        ctx["abort"] = reason
        headers = [(b"retry-after", b"1")] if status == 503 else []
        code = "draining" if reason == "shutdown" else reason  # the code the app's own shutdown 503s carry
        self._write_error(status, code, message, ctx.get("request_id"), headers)
        cycle.disconnected = True  # the app's sends are dropped from now on; its receive says "gone"
        cycle.message_event.set()
        self._linger()

    def _refuse(self) -> None:
        """Answer a request the app never saw; count it and log it like any other."""
        assert self._refusal is not None
        status, code, message = self._refusal
        if self.transport.is_closing() or self._lingering or self._held:
            return
        if self._behind_earlier_answers():
            self._held = True  # on_response_complete of the last of them answers it
            self._cancel_timers()
            return
        rid = new_request_id()
        self._write_error(status, code, message, rid)
        if self.metrics is not None:
            self.metrics.requests.labels("other", str(status), "").inc()
        access_log.info("refused %d %s", status, code,
                        extra={"endpoint": "other", "status": status, "request_id": rid,
                               "client": f"{self.client[0]}:{self.client[1]}" if self.client else None})
        self._linger()

    def _behind_earlier_answers(self) -> bool:
        """Whether requests before the refused one still await their answers; the refused one never runs."""
        # Refused for its body (its head complete), a request has a cycle, queued or running: not an earlier one.
        refused = None if self._in_head else self.cycle
        if refused is not None and self.pipeline and self.pipeline[0][0] is refused:
            self.pipeline.popleft()
        running = self._running
        if running is not None and running is not refused and not running.response_complete:
            return True
        return bool(self.pipeline)

    def _write_error(self, status: int, code: str, message: str, rid: str | None,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
        body = error_body(status, message, code, type_=_ERROR_TYPES.get(status))
        head = [STATUS_LINE[status]]
        headers = [*self.server_state.default_headers, (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close"), *(extra or [])]
        if rid:
            headers.append((b"x-request-id", rid.encode()))
        head += [b"%s: %s\r\n" % (name, value) for name, value in headers]
        self.transport.write(b"".join([*head, b"\r\n", body]))

    def _linger(self) -> None:
        self._lingering = True
        self._cancel_timers()
        try:
            if self.transport.can_write_eof():
                self.transport.write_eof()
        except OSError:
            # The peer went before its answer (a timer or a parser callback ran before the loop read the
            # close): our write drew a reset, and the socket is no longer connected. Nothing to linger for.
            self.transport.abort()
            return
        self.loop.call_later(LINGER_S, self.transport.close)

    def shutdown(self) -> None:
        """The server is stopping: a request still uploading is answered 503 now, not cancelled later."""
        cycle = self.cycle
        if self._held:
            return  # the answers before the refusal are on their way; the refusal closes the connection
        if cycle is not None and not cycle.response_started and cycle.more_body and not self._lingering:
            self.abort("shutdown", "the server is shutting down; retry on another instance")
        else:
            super().shutdown()


# errors.py's table covers the statuses the app answers; these are the protocol's own.
_ERROR_TYPES = {400: "invalid_request_error", 408: "timeout_error", 431: "invalid_request_error",
                505: "invalid_request_error"}


# RFC 3986's uri-host (an IP literal in brackets, or a reg-name, which covers IPv4) and an optional port;
# empty is allowed (a target without an authority).
_HOST = re.compile(rb"(\[[0-9A-Za-z:.%~_-]+\]|[0-9A-Za-z._~!$&'()*+,;=%-]*)(:[0-9]*)?")


def _too_large(limit: int) -> tuple[int, str, str]:
    return 431, "header_too_large", f"the request line and headers exceed {limit} bytes (server.max_header_bytes)"


def _version_or_host_refusal(version: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, str, str] | None:
    """RFC 9112 §2.3 and §3.2: the versions spoken here, and the one Host header (optional in HTTP/1.0)."""
    if version not in ("1.0", "1.1"):
        return 505, "http_version_not_supported", f"HTTP/{version} is not supported; send HTTP/1.1"
    hosts = [value for name, value in headers if name == b"host"]  # uvicorn lower-cases header names
    if len(hosts) > 1:
        return 400, "invalid_host", f"the request has {len(hosts)} Host headers; exactly one is allowed"
    if not hosts and version == "1.1":
        return 400, "invalid_host", "an HTTP/1.1 request must have a Host header"
    if hosts and not _HOST.fullmatch(hosts[0].rstrip(b" \t")):  # httptools keeps the trailing whitespace
        return 400, "invalid_host", "the Host header is not a host[:port]"
    return None


def protocol_class(limits: ConnectionLimits, metrics: Any = None,
                   overloaded_app: ASGIApp | None = None) -> type[LimitedProtocol]:
    """A protocol class for one server (uvicorn instantiates it per connection with its own arguments)."""
    return type("InferdProtocol", (LimitedProtocol,),
                {"limits": limits, "metrics": metrics, "overloaded_app": overloaded_app})
