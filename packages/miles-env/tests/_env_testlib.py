"""Helpers shared by miles-env's tests."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from miles_env.backends.local import local_available

T = TypeVar("T")

LOCAL_OK, LOCAL_WHY = local_available()
ROOT = os.geteuid() == 0

needs_local = pytest.mark.skipif(not LOCAL_OK, reason=f"local backend: {LOCAL_WHY}")
needs_root = pytest.mark.skipif(
    not ROOT, reason="needs root: the local backend drops to a per-sandbox uid and uses cgroups"
)


class Loop:
    """One event loop kept across a test's (or module's) calls, so a sandbox made in one
    call can be used in the next."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
