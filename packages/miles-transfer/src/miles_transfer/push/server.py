"""A small HTTP server putting any ``WeightReceiver`` behind SGLang's weight-update endpoints.

For an inference copy that lives in another process on the same host (a plain torch model in
another RL stack, the standalone example, tests). It implements only the weight-sync subset of
SGLang's API, with SGLang's request and answer shapes, plus the Miles ``/weights_checksum``
extension; there is no generation here. Standard library only (``http.server``).

Status codes follow SGLang/FastAPI: 200 success, 400 the update was read and failed
(``{"success": false, "message"}``), 404 unknown path, 422 malformed request (payload not read),
401 a missing or wrong API key (every request but ``GET /health`` when the server has one), 413
a body over ``max_request_mb``. Payloads must be ``miles_safetensors`` (no pickle) unless the
server was started with ``allow_pickle``.
"""

from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from miles_transfer.auth import bearer_ok, check_bind
from miles_transfer.checkpoint import iter_safetensors
from miles_transfer.protocols import WeightReceiver
from miles_transfer.push.safe_wire import SAFE_FORMAT
from miles_transfer.push.wire import FLATTENED_BUCKET, deserialize_named_tensors, discard_serialized

__all__ = ["WeightServer"]


class _BadRequestError(Exception):
    """A malformed request: answered 422, nothing was read or changed."""


class WeightServer:
    """Serve a receiver over HTTP on a background thread (loopback by default).

    Example::

        with WeightServer(ModuleReceiver(model)) as server:
            sender_side = HTTPReceiver(server.url)

    Attributes:
        receiver: the receiver updated by requests.
        url: the base URL, e.g. ``"http://127.0.0.1:40123"``.
        paused: whether ``/pause_generation`` was called without a matching continue.
        pause_calls: the modes of every ``/pause_generation`` call (for tests and logs).
    """

    def __init__(
        self,
        receiver: WeightReceiver,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        insecure_no_auth: bool = False,
        allow_pickle: bool = False,
        max_request_mb: float = 64.0,
    ) -> None:
        """Start serving.

        Args:
            receiver: the weights to serve.
            host: address to bind (payloads live in shared memory: the sender is on this host).
            port: TCP port; 0 picks a free one.
            api_key: require ``Authorization: Bearer <api_key>`` on every request but
                ``GET /health``.
            insecure_no_auth: allow a non-loopback ``host`` without ``api_key``.
            allow_pickle: also accept SGLang's pickled payloads (``flattened_bucket``, the plain
                list); only from a trusted sender.
            max_request_mb: the largest request body read (413 above it).

        Raises:
            ValueError: a non-loopback ``host`` without ``api_key`` or ``insecure_no_auth``.
        """
        check_bind(host, api_key, insecure_no_auth=insecure_no_auth, what="the weight server")
        self.api_key = api_key
        self.allow_pickle = allow_pickle
        self.max_request_bytes = int(max_request_mb * 2**20)
        self.receiver = receiver
        self.paused = False
        self.pause_calls: list[str] = []
        self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True
        bound_host, bound_port = self._httpd.server_address[:2]
        self.url = f"http://{bound_host!s}:{bound_port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> WeightServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def server_info(self) -> dict[str, Any]:
        """The ``/get_server_info`` answer: served dtype, TP size, current weight version."""
        formats = [SAFE_FORMAT, *([FLATTENED_BUCKET, None] if self.allow_pickle else [])]
        return {
            "dtype": str(self.receiver.dtype).removeprefix("torch."),
            "tp_size": 1,
            "weight_version": getattr(self.receiver, "weight_version", None),
            "weight_load_formats": formats,
        }

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """Answer one request; returns ``(status, json_body)``. Callable without HTTP."""
        if method == "GET" and path in ("/health", "/health_generate"):
            return HTTPStatus.OK, {}
        if method == "GET" and path in ("/get_server_info", "/server_info"):
            return HTTPStatus.OK, self.server_info()
        if method == "GET" and path in ("/get_model_info", "/model_info"):
            return HTTPStatus.OK, {"weight_version": self.server_info()["weight_version"]}
        if method != "POST":
            return HTTPStatus.NOT_FOUND, {"detail": f"no {method} {path}"}
        if not isinstance(body, dict):
            return HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": "the body must be a JSON object"}
        try:
            if path == "/update_weights_from_tensor":
                return self._update_from_tensor(body)
            if path == "/update_weights_from_disk":
                return self._update_from_disk(body)
            if path == "/weights_checksum":
                return self._checksum(body)
            if path == "/pause_generation":
                mode = body.get("mode", "abort")
                if mode not in ("abort", "retract", "in_place"):
                    raise _BadRequestError(f"mode must be abort, retract or in_place, got {mode!r}")
                self.pause_calls.append(mode)
                self.paused = True
                return HTTPStatus.OK, {}
            if path == "/continue_generation":
                self.paused = False
                return HTTPStatus.OK, {}
            if path == "/flush_cache":
                return HTTPStatus.OK, {}
        except _BadRequestError as e:
            return HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": str(e)}
        return HTTPStatus.NOT_FOUND, {"detail": f"no POST {path}"}

    def _update_from_tensor(self, body: dict[str, Any]) -> tuple[int, Any]:
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads:
            raise _BadRequestError("serialized_named_tensors must be a non-empty list")
        load_format = body.get("load_format")
        version = _opt_str(body.get("weight_version"))
        try:
            # One TP rank here: read entry 0, release the references the others would have used
            # (pickled payloads only: a safe payload's file belongs to its sender).
            if load_format != SAFE_FORMAT and self.allow_pickle:
                for extra in payloads[1:]:
                    discard_serialized(extra, load_format=load_format)
            named = deserialize_named_tensors(
                payloads[0], load_format=load_format, allow_pickle=self.allow_pickle
            )
            self.receiver.update_weights_from_tensor(
                named, weight_version=version, flush_cache=bool(body.get("flush_cache", True))
            )
        except ValueError as e:
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": str(e)}
        # ``named`` (views of the sender's shared memory) is dropped on return, before the answer.
        return HTTPStatus.OK, {"success": True, "message": "Success"}

    def _update_from_disk(self, body: dict[str, Any]) -> tuple[int, Any]:
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise _BadRequestError("model_path must be a non-empty string")
        version = _opt_str(body.get("weight_version"))
        try:
            named = [(n, _cast(t, self.receiver.dtype)) for n, t in iter_safetensors(model_path)]
            self.receiver.update_weights_from_tensor(
                named, weight_version=version, flush_cache=bool(body.get("flush_cache", True))
            )
        except ValueError as e:
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": str(e)}
        return HTTPStatus.OK, {"success": True, "message": "Success", "num_paused_requests": 0}

    def _checksum(self, body: dict[str, Any]) -> tuple[int, Any]:
        names = body.get("names")
        if names is not None and not (
            isinstance(names, list) and all(isinstance(n, str) for n in names)
        ):
            raise _BadRequestError("names must be a list of strings or null")
        try:
            return HTTPStatus.OK, self.receiver.weights_checksum(names)
        except ValueError as e:
            return HTTPStatus.BAD_REQUEST, {"success": False, "message": str(e)}


