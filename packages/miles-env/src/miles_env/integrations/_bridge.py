"""A JSON-lines client for a bridge process that runs in another framework's Python.

Verifiers and HUD pin their own versions of openai / mcp / pydantic, so each runs in its own
venv; a small script there (``_verifiers_bridge.py``, ``_hud_bridge.py``) answers requests
``{"id", "op", ...}`` on stdin with ``{"id", "ok", "result"}`` or ``{"id", "ok": false, "type",
"error"}`` on stdout, one JSON object per line. Requests are concurrent: replies are matched by id.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["JsonLinesBridge"]


class JsonLinesBridge:
    """The bridge process ``python -P script`` and its pending requests.

    Args:
        python: the framework's Python.
        script: the bridge script.
        error: the exception class a failed request (or a bridge that exited) raises.
        name: the framework's name, for messages.
    """

    def __init__(
        self, python: str | os.PathLike[str], script: Path, error: type[Exception], name: str
    ) -> None:
        self.python = python
        self._script = script
        self._error = error
        self._name = name
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> bool:
        """Whether the process was started and not closed."""
        return self._proc is not None

    def _on_this_loop(self) -> bool:
        """Whether the process runs and was started on the running event loop."""
        return self._proc is not None and self._loop is asyncio.get_running_loop()

    def _forget(self) -> None:
        """Drop a process started on another event loop (one that has ended, e.g. an earlier
        ``miles train`` in this process): its pipes and lock belong to that loop. Its stdin is
        closed, so it ends what it runs and exits as at `aclose`."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.stdin is not None:
            pipe = proc.stdin.transport.get_extra_info("pipe")
            if pipe is not None:
                pipe.close()
        self._reader = None
        self._waiting.clear()
        self._lock = asyncio.Lock()

    async def _spawn(self, env: Mapping[str, str] | None = None) -> bool:
        """Start the process unless it runs (on this event loop); whether this call started it."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._forget()
            self._loop = loop
        async with self._lock:
            if self._proc is not None:
                return False
            self._proc = await asyncio.create_subprocess_exec(
                str(self.python),
                "-P",  # the bridge's folder must not shadow the framework's package
                str(self._script),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=None if env is None else dict(env),
                limit=1 << 26,
            )
            self._reader = asyncio.create_task(self._read())
            return True

    async def _read(self) -> None:
        proc = self._proc
        assert proc is not None
        assert proc.stdout is not None
        try:
            while line := await proc.stdout.readline():
                reply = json.loads(line)
                fut = self._waiting.pop(int(reply["id"]), None)
                if fut is None or fut.done():
                    continue
                if reply["ok"]:
                    fut.set_result(reply["result"])
                else:
                    fut.set_exception(self._error(f"{reply['type']}: {reply['error']}"))
        except asyncio.CancelledError:
            # The event loop is ending (asyncio.run's exit, a rollout closing its loop): the
            # process ends with it, as at aclose, so no later loop inherits its pipes.
            if self._proc is proc:
                self._proc = None
                await self._end(proc)
            raise
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(self._error(f"the {self._name} bridge exited"))
        self._waiting.clear()

    async def _send(self, op: str, **fields: Any) -> Any:
        """Send one request to the running process; its result, or the bridge's error."""
        if self._proc is None or self._proc.stdin is None:
            raise self._error("the bridge is not running: call start() first")
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        self._proc.stdin.write((json.dumps({"id": rid, "op": op, **fields}) + "\n").encode())
        await self._proc.stdin.drain()
        return await fut

    async def aclose(self) -> None:
        """End the process (and what it serves: tool servers, environments). Idempotent."""
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            self._forget()
            return
        proc, self._proc = self._proc, None
        if proc is None:
            return
        await self._end(proc)
        if self._reader is not None:
            await self._reader

    @staticmethod
    async def _end(proc: asyncio.subprocess.Process) -> None:
        """Close the process's stdin (it ends its work and exits) and wait; kill after 30 s."""
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), timeout=30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
