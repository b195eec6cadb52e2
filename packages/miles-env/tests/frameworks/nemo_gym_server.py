"""A NeMo Gym resources server for the integration test, run in NeMo Gym's own Python (3.12):
``python nemo_gym_server.py`` prints ``PORT <n>`` once it listens on 127.0.0.1.

Task: add two numbers with the ``add`` tool and answer with the sum. Tools: ``POST /add``
``{"a", "b"}``; ``/verify`` pays 1.0 when a function call's output holds the sum of the row's
``a`` and ``b`` and the final message states it. A real ``SimpleResourcesServer`` subclass,
served by uvicorn as NeMo Gym serves it (session middleware, /seed_session, /verify).
"""

from __future__ import annotations

import json
import socket
import sys

import uvicorn
from fastapi import FastAPI
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from pydantic import BaseModel


class AddRequest(BaseModel):
    a: int
    b: int


class AddVerifyRequest(BaseVerifyRequest):
    a: int
    b: int


class AddServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/add")(self.add)
        return app

    async def add(self, body: AddRequest) -> dict:
        return {"sum": body.a + body.b}

    async def verify(self, body: AddVerifyRequest) -> BaseVerifyResponse:
        want = body.a + body.b
        outputs = [o.output for o in body.response.output if o.type == "function_call_output"]
        used_tool = any(_sum(text) == want for text in outputs)
        said = str(want) in body.response.output_text
        return BaseVerifyResponse(**body.model_dump(), reward=1.0 if used_tool and said else 0.0)


def _sum(text: str) -> int | None:
    """The sum an add call returned (None for an error message the agent got back)."""
    if not text.startswith("{"):
        return None
    return json.loads(text).get("sum")


def main() -> None:
    server = AddServer.model_construct(
        config=BaseResourcesServerConfig(
            name="add_server", host="127.0.0.1", port=0, entrypoint="x"
        ),
        server_client=None,
    )
    app = server.setup_webserver()
    sock = socket.create_server(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
