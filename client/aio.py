"""The asyncio client: the same proxy and sessions, awaitable.

    async with AsyncProxy(upstreams=...) as proxy:
        session = await proxy.session(model="m", upstream="vllm")
        ...
        summary = await session.close(reward=1.0)

Each control-API call is a few milliseconds of blocking HTTP; it runs in the loop's default
executor (``asyncio.to_thread``) so a hundred rollouts on one loop never wait on each other,
with no HTTP client beyond the standard library's. The sync objects stay reachable as
``.sync`` for code that wants them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from interceptor.client.proxy import Proxy, Session
from interceptor.trace import Trace


class AsyncProxy:
    """``Proxy`` with awaitable calls; ``async with`` starts it and stops it (by PID, also
    on an exception or a cancellation)."""

    def __init__(self, **options: Any) -> None:
        self.sync = Proxy(**options)

    @classmethod
    async def attach(cls, url: str, admin_token: str | None = None, **kw: Any) -> AsyncProxy:
        proxy = cls.__new__(cls)
        proxy.sync = await asyncio.to_thread(Proxy.attach, url, admin_token, **kw)
        return proxy

    @property
    def url(self) -> str | None:
        return self.sync.url

    @property
    def admin_token(self) -> str | None:
        return self.sync.admin_token

    @property
    def trace_dir(self) -> Path | None:
        return self.sync.trace_dir

    @property
    def pid(self) -> int | None:
        return self.sync.pid

    async def start(self) -> AsyncProxy:
        await asyncio.to_thread(self.sync.start)
        return self

    async def stop(self) -> None:
        await asyncio.to_thread(self.sync.stop)

    async def __aenter__(self) -> AsyncProxy:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.shield(self.stop())

    async def health(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.health)

    async def sessions(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.sync.sessions)

    async def session(self, **config: Any) -> AsyncSession:
        """As ``Proxy.session``."""
        return AsyncSession(await asyncio.to_thread(lambda: self.sync.session(**config)))

    async def claim(self, session_id: str) -> AsyncSession:
        return AsyncSession(await asyncio.to_thread(self.sync.claim, session_id))

    async def upstream(self, name: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.upstream, name)

    async def set_version(self, upstream: str, version: int | str) -> dict[str, Any]:
        """As ``Proxy.set_version``."""
        return await asyncio.to_thread(self.sync.set_version, upstream, version)

    @contextlib.asynccontextmanager
    async def paused(self, upstream: str, *, timeout: float = 60,
                     version: int | str | None = None) -> AsyncIterator[dict[str, Any]]:
        """As ``Proxy.paused``: the rollouts on the loop go on (their new requests wait at the
        proxy) while the pause waits for the sent ones in a thread."""
        answer = await asyncio.to_thread(self.sync.pause, upstream, timeout)
        try:
            yield answer
            if version is not None:
                await self.set_version(upstream, version)
        finally:
            await asyncio.shield(asyncio.to_thread(self.sync.resume, upstream))


class AsyncSession:
    """``Session`` with awaitable calls; ``async with`` closes it on the way out."""

    def __init__(self, session: Session) -> None:
        self.sync = session
        self.id = session.id
        self.env = session.env
        self.trace_path = session.trace_path
        self.secret = session.secret
        self.proxy_url = session.proxy_url
        self.ca_bundle = session.ca_bundle

    def __repr__(self) -> str:
        return repr(self.sync)

    @property
    def closed(self) -> bool:
        return self.sync.closed

    def ssl_context(self) -> ssl.SSLContext:
        return self.sync.ssl_context()

    async def isolated(self, cmd: list[str], *, user: tuple[int, int] | None = None) -> list[str]:
        """As ``Session.isolated``."""
        return await asyncio.to_thread(lambda: self.sync.isolated(cmd, user=user))

    async def summary(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.summary)

    async def close(self, reward: float | None = None, metrics: dict[str, Any] | None = None,
                    stop_condition: str | None = None, **more: Any) -> dict[str, Any]:
        """As ``Session.close``."""
        return await asyncio.to_thread(lambda: self.sync.close(reward, metrics, stop_condition, **more))

    async def trace(self) -> Trace:
        return await asyncio.to_thread(self.sync.trace)

    async def state(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.sync.state)

    async def update_state(self, patch: dict[str, Any]) -> int:
        return await asyncio.to_thread(self.sync.update_state, patch)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        if not self.closed:
            await asyncio.shield(self.close(stop_condition="error" if exc_type is not None else None))
