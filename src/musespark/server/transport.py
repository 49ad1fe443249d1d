"""The HTTP transport under the app: uvicorn's h11 protocol with a header-read timeout.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but waits forever for the
headers of a request that has started: a client that opens a socket and trickles bytes (or
none) holds it indefinitely. `HeaderTimeoutProtocol` arms a timer when a connection opens
and after each response; it is disarmed when a request's headers are complete. A timer
that fires closes the connection (no response: the request never started).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """An h11 protocol class whose connections must send complete headers within `seconds`."""

    class HeaderTimeoutProtocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _armed_cycle: Any = None

        def _arm(self) -> None:
            self._disarm()
            self._armed_cycle = self.cycle
            self._timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._timer is not None and self.cycle is not self._armed_cycle:
                self._disarm()  # a new request's headers are complete

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
