"""Clients with one async interface for an SGLang server (HTTP) and an in-process Engine.

    async with SGLangClient("http://127.0.0.1:30000") as client:
        out = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=16))

``SGLangClient`` speaks SGLang's native HTTP API, so the same class talks to a real SGLang
server, to an sglang-router, and to ``miles_rollout.serve``. ``LocalEngineClient`` offers the
same methods on an in-process :class:`~miles_rollout.Engine` without HTTP.

Errors: bad input raises ``ValueError`` from both clients (HTTP 400 becomes ``ValueError``
carrying the server's message); any other HTTP failure raises :class:`SGLangHTTPError`.

Retries (``SGLangClient``): a connection error, a timeout or an HTTP 5xx (503 when an engine's
queue is full, 500/502 from a router whose worker died) is retried with exponential backoff,
honouring ``Retry-After``; a 4xx never is (the request itself is wrong). Idempotent calls retry
``retries`` times; ``generate`` retries ``generate_retries`` times (default 0: a retried
generate may run twice on the engine, which RL rollouts tolerate and other callers may not).
Through a router a retry may land on another engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import aiohttp

from miles_rollout.engine import Engine
from miles_rollout.outputs import FinishReason, GenerateOutput
from miles_rollout.sampling_params import SamplingParams
from miles_transfer.push import deserialize_named_tensors

__all__ = ["EngineClient", "LocalEngineClient", "SGLangClient", "SGLangHTTPError"]

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
MAX_BACKOFF_S = 10.0  # one wait between retries at most (Retry-After included)

logger = logging.getLogger(__name__)


class SGLangHTTPError(RuntimeError):
    """An HTTP error other than 400 (which raises ``ValueError``)."""

    def __init__(
        self, status: int, path: str, message: str, *, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"HTTP {status} from {path}: {message}")
        self.status = status
        self.path = path
        self.message = message
        self.retry_after_s = retry_after_s


@runtime_checkable
class EngineClient(Protocol):
    """The operations the rollout loop needs from an inference engine."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        routing_key: str | None = None,
    ) -> GenerateOutput: ...

    async def health(self) -> bool: ...

    async def get_model_info(self) -> dict[str, Any]: ...

    async def get_server_info(self) -> dict[str, Any]: ...

    async def get_weight_version(self) -> str: ...

    async def flush_cache(self) -> bool: ...

    async def pause_generation(self, mode: str = "retract") -> None: ...

    async def continue_generation(self) -> None: ...

    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None = None
    ) -> None: ...

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[Any],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None: ...

    async def update_weight_version(self, new_version: str) -> None: ...

    async def weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]: ...

    async def close(self) -> None: ...


