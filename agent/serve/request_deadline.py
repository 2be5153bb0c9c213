"""uvicorn's HTTP/1.1 protocol with a deadline for each request to arrive whole.

uvicorn closes a connection left idle after a response (its keep-alive timeout), but not one that
has sent part of a request, nor one that sends a byte after a response: the rest may trickle in
forever. About 20,000 such connections, the agent's limit of open files, left it unable to accept
anyone, /v1/status included (slowloris). A request that has not arrived whole, head and body,
`request_timeout_s` after its connection opened or the previous response ended now has its
connection closed; and while more than `max_arriving` connections wait for their requests to
arrive, a new one closes the one that has waited longest, so a flood of them holds a bounded
number of files and a client that sends its request at once is still served.
"""
from __future__ import annotations

import asyncio
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT_S = 30.0     # a body at the agent's limit (~0.5 MB) takes 10 s at 50 KB/s
ARRIVING = (h11.IDLE, h11.SEND_BODY)    # the client's states while its request is not in whole
# a quarter of the open-files limit (at most 1,000): the rest stays for the store, the experts and clients
MAX_ARRIVING = min(1000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)


class RequestDeadline(H11Protocol):
    request_timeout_s = REQUEST_TIMEOUT_S
    max_arriving = MAX_ARRIVING
    arriving: dict[RequestDeadline, None] = {}   # oldest first (one server per process; a subclass has its own)
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state not in ARRIVING:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()    # may start on a pipelined request already here
        if not self.transport.is_closing() and self.conn.their_state in ARRIVING:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_timeout_s, self._expire)
        self.arriving[self] = None
        if len(self.arriving) > self.max_arriving:
            next(iter(self.arriving))._expire()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.arriving.pop(self, None)

    def _expire(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()