def _opt_str(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise _BadRequestError(f"weight_version must be a string or null, got {v!r}")
    return v


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A checkpoint on disk may be stored wider than served (SGLang casts on load as well).
    return t.to(dtype) if t.is_floating_point() else t


def _make_handler(server: WeightServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: tests and the example print their own reports

        def _answer(self, status: int, body: Any) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _allowed(self, method: str) -> bool:
            """The API key check, before anything else is read (401 otherwise)."""
            if server.api_key is None or (method == "GET" and self.path == "/health"):
                return True
            if bearer_ok(self.headers.get("Authorization"), server.api_key):
                return True
            self.close_connection = True  # the body (if any) is never read
            self._answer(
                HTTPStatus.UNAUTHORIZED,
                {"detail": "missing or wrong API key: send 'Authorization: Bearer <key>'"},
            )
            return False

        def do_GET(self) -> None:
            if self._allowed("GET"):
                self._answer(*server.handle("GET", self.path, None))

        def do_POST(self) -> None:
            if not self._allowed("POST"):
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= server.max_request_bytes:
                self.close_connection = True
                self._answer(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    {"detail": f"the body must be 0..{server.max_request_bytes} bytes"},
                )
                return
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw) if raw else {}
            except json.JSONDecodeError:
                self._answer(HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": "body is not JSON"})
                return
            self._answer(*server.handle("POST", self.path, body))

    return Handler
