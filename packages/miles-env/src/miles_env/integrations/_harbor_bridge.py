"""The Harbor side of `miles_env.integrations.harbor`: run in Harbor's own Python.

    python -P _harbor_bridge.py        # -P: this folder must not shadow the `harbor` package

One process runs many trials, concurrently, so Harbor and LiteLLM are imported once (about
9 s of CPU each time ``harbor trial start`` ran) and Harbor's per-process checks run once. It
reads one JSON request per line on stdin and writes one JSON reply per line on stdout
(``{"id", "ok", "result"}`` or ``{"id", "ok": false, "error", "type"}``); what Harbor prints
goes to ``$MILES_HARBOR_BRIDGE_DIR/bridge.log`` (the process also works in that folder).
Requests (``op``):

- ``trial``: ``config`` (Harbor's ``TrialConfig`` as JSON, what ``harbor trial start -c``
  reads) and ``timeout_s``: the agent's preflight, then ``Trial.create`` and ``run``; answers
  Harbor's ``TrialResult`` as JSON. Past ``timeout_s`` the trial is cancelled (Harbor stops its
  environment) and the reply is a ``TimeoutError``.
- ``cancel``: ``name`` (a running trial's ``trial_name``): cancel it as above.

At the end of stdin, running trials are cancelled and their environments stopped before the
process exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from typing import Any

_OUT = sys.stdout
_WORK = os.environ.get("MILES_HARBOR_BRIDGE_DIR")
if _WORK:
    os.chdir(_WORK)
    _log = open(os.path.join(_WORK, "bridge.log"), "a", buffering=1)  # noqa: SIM115
    os.dup2(_log.fileno(), 2)  # Harbor's loggers and its subprocesses' stderr
sys.stdout = sys.stderr  # what Harbor prints must not corrupt the replies

from harbor.agents.factory import AgentFactory  # noqa: E402
from harbor.models.trial.config import TrialConfig  # noqa: E402
from harbor.trial.trial import Trial  # noqa: E402

_running: dict[str, asyncio.Task[Any]] = {}


async def run_trial(config: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
    cfg = TrialConfig.model_validate(config)
    AgentFactory.run_preflight(cfg.agent)
    trial = await Trial.create(cfg)
    result = await asyncio.wait_for(trial.run(), timeout_s)
    return json.loads(result.model_dump_json())


async def _handle(req: dict[str, Any], out: asyncio.Lock) -> None:
    rid = req.get("id")
    try:
        fields = {k: v for k, v in req.items() if k not in ("id", "op")}
        if req["op"] == "trial":
            name = str(fields["config"]["trial_name"])
            trial = asyncio.create_task(run_trial(**fields))
            _running[name] = trial
            try:
                result: Any = await trial
            finally:
                _running.pop(name, None)
        elif req["op"] == "cancel":
            running = _running.get(str(fields["name"]))
            if running is not None:
                running.cancel()
            result = running is not None
        else:
            raise ValueError(f"unknown op {req['op']!r}")
        reply = {"id": rid, "ok": True, "result": result}
    except asyncio.CancelledError:
        reply = {"id": rid, "ok": False, "error": "the trial was cancelled", "type": "Cancelled"}
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        reply = {"id": rid, "ok": False, "error": str(exc), "type": type(exc).__name__}
    async with out:
        _OUT.write(json.dumps(reply, default=str) + "\n")
        _OUT.flush()


async def main() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = asyncio.Lock()
    pending: set[asyncio.Task[None]] = set()
    while line := await reader.readline():
        if line.strip():
            t = asyncio.create_task(_handle(json.loads(line), out))
            pending.add(t)
            t.add_done_callback(pending.discard)
    for task in list(_running.values()):  # the client is gone: stop what still runs
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(main())
