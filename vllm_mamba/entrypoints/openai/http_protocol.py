"""The server's HTTP/1.1 connection protocol: uvicorn's h11 protocol with read deadlines and a
connection cap.

uvicorn closes idle keep-alive connections (`--timeout-keep-alive`) but puts no deadline on a
request that is being received, so a client that sends half its headers, or half its body,
holds its connection (and, for the body, a task) forever. Here a request's headers must arrive
within `header_timeout` seconds of its first byte (or of the connection's start), and its
whole body within `body_timeout` seconds of its headers; past either the client gets a 408 and
the connection is closed. A connection beyond `max_connections` open ones gets a 503 and is
closed at once.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol


def _plain_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-shaped error body that closes the connection."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": status,
            }
        }
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class DeadlineH11Protocol(H11Protocol):
    """h11 with a header deadline, a body deadline and a cap on open connections.

    Subclasses made by `deadline_protocol` set the three limits.
    """

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 1024

    _deadline: asyncio.TimerHandle | None = None
    _phase: str | None = None  # "headers", "body", or None (no request being received)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Accepts the connection (or refuses it over the cap) and starts the header deadline."""
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(
                _plain_response(503, "Service Unavailable", "too many open connections")
            )
            transport.close()
            return
        self._arm("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        """Drops the deadline with the connection."""
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feeds h11, then moves the deadline to the phase the connection is in."""
        if self._receiving_headers() and self._phase is None:
            self._arm("headers")
        super().data_received(data)
        if self._receiving_headers():
            return
        if self.cycle.more_body:
            if self._phase != "body":
                self._arm("body")
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        """A response is done: the keep-alive timeout takes over until the next byte."""
        self._disarm()
        super().on_response_complete()

    def _receiving_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, phase: str) -> None:
        self._disarm()
        timeout = self.header_timeout if phase == "headers" else self.body_timeout
        self._phase = phase
        self._deadline = self.loop.call_later(timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._phase = None

    def _timed_out(self) -> None:
        """The request did not arrive in time: a 408 (unless a response began), then close."""
        what = "headers" if self._phase == "headers" else "body"
        self._deadline = None
        self._phase = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            message = f"the request {what} did not arrive in time"
            self.transport.write(_plain_response(408, "Request Timeout", message))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def deadline_protocol(
    header_timeout: float, body_timeout: float, max_connections: int
) -> type[DeadlineH11Protocol]:
    """The protocol class for uvicorn's `http=` option with these limits."""
    return type(
        "ConfiguredDeadlineH11Protocol",
        (DeadlineH11Protocol,),
        {
            "header_timeout": header_timeout,
            "body_timeout": body_timeout,
            "max_connections": max_connections,
        },
    )
