"""A ``WeightReceiver`` for a server that speaks SGLang's HTTP API, using only ``urllib``.

Endpoints used (SGLang 0.5.x ``http_server.py``): ``GET /get_server_info`` (``dtype``,
``tp_size``), ``POST /update_weights_from_tensor``, ``POST /update_weights_from_disk``,
``POST /pause_generation`` ``{"mode"}``, ``POST /continue_generation``. Update endpoints answer
``{"success": bool, "message": str}`` with HTTP 200, or 400 on failure.

Plus one Miles extension that stock SGLang does not have: ``POST /weights_checksum``
``{"names": [...] | null}`` answering ``{name: tensor_digest}`` (every weight for ``null``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from miles_transfer.push.safe_wire import SAFE_FORMAT
from miles_transfer.push.wire import FLATTENED_BUCKET as FLATTENED
from miles_transfer.push.wire import discard_serialized, serialize_named_tensors

__all__ = ["HTTPReceiver", "ReceiverError", "parse_dtype"]

PAUSE_MODES = ("abort", "retract", "in_place")
_DTYPE_ALIASES = {"half": torch.float16, "float": torch.float32, "bf16": torch.bfloat16}


class ReceiverError(RuntimeError):
    """The server refused or failed a request (its message is included)."""


def parse_dtype(name: str) -> torch.dtype:
    """Map a dtype name as servers and configs spell it (``"bfloat16"``, ``"torch.float16"``).

    Raises:
        ValueError: not a torch dtype name.
    """
    key = name.removeprefix("torch.")
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    found = getattr(torch, key, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name")
    return found


class HTTPReceiver:
    """Send weights to an SGLang(-compatible) server over HTTP.

    Tensors travel in shared memory (a safetensors file for Miles' servers, SGLang's pickled
    handles to shared memory or CUDA IPC for SGLang), never as bytes in the request, so **the
    sender and the server must be on the same host** (and, on GPU, see the same devices). See
    ``serialize_named_tensors`` for the shared-memory lifetime rules.

    Proxies from the environment are ignored: engines are addressed directly.

    Attributes:
        base_url: e.g. ``"http://127.0.0.1:30000"``.
        dtype: the precision the server serves.
        tp_size: how many TP ranks read each payload.
        load_format: ``"miles_safetensors"`` (Miles' servers: no pickle), ``"flattened_bucket"``
            (SGLang: one shared buffer per bucket) or ``None``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        dtype: torch.dtype | str | None = None,
        tp_size: int | None = None,
        load_format: str | None = "auto",
        timeout: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        """Create a receiver; reads ``/get_server_info`` once unless ``dtype`` and ``tp_size``
        are both given.

        Args:
            base_url: the server's base URL.
            dtype: the served precision; read from the server's ``dtype`` when ``None``.
            tp_size: TP ranks behind the server; read from ``tp_size`` (default 1) when ``None``.
            load_format: the ``load_format`` sent with every update; ``"auto"``: what the
                server lists in ``weight_load_formats`` (``miles_safetensors`` on Miles'
                servers), else SGLang's ``flattened_bucket``.
            timeout: seconds to wait for any one request.
            api_key: sent as ``Authorization: Bearer`` if given.

        Raises:
            ValueError: the server reports ``dtype="auto"`` or none (pass ``dtype=``), or a bad
                argument.
            ReceiverError: the server cannot be reached.
        """
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._api_key = api_key
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        info: dict[str, Any] = {}
        if dtype is None or tp_size is None:
            info = self._request("GET", "/get_server_info")
        if load_format == "auto" and info:
            load_format = _pick_format(info)
        self._load_format = load_format  # "auto" (no server info yet): resolved at first update
        if dtype is None:
            served = info.get("dtype")
            if not isinstance(served, str) or served == "auto":
                raise ValueError(
                    f"{self.base_url} reports dtype={served!r}; pass dtype= (the precision the "
                    f"engine really serves, e.g. torch.bfloat16)"
                )
            dtype = served
        self.dtype: torch.dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        self.tp_size = int(tp_size if tp_size is not None else info.get("tp_size", 1))
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")

    @property
    def load_format(self) -> str | None:
        """The ``load_format`` of every update (``"auto"`` asks the server once)."""
        if self._load_format == "auto":
            self._load_format = _pick_format(self._request("GET", "/get_server_info"))
        return self._load_format

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self._api_key:
            req.add_header("Authorization", f"Bearer {self._api_key}")
        where = f"{method} {self.base_url}{path}"
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise _StatusError(e.code, f"{where} -> HTTP {e.code}: {detail}") from None
        except urllib.error.URLError as e:
            refused = isinstance(e.reason, (ConnectionRefusedError, socket.gaierror))
            raise _StatusError(None if refused else 0, f"{where} failed: {e.reason}") from e
        except OSError as e:  # a timeout or reset after the request went out
            raise _StatusError(0, f"{where} failed: {e}") from e
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise ReceiverError(f"{where}: the answer is not JSON: {raw[:200]!r}") from e

    def _post_update(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        out = self._request("POST", path, body)
        if not isinstance(out, dict) or out.get("success") is not True:
            raise ReceiverError(f"POST {self.base_url}{path} failed: {out}")
        return out

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """POST one bucket to ``/update_weights_from_tensor`` (same payload for every TP rank).

        When the server surely did not read the payload (connection refused, or an HTTP status
        other than 200/400, i.e. rejected before the handler), its shared memory is released
        here. After a timeout it is not (the server may still read it): the file then stays
        until this process's ``torch_shm_manager`` exits.

        Raises:
            ReceiverError: the server failed or refused the update.
        """
        payload = serialize_named_tensors(
            named_tensors, load_format=self.load_format, consumers=self.tp_size
        )
        body = {
            "serialized_named_tensors": [payload] * self.tp_size,
            "load_format": self.load_format,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        try:
            self._post_update("/update_weights_from_tensor", body)
        except _StatusError as e:
            # 400 is the handler's own "success: false" (it read the payload); 0 is unknown.
            if e.status not in (0, 400) and self.load_format != SAFE_FORMAT:
                discard_serialized(payload, load_format=self.load_format, consumers=self.tp_size)
            raise
        finally:
            if self.load_format == SAFE_FORMAT:  # the sender owns the file: read or not
                discard_serialized(payload, load_format=SAFE_FORMAT)

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Ask the server for ``{name: tensor_digest}`` via the Miles ``/weights_checksum``.

        Raises:
            ReceiverError: the server lacks the endpoint (stock SGLang: push with
                ``verify=False``) or failed.
        """
        body = {"names": None if names is None else list(names)}
        try:
            out = self._request("POST", "/weights_checksum", body)
        except _StatusError as e:
            if e.status in (404, 405):
                raise ReceiverError(
                    f"{self.base_url} has no /weights_checksum: it is a Miles extension that "
                    f"stock SGLang lacks. Push with verify=False, or serve the engine with Miles."
                ) from None
            raise
        if not isinstance(out, dict) or not all(isinstance(v, str) for v in out.values()):
            raise ReceiverError(
                f"/weights_checksum answered {str(out)[:200]}, not {{name: digest}}"
            )
        return out

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        load_format: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Ask the server to reload its weights from an HF checkpoint directory on its disk.

        Args:
            model_path: the directory as the server sees it.
            weight_version: the version served afterwards.
            load_format: SGLang's load format (``None``: its default).
            abort_all_requests: abort in-flight requests first.
            flush_cache: drop the KV/prefix cache afterwards (newer SGLang; older ignore it).

        Returns:
            The server's answer (``success``, ``message``, ``num_paused_requests``).

        Raises:
            ReceiverError: the reload failed.
        """
        body = {
            "model_path": model_path,
            "load_format": load_format,
            "abort_all_requests": abort_all_requests,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }
        return self._post_update("/update_weights_from_disk", body)

    def pause_generation(self, mode: str = "retract") -> None:
        """``POST /pause_generation {"mode": mode}``; mode is abort, retract or in_place."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        """``POST /continue_generation``."""
        self._request("POST", "/continue_generation", {})

    @contextlib.contextmanager
    def paused(self, mode: str = "retract") -> Iterator[None]:
        """Pause generation for the duration of the block (wrap the whole push in it).

        Generation is continued on exit even if the block raised.
        """
        self.pause_generation(mode)
        try:
            yield
        finally:
            self.continue_generation()


def _pick_format(info: Any) -> str:
    """Miles' safe format where the server offers it, else SGLang's ``flattened_bucket``."""
    offered = info.get("weight_load_formats") if isinstance(info, dict) else None
    return SAFE_FORMAT if isinstance(offered, list) and SAFE_FORMAT in offered else FLATTENED


class _StatusError(ReceiverError):
    """A request that got no usable answer: ``status`` is the HTTP status, ``0`` when the request
    went out but no answer came (timeout, reset), ``None`` when it never reached the server."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status