def _params(sampling_params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    if isinstance(sampling_params, SamplingParams):
        return sampling_params
    return SamplingParams.from_dict(sampling_params)


class SGLangClient:
    """Async client for SGLang's native HTTP API (also for sglang-router and our server).

    Args:
        base_url: e.g. ``"http://127.0.0.1:30000"``.
        timeout: seconds for one attempt of a request (generation included); ``None`` waits
            forever.
        api_key: sent as ``Authorization: Bearer <api_key>``.
        headers: extra headers for every request.
        retries: how many times an idempotent call is retried after a connection error,
            a timeout or an HTTP 5xx (exponential backoff from ``backoff_s``). Weight updates
            are never retried: they could apply twice.
        backoff_s: the first retry delay (doubling, at most ``MAX_BACKOFF_S``; a server's
            ``Retry-After`` raises it).
        generate_retries: how many times ``generate`` is retried on the same failures
            (a timeout included); 0 never (see the module docstring).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | None = 600.0,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        retries: int = 3,
        backoff_s: float = 0.2,
        generate_retries: int = 0,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if generate_retries < 0:
            raise ValueError(f"generate_retries must be >= 0, got {generate_retries}")
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        self.generate_retries = generate_retries
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._headers = dict(headers or {})
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._retries = retries
        self._backoff_s = backoff_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        idempotent: bool,
        headers: Mapping[str, str] | None = None,
        expect_json: bool = True,
        retries: int | None = None,
    ) -> Any:
        if retries is None:
            retries = self._retries if idempotent else 0
        for attempt in range(retries + 1):
            try:
                return await self._attempt(method, path, body, headers, expect_json)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError, SGLangHTTPError) as exc:
                if not _retryable(exc) or attempt == retries:
                    raise
                delay = min(self._backoff_s * 2**attempt, MAX_BACKOFF_S)
                after = getattr(exc, "retry_after_s", None)
                if after is not None:
                    delay = min(max(delay, after), MAX_BACKOFF_S)
                logger.warning(
                    "%s %s%s failed (%s); retry %d of %d in %.1f s",
                    method,
                    self.base_url,
                    path,
                    _describe(exc),
                    attempt + 1,
                    retries,
                    delay,
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _attempt(
        self,
        method: str,
        path: str,
        body: Any,
        headers: Mapping[str, str] | None,
        expect_json: bool,
    ) -> Any:
        async with self._get_session().request(
            method, self.base_url + path, json=body, headers=headers
        ) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise _http_error(resp.status, path, raw, resp.headers.get("Retry-After"))
            if not expect_json:
                return raw.decode(errors="replace")
            return await resp.json(content_type=None) if raw.strip() else None

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        routing_key: str | None = None,
        data_parallel_rank: int | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateOutput:
        """``POST /generate`` for one prompt.

        Args:
            input_ids: the prompt tokens.
            sampling_params: a :class:`SamplingParams` or an SGLang-style dict.
            return_logprob: ask for output-token logprobs.
            rid: the request id (SGLang makes one if absent).
            routing_key: sent as ``X-SMG-Routing-Key`` (sglang-router session affinity; the
                miles-rollout server also keeps a session on one DP rank with it).
            data_parallel_rank: the DP rank to run on (SGLang's body field).
            return_routed_experts: MoE models: each token's expert ids (R3), decoded into
                ``GenerateOutput.routed_experts``.
        """
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": _params(sampling_params).to_dict(),
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        if data_parallel_rank is not None:
            body["data_parallel_rank"] = data_parallel_rank
        if return_routed_experts:
            body["return_routed_experts"] = True
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key is not None else None
        resp = await self._request(
            "POST",
            "/generate",
            body,
            idempotent=False,
            headers=headers,
            retries=self.generate_retries,
        )
        return parse_generate_response(resp, prompt_tokens=len(body["input_ids"]))

    async def health(self) -> bool:
        """``GET /health``: True on HTTP 200, False on 5xx or no connection (asked once: a
        probe reports the state now)."""
        try:
            await self._request("GET", "/health", idempotent=True, expect_json=False, retries=0)
        except (SGLangHTTPError, aiohttp.ClientError, asyncio.TimeoutError):
            return False
        return True

    async def get_model_info(self) -> dict[str, Any]:
        """``GET /get_model_info``."""
        return dict(await self._request("GET", "/get_model_info", idempotent=True))

    async def get_server_info(self) -> dict[str, Any]:
        """``GET /get_server_info``."""
        return dict(await self._request("GET", "/get_server_info", idempotent=True))

    async def get_weight_version(self) -> str:
        """``GET /get_weight_version``."""
        resp = await self._request("GET", "/get_weight_version", idempotent=True)
        return str(resp["weight_version"])

    async def flush_cache(self) -> bool:
        """``POST /flush_cache``; False when the server refuses (requests in flight)."""
        try:
            await self._request("POST", "/flush_cache", idempotent=True, expect_json=False)
        except ValueError:
            return False
        return True

    async def pause_generation(self, mode: str = "retract") -> None:
        """``POST /pause_generation`` with ``mode`` in abort | retract | in_place."""
        await self._request("POST", "/pause_generation", {"mode": mode}, idempotent=True)

    async def continue_generation(self) -> None:
        """``POST /continue_generation``."""
        await self._request("POST", "/continue_generation", {}, idempotent=True)

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """``POST /update_weights_from_disk``; raises ``ValueError`` if the server refuses.

        ``abort_all_requests`` is always sent: requests in flight continue unless asked.
        """
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = weight_version
        resp = await self._request("POST", "/update_weights_from_disk", body, idempotent=False)
        _check_success(resp, "/update_weights_from_disk")

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[Any],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        """``POST /update_weights_from_tensor`` (one payload per TP rank)."""
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        resp = await self._request("POST", "/update_weights_from_tensor", body, idempotent=False)
        _check_success(resp, "/update_weights_from_tensor")

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = False
    ) -> None:
        """``POST /update_weight_version``.

        ``abort_all_requests`` is always sent, because SGLang's own default is to abort every
        request in flight; Miles lets them finish unless asked.
        """
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        resp = await self._request("POST", "/update_weight_version", body, idempotent=True)
        _check_success(resp, "/update_weight_version")

    async def weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """``POST /weights_checksum`` (a Miles extension; SGLang itself lacks it).

        Raises:
            SGLangHTTPError: the server does not implement it (says so in the message).
        """
        body = {"names": None if names is None else list(names)}
        try:
            resp = await self._request("POST", "/weights_checksum", body, idempotent=True)
        except SGLangHTTPError as exc:
            if exc.status in (404, 405):
                raise SGLangHTTPError(
                    exc.status,
                    exc.path,
                    "the server has no /weights_checksum endpoint: it is not a miles-rollout "
                    "server (a plain SGLang server lacks this Miles extension)",
                ) from exc
            raise
        return {str(k): str(v) for k, v in resp.items()}


def _retryable(exc: BaseException) -> bool:
    """Connection errors, timeouts and 5xx: the server (or the way to it) failed, not the
    request. A 4xx is the request's own fault and fails the same way again."""
    if isinstance(exc, SGLangHTTPError):
        return exc.status >= 500
    return isinstance(exc, aiohttp.ClientConnectionError | asyncio.TimeoutError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (the delta-seconds form; an HTTP date is ignored)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def _http_error(status: int, path: str, raw: bytes, retry_after: str | None = None) -> Exception:
    text = raw.decode(errors="replace")
    message = text
    try:
        import json

        data = json.loads(text)
        if isinstance(data, dict):
            err = data.get("error")
            if isinstance(err, dict) and "message" in err:
                message = str(err["message"])
            elif "message" in data:
                message = str(data["message"])
            elif isinstance(data.get("detail"), str):
                message = data["detail"]
    except ValueError:
        pass
    if status == 400:
        return ValueError(message)
    return SGLangHTTPError(status, path, message, retry_after_s=_retry_after(retry_after))


def _check_success(resp: Any, path: str) -> None:
    if isinstance(resp, dict) and resp.get("success") is False:
        raise ValueError(str(resp.get("message", f"{path} failed")))


def parse_generate_response(resp: Mapping[str, Any], *, prompt_tokens: int) -> GenerateOutput:
    """Turn one SGLang ``/generate`` response into a :class:`GenerateOutput`."""
    meta = resp.get("meta_info", {})
    output_ids = [int(t) for t in resp.get("output_ids", [])]
    logprobs = None
    if meta.get("output_token_logprobs") is not None:
        logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
    weight_version = str(meta.get("weight_version", ""))
    per_token = meta.get("output_token_weight_versions")
    if per_token is not None and len(per_token) == len(output_ids):
        versions = [str(v) for v in per_token]
    else:  # a stock SGLang server reports one version for the whole request
        versions = [weight_version] * len(output_ids)
    return GenerateOutput(
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=FinishReason.from_json(meta.get("finish_reason")),
        weight_version=weight_version,
        prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens)),
        completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
        rid=str(meta.get("id", "")),
        text=resp.get("text"),
        output_weight_versions=versions,
        cached_tokens=int(meta.get("cached_tokens") or 0),
        routed_experts=_routed_experts(meta, len(output_ids)),
    )


def _routed_experts(meta: Mapping[str, Any], n_out: int) -> Any:
    """SGLang's base64 ``routed_experts`` as an int32 tensor: ``[tokens, layers, top_k]``
    when the server says the shape (ours does), else ``[tokens, layers * top_k]``."""
    payload = meta.get("routed_experts")
    if payload is None:
        return None
    from miles_rollout._http_generate import decode_routed_experts

    shape = meta.get("routed_experts_shape")
    if shape is None:
        tokens = int(meta.get("prompt_tokens", 0)) + n_out - 1
        shape = [tokens, -1]
    return decode_routed_experts(payload, shape)


class LocalEngineClient:
    """The :class:`EngineClient` methods on an in-process :class:`Engine` (no HTTP).

    Blocking engine calls run in the event loop's default executor. ``routing_key`` keeps a
    session on one of the engine's DP ranks. The client does not own the engine:
    :meth:`close` leaves it running.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def __aenter__(self) -> LocalEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Nothing to release."""

    async def _run(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        routing_key: str | None = None,
        data_parallel_rank: int | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateOutput:
        """Generate on the engine (see :meth:`SGLangClient.generate`)."""
        return await self.engine.async_generate(
            input_ids,
            _params(sampling_params),
            return_logprob=return_logprob,
            rid=rid,
            data_parallel_rank=data_parallel_rank,
            routing_key=routing_key,
            return_routed_experts=return_routed_experts,
        )

    async def health(self) -> bool:
        """Whether the engine thread runs."""
        return self.engine.health()

    async def get_model_info(self) -> dict[str, Any]:
        """The engine's model info (the ``/get_model_info`` fields)."""
        return self.engine.model_info()

    async def get_server_info(self) -> dict[str, Any]:
        """The engine's server info (the ``/get_server_info`` fields)."""
        return self.engine.server_info()

    async def get_weight_version(self) -> str:
        """The engine's weight version."""
        return self.engine.weight_version

    async def flush_cache(self) -> bool:
        """See :meth:`Engine.flush_cache`."""
        return bool(await self._run(self.engine.flush_cache))

    async def pause_generation(self, mode: str = "retract") -> None:
        """See :meth:`Engine.pause_generation`."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"mode must be one of abort, retract, in_place; got {mode!r}")
        await self._run(lambda: self.engine.pause_generation(mode))

    async def continue_generation(self) -> None:
        """See :meth:`Engine.continue_generation`."""
        await self._run(self.engine.continue_generation)

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """See :meth:`Engine.update_weights_from_disk`."""
        await self._run(
            lambda: self.engine.update_weights_from_disk(
                model_path, weight_version=weight_version, abort_all_requests=abort_all_requests
            )
        )

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[Any],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        """Decode payloads as the server does, then :meth:`Engine.update_weights_from_tensor`."""
        decoded = [
            deserialize_named_tensors(p, load_format=load_format) for p in serialized_named_tensors
        ]
        if len(decoded) != 1:
            raise ValueError(f"got {len(decoded)} payloads; the engine has tp_size 1")
        named = decoded[0]
        await self._run(
            lambda: self.engine.update_weights_from_tensor(
                named,
                weight_version=weight_version,
                flush_cache=flush_cache,
                abort_all_requests=abort_all_requests,
            )
        )

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = False
    ) -> None:
        """See :meth:`Engine.update_weight_version`."""
        await self._run(
            lambda: self.engine.update_weight_version(
                new_version, abort_all_requests=abort_all_requests
            )
        )

    async def weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """See :meth:`Engine.weights_checksum`."""
        return dict(await self._run(lambda: self.engine.weights_checksum(names)))
