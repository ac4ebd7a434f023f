"""The server's HTTP/1.1 connection protocol: uvicorn's h11 protocol with read deadlines and
connection caps that one client cannot fill.

uvicorn closes idle keep-alive connections (`--timeout-keep-alive`) but puts no deadline on a
request that is being received, so a client that sends half its headers, or half its body,
holds its connection (and, for the body, a task) forever. Here a new connection's first byte
must arrive within `first_byte_timeout` seconds, the request's headers within `header_timeout`
seconds of its first byte, and its whole body within `body_timeout` seconds of its headers;
past any of them the client gets a 408 and the connection is closed.

Open connections are capped twice: `max_connections` in all and `max_connections_per_client`
from one client address (an IPv6 client by its /64; addresses in `uncapped_clients`, by
default loopback, where a local proxy or benchmark stands for many clients, count only in
all). A connection over either cap makes room by closing the connection that has waited
longest without a request in flight (one that has sent nothing yet, part of a request's
headers, or nothing since its last response; of its own address when that address is at its
cap): idle sockets cannot lock other clients out. Only when every connection concerned has a
request in flight is the new one refused with a 503 and closed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK: tuple[Network, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)


@dataclass(frozen=True)
class ConnectionLimits:
    """The deadlines (seconds) and caps of `DeadlineH11Protocol`."""

    first_byte_timeout: float = 3.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 1024
    max_connections_per_client: int = 256
    uncapped_clients: Sequence[Network] = LOOPBACK


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


def client_address(client: tuple[str, int] | None, uncapped: Sequence[Network]) -> str | None:
    """The address whose connections count against the per-client cap: the client's IP (an
    IPv6 client's /64 network, which one host typically holds whole), or None for a client in
    `uncapped` or one without an IP (a Unix socket)."""
    if client is None:
        return None
    try:
        ip = ipaddress.ip_address(client[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in network for network in uncapped):
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class ConnectionTable:
    """One server's open connections by client address, and those without a request in flight
    in the order they started waiting (the first is the one to close to make room)."""

    def __init__(self) -> None:
        self.by_client: dict[str, dict[DeadlineH11Protocol, None]] = {}
        self.waiting: dict[DeadlineH11Protocol, None] = {}

    def add(self, conn: DeadlineH11Protocol) -> None:
        """A new connection: waiting for its first request."""
        if conn.client_key is not None:
            self.by_client.setdefault(conn.client_key, {})[conn] = None
        self.waiting[conn] = None

    def remove(self, conn: DeadlineH11Protocol) -> None:
        """The connection is closed or closing (again: nothing)."""
        self.waiting.pop(conn, None)
        mine = self.by_client.get(conn.client_key) if conn.client_key is not None else None
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.by_client[conn.client_key]

    def set_waiting(self, conn: DeadlineH11Protocol, waiting: bool) -> None:
        """Marks whether the connection has no request in flight (one already waiting keeps
        its place)."""
        if waiting:
            self.waiting.setdefault(conn, None)
        else:
            self.waiting.pop(conn, None)

    def count(self, client_key: str) -> int:
        """How many open connections the address holds."""
        return len(self.by_client.get(client_key, ()))

    def longest_waiting(self, client_key: str | None = None) -> DeadlineH11Protocol | None:
        """The connection that has waited longest without a request in flight (of
        `client_key`'s, when given: its oldest connection without one), or None."""
        if client_key is None:
            return next(iter(self.waiting), None)
        # The address's connections in the order they opened; at most the per-client cap.
        return next((c for c in self.by_client.get(client_key, ()) if c in self.waiting), None)


class DeadlineH11Protocol(H11Protocol):
    """h11 with first-byte, header and body deadlines and caps on open connections, in all and
    per client address, that make room by closing connections without a request in flight.

    Subclasses made by `deadline_protocol` set the limits and hold the server's table.
    """

    limits: ConnectionLimits = ConnectionLimits()
    table: ConnectionTable = ConnectionTable()

    client_key: str | None = None
    _deadline: asyncio.TimerHandle | None = None
    # "first" (no byte yet), "headers", "body", or None (no request being received)
    _phase: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Accepts the connection, making room when a cap is reached (or refuses it when no
        connection concerned is waiting), and starts the first-byte deadline."""
        super().connection_made(transport)
        limits = self.limits
        self.client_key = client_address(self.client, limits.uncapped_clients)
        key = self.client_key
        if key is not None and self.table.count(key) >= limits.max_connections_per_client:
            if not self._make_room(key):
                self._refuse("too many open connections from this address")
                return
        # self is in `connections` already
        if len(self.connections) > limits.max_connections and not self._make_room(None):
            self._refuse("too many open connections")
            return
        self.table.add(self)
        self._arm("first")

    def _make_room(self, client_key: str | None) -> bool:
        """Closes the connection (of `client_key`, when given) that has waited longest without
        a request in flight; False when there is none."""
        victim = self.table.longest_waiting(client_key)
        if victim is None:
            return False
        victim._close_now()
        return True

    def _close_now(self) -> None:
        """Closes this connection without a response and stops counting it at once."""
        self._disarm()
        self.table.remove(self)
        self.connections.discard(self)
        self.transport.close()

    def _refuse(self, message: str) -> None:
        self.connections.discard(self)
        self.transport.write(_plain_response(503, "Service Unavailable", message))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        """Drops the deadline and the connection's entries with the connection."""
        self._disarm()
        self.table.remove(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feeds h11, then moves the deadline to the phase the connection is in."""
        if self._receiving_headers() and self._phase in (None, "first"):
            self._arm("headers")
        super().data_received(data)
        if self._receiving_headers():
            return
        self.table.set_waiting(self, False)
        if self.cycle.more_body:
            if self._phase != "body":
                self._arm("body")
        else:
            self._disarm()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        """The connection becomes a WebSocket's: neither these deadlines nor these caps
        (which close only HTTP connections) apply to it any more."""
        self._disarm()
        self.table.remove(self)
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        """A response is done: the keep-alive timeout takes over until the next byte."""
        self._disarm()
        super().on_response_complete()
        if not self.transport.is_closing() and self._receiving_headers():
            self.table.set_waiting(self, True)

    def _receiving_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, phase: str) -> None:
        self._disarm()
        limits = self.limits
        timeout = {
            "first": limits.first_byte_timeout,
            "headers": limits.header_timeout,
            "body": limits.body_timeout,
        }[phase]
        self._phase = phase
        self._deadline = self.loop.call_later(timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._phase = None

    def _timed_out(self) -> None:
        """The request did not arrive in time: a 408 (unless a response began), then close."""
        what = {"first": "did not start", "headers": "headers did not arrive"}.get(
            self._phase or "", "body did not arrive"
        )
        self._deadline = None
        self._phase = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            message = f"the request {what} in time"
            self.transport.write(_plain_response(408, "Request Timeout", message))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def deadline_protocol(limits: ConnectionLimits) -> type[DeadlineH11Protocol]:
    """The protocol class for uvicorn's `http=` option with these limits (and a connection
    table of its own: one class per server)."""
    return type(
        "ConfiguredDeadlineH11Protocol",
        (DeadlineH11Protocol,),
        {"limits": limits, "table": ConnectionTable()},
    )
