"""The continuous-batching loop: one thread owns the model, the KV cache and every request.

Other threads talk to it only through :meth:`Scheduler.add` (a new request) and
:meth:`Scheduler.call` (run a function on the scheduler thread between two steps: pause,
weight updates, checksums). Each iteration admits waiting requests (one batched prefill),
then runs one decode step over every running request; finished requests leave the batch at
once and their cache rows are refilled by compaction.

With a prefix cache (``_prefix_cache.py``), admission copies the longest cached prefix of each
request into its row and prefills only the rest; a request that finishes, is aborted or is
retracted leaves its KV in the cache. KV computed before a weight update never enters the
cache after it: each request remembers the cache epoch it was admitted in.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from miles_rollout._model import CausalLMRunner
from miles_rollout._prefix_cache import RadixCache
from miles_rollout._sampling import BatchSampler, uniform
from miles_rollout.outputs import FinishReason, GenerateOutput
from miles_rollout.sampling_params import SamplingParams

__all__ = ["PauseMode", "Request", "Scheduler"]

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
T = TypeVar("T")

# Upper bound on padded prompt tokens in one prefill forward (bounds activation memory).
_PREFILL_TOKEN_BUDGET = 8192
# A prefill chunk's padded size may exceed its real token count by at most this factor.
_MAX_PAD_RATIO = 1.25


@dataclass(eq=False, slots=True)
class Request:
    """One request's state. Owned by the scheduler thread after :meth:`Scheduler.add`."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    return_logprob: bool
    max_new_tokens: int
    stop_ids: frozenset[int]
    seed: int
    future: Future[GenerateOutput]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # The engine's weight version when each output token was sampled.
    output_weight_versions: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    session: str | None = None  # the routing key (X-SMG-Routing-Key) of its session
    return_routed_experts: bool = False
    routed: torch.Tensor | None = None  # its rows' expert ids when it last left the batch
    admitted: bool = False  # prefilled at least once (cached_tokens is counted then)
    prefix_hit: int = 0  # tokens copied from the prefix cache at its latest admission
    cache_epoch: int = -1  # the prefix cache's epoch when its KV was (re)computed


@dataclass(eq=False, slots=True)
class _Call:
    fn: Callable[[], Any]
    future: Future[Any]


class Scheduler:
    """Runs requests on a :class:`CausalLMRunner` in a background thread."""

    def __init__(
        self,
        runner: CausalLMRunner,
        *,
        max_running: int,
        tokenizer: Any,
        weight_version: Callable[[], str],
        num_threads: int | None = None,
        prefix_cache: RadixCache | None = None,
        reserve_sessions: bool = False,
        name: str = "miles-engine",
    ) -> None:
        self.runner = runner
        self.cache = prefix_cache
        self.reserve_sessions = reserve_sessions and prefix_cache is not None
        self._cache_epoch = 0
        self._num_threads = num_threads
        self.max_running = max_running
        self.tokenizer = tokenizer
        self._weight_version = weight_version
        self._inbox: queue.SimpleQueue[Request | _Call | None] = queue.SimpleQueue()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admitting: list[Request] = []  # popped from waiting, prefill in progress
        self.paused = False
        self.generated_tokens = 0  # cumulative, for metrics
        self.prefill_tokens = 0  # cumulative unique (unpadded) prompt tokens run through prefill
        self.prompt_tokens = 0  # cumulative prompt tokens of admitted requests (first admission)
        self.cached_prompt_tokens = 0  # of which served from the prefix cache
        self._stopping = False
        self._closed = False
        self._inbox_lock = threading.Lock()
        self._sampler: BatchSampler | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        # torch.set_num_threads sets the calling thread's OpenMP team size (thread-local) and
        # also process-wide defaults (the value new threads start from, MKL's count). The
        # engine thread sets its own size first; the caller then puts the process-wide values
        # back, so the rest of the process (a trainer in the same process) keeps its threads
        # while the engine decodes on ``num_threads``.
        before = torch.get_num_threads()
        self._threads_set = threading.Event()
        self._thread.start()
        self._threads_set.wait()
        if num_threads is not None:
            torch.set_num_threads(before)

    # ---- API for other threads ---------------------------------------------------------------

    def _put(self, msg: Request | _Call) -> None:
        # The lock orders every message before the shutdown sentinel, so none is left behind.
        with self._inbox_lock:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            self._inbox.put(msg)

    def add(self, req: Request) -> None:
        """Queue a validated request.

        Raises:
            RuntimeError: the engine is shut down.
        """
        self._put(req)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the scheduler thread between two steps and return its result."""
        assert threading.current_thread() is not self._thread, "call() from the engine thread"
        return self.post(fn).result()

    def post(self, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn`` for the scheduler thread (between two steps); return its future."""
        fut: Future[T] = Future()
        self._put(_Call(fn, fut))
        return fut

    def stop(self) -> None:
        """Abort every request and end the thread (idempotent)."""
        with self._inbox_lock:
            if not self._closed:
                self._closed = True
                self._inbox.put(None)
        self._thread.join()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ---- operations (run on the scheduler thread through call()) ----------------------------

    def pause(self, mode: PauseMode) -> None:
        """Stop stepping. ``abort`` ends every request, ``retract`` frees the batch."""
        self.paused = True
        if mode == "abort":
            self.abort_all("aborted by pause_generation(mode='abort')")
        elif mode == "retract":
            # Retracted requests keep their output and are re-prefilled (prompt + output) on
            # continue; they go back to the front of the queue in their current order. Their
            # KV goes to the prefix cache, so the re-prefill is mostly a copy.
            for row, req in enumerate(self.running):
                self._leaving(req, row)
            self.waiting.extendleft(reversed(self.running))
            self.running = []
            self._sampler = None

    def abort_all(self, message: str, *, cache: bool = True) -> int:
        """Finish every running and waiting request with finish reason ``abort``."""
        if cache:
            for row, req in enumerate(self.running):
                self._leaving(req, row)
        reqs = [*self.running, *self.waiting]
        self.running, self._sampler = [], None
        self.waiting.clear()
        for req in reqs:
            self._finish(req, FinishReason(type="abort", message=message))
        return len(reqs)

    def abort(self, rid: str) -> bool:
        """Abort one request by id; return whether it was found."""
        for i, req in enumerate(self.running):
            if req.rid == rid:
                self._leaving(req, i)
                self._remove_rows([i])
                self._finish(req, FinishReason(type="abort", message="aborted by request"))
                return True
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, FinishReason(type="abort", message="aborted by request"))
                return True
        return False

    def flush_cache(self) -> bool:
        """Drop the prefix cache and free KV memory when idle (SGLang refuses while requests
        are in flight)."""
        if self.running or self.waiting:
            return False
        self.invalidate_cache()
        self.runner.release()
        return True

    def invalidate_cache(self) -> None:
        """Drop the prefix cache now (after a weight update): requests in flight keep their
        rows, but their KV (computed partly with the old weights) is never cached."""
        self._cache_epoch += 1
        if self.cache is not None:
            self.cache.flush()
        self.runner.release_pool()

    def _leaving(self, req: Request, row: int) -> None:
        """``req`` leaves cache row ``row`` (finished, aborted or retracted): keep its routed
        experts if asked for, and put its KV into the prefix cache."""
        if req.return_routed_experts and req.output_ids:
            req.routed = self.runner.routes(row, len(req.prompt) + len(req.output_ids) - 1)
        self._cache_store(req, row)

    def _cache_store(self, req: Request, row: int) -> None:
        """Put the KV of ``req`` (in cache row ``row``) into the prefix cache."""
        if self.cache is None or req.cache_epoch != self._cache_epoch or not req.output_ids:
            return
        # The last sampled token was never fed to the model: its KV does not exist yet.
        tokens = [*req.prompt, *req.output_ids[:-1]]
        session = req.session if self.reserve_sessions else None
        self.cache.insert(
            tokens,
            lambda start, slots: self.runner.save_to_pool(row, start, slots),
            session=session,
        )
        if session is not None:
            # Room for the next turn: about what this turn added to the cached history.
            self.cache.reserve(session, tokens, growth=len(tokens) - req.prefix_hit)

    # ---- the loop ----------------------------------------------------------------------------

    def _main(self) -> None:
        if self._num_threads is not None:
            # The first torch.get_num_threads() in a thread initialises its team size from
            # the process-wide value; do that before setting ours, or the first parallel op
            # would re-initialise it from the value the caller puts back.
            torch.get_num_threads()
            torch.set_num_threads(self._num_threads)
        self._threads_set.set()
        with torch.inference_mode():
            while not self._stopping:
                try:
                    self._drain(block=self.paused or not (self.running or self.waiting))
                    if self._stopping or self.paused:
                        continue
                    self._drop_cancelled()
                    self._admit()
                    if self.running:
                        self._decode_step()
                except Exception as exc:  # a bug or resource error: fail in-flight requests
                    logger.exception("engine step failed; failing in-flight requests")
                    if self.cache is not None:  # a copy may have stopped half way
                        self.invalidate_cache()
                    reqs = [*self.running, *self._admitting, *self.waiting]
                    self.running, self._admitting, self._sampler = [], [], None
                    self.waiting.clear()
                    for req in reqs:
                        if not req.future.done():
                            req.future.set_exception(exc)
            self.abort_all("the engine was shut down", cache=False)
            # stop() closed the inbox before queueing the sentinel, so nothing follows it.
            assert self._inbox.empty()

    def _drain(self, *, block: bool) -> None:
        while True:
            try:
                msg = self._inbox.get(timeout=None) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if msg is None:
                self._stopping = True
                return
            if isinstance(msg, Request):
                if msg.max_new_tokens == 0:
                    self._finish(msg, FinishReason(type="length", length=0))
                else:
                    self.waiting.append(msg)
                continue
            try:
                result = msg.fn()
            except BaseException as exc:
                msg.future.set_exception(exc)
            else:
                msg.future.set_result(result)

    def _drop_cancelled(self) -> None:
        gone = [i for i, r in enumerate(self.running) if r.future.cancelled()]
        if gone:
            self._remove_rows(gone)
        if any(r.future.cancelled() for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.future.cancelled())

    def _admit(self) -> None:
        """Prefill waiting requests into free rows, each distinct token sequence only once.

        Identical sequences are common in RL (n samples of one prompt): the duplicates get a
        copy of the first one's KV rows and logits instead of their own prefill.
        """
        free = self.max_running - len(self.running)
        if not self.waiting or free <= 0:
            return
        firsts: list[Request] = []
        dups: list[tuple[Request, int]] = []  # (request, index of its first in firsts)
        seen: dict[tuple[int, ...], int] = {}
        width = 0
        while self.waiting and len(firsts) + len(dups) < free:
            req = self.waiting[0]
            key = (*req.prompt, *req.output_ids)
            j = seen.get(key)
            if j is not None:
                dups.append((self.waiting.popleft(), j))
                continue
            if firsts and max(width, len(key)) * (len(firsts) + 1) > _PREFILL_TOKEN_BUDGET:
                break
            width = max(width, len(key))
            seen[key] = len(firsts)
            firsts.append(self.waiting.popleft())
        # Off the queue but not yet running: a failed prefill must still fail these futures.
        self._admitting = firsts + [r for r, _ in dups]
        seqs_all = [r.prompt + r.output_ids for r in firsts]
        hits = [self._match(seq) for seq in seqs_all]
        for req, (n, _) in zip(firsts, hits):
            self._count_admission(req, n)
        for req, j in dups:
            self._count_admission(req, hits[j][0])
        # Shortest first, cut into chunks whose right-padding stays small: prefill is
        # compute-bound, so padded positions cost as much as real ones.
        order = sorted(range(len(firsts)), key=lambda i: len(seqs_all[i]) - hits[i][0])
        rank = {old: new for new, old in enumerate(order)}
        firsts = [firsts[i] for i in order]
        seqs = [seqs_all[i] for i in order]
        starts = [hits[i][0] for i in order]
        first_row = len(self.running)
        for i in order:
            n, slots = hits[i]
            if n:
                self.runner.load_from_pool(first_row + rank[i], slots)
        news = [len(s) - st for s, st in zip(seqs, starts)]
        self.prefill_tokens += sum(news)
        parts: list[torch.Tensor] = []
        start = 0
        while start < len(seqs):
            end, real = start + 1, news[start]
            while end < len(seqs) and news[end] * (end - start + 1) <= _MAX_PAD_RATIO * (
                real + news[end]
            ):
                real += news[end]
                end += 1
            parts.append(self.runner.prefill(first_row + start, seqs[start:end], starts[start:end]))
            start = end
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        if dups:
            src = [rank[j] for _, j in dups]
            dup_row = first_row + len(firsts)
            self.runner.ensure_capacity(dup_row + len(dups), width)
            self.runner.copy_rows(
                list(range(dup_row, dup_row + len(dups))), [first_row + j for j in src], width
            )
            logits = torch.cat([logits, logits[torch.tensor(src)]])
        batch = firsts + [r for r, _ in dups]
        for req in batch:
            req.cache_epoch = self._cache_epoch
        self.running.extend(batch)
        self._admitting = []
        self._sampler = None
        self._sample_and_finish(logits, rows=range(first_row, first_row + len(batch)))

    def _match(self, seq: list[int]) -> tuple[int, torch.Tensor]:
        """The cached prefix of ``seq`` to reuse; the last token is always recomputed (its
        logits start the request)."""
        if self.cache is None:
            return 0, torch.empty(0, dtype=torch.int64)
        return self.cache.match(seq[: len(seq) - 1])

    def _count_admission(self, req: Request, hit: int) -> None:
        req.prefix_hit = hit
        if self.cache is not None and req.session is not None:
            self.cache.touch(req.session)
        if req.admitted:  # a retracted request: counted at its first admission (as SGLang)
            return
        req.admitted = True
        req.cached_tokens = hit
        self.cached_prompt_tokens += hit
        self.prompt_tokens += len(req.prompt)

    def _decode_step(self) -> None:
        reqs = self.running
        positions = [len(r.prompt) + len(r.output_ids) - 1 for r in reqs]
        tokens = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long)
        logits = self.runner.decode(tokens, torch.tensor(positions), max(positions) + 1)
        self._sample_and_finish(logits, rows=range(len(reqs)))

    def _sample_and_finish(self, logits: torch.Tensor, rows: range) -> None:
        reqs = self.running[rows.start : rows.stop]
        if rows.start == 0 and rows.stop == len(self.running):
            if self._sampler is None:
                self._sampler = BatchSampler([r.params for r in reqs], self.runner.vocab_size)
            sampler = self._sampler
        else:
            sampler = BatchSampler([r.params for r in reqs], self.runner.vocab_size)
        uniforms = [uniform(r.seed, len(r.output_ids)) for r in reqs]
        tok_t, lp_t = sampler.sample(logits, uniforms)
        self.generated_tokens += len(reqs)
        version = self._weight_version()
        finished: list[tuple[int, FinishReason]] = []
        for i, req, tok, lp in zip(rows, reqs, tok_t.tolist(), lp_t.tolist()):
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            req.output_weight_versions.append(version)
            reason = self._check_finished(req, tok)
            if reason is not None:
                finished.append((i, reason))
        if finished:
            for i, _ in finished:
                self._leaving(reqs[i - rows.start], i)
            self._remove_rows([i for i, _ in finished])
            for i, reason in finished:
                # _remove_rows reorders self.running, so look requests up before it: they are
                # the ones captured in ``reqs``.
                self._finish(reqs[i - rows.start], reason)

    def _check_finished(self, req: Request, tok: int) -> FinishReason | None:
        # SGLang's order: the length limit first, then stop tokens, then stop strings.
        n_out = len(req.output_ids)
        if n_out >= req.max_new_tokens:
            return FinishReason(type="length", length=n_out)
        if tok in req.stop_ids:
            return FinishReason(type="stop", matched=tok)
        if req.params.stop:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
            for s in req.params.stop:
                if s in text:
                    return FinishReason(type="stop", matched=s)
        return None

    def _remove_rows(self, rows: list[int]) -> None:
        """Drop rows from the running batch, moving tail rows into the holes."""
        gone = set(rows)
        n_keep = len(self.running) - len(gone)
        holes = [i for i in range(n_keep) if i in gone]
        movers = [i for i in range(n_keep, len(self.running)) if i not in gone]
        assert len(holes) == len(movers)
        if movers:
            longest = max(
                len(self.running[m].prompt) + len(self.running[m].output_ids) for m in movers
            )
            self.runner.copy_rows(holes, movers, longest)
        new = self.running[:n_keep]
        for h, m in zip(holes, movers):
            new[h] = self.running[m]
        self.running = new
        self._sampler = None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.future.done():  # cancelled by its caller
            return
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
            if reason.type == "stop" and isinstance(reason.matched, str):
                text = text[: text.find(reason.matched)] if reason.matched in text else text
        out = GenerateOutput(
            output_ids=list(req.output_ids),
            output_logprobs=list(req.output_logprobs) if req.return_logprob else None,
            finish_reason=reason,
            weight_version=self._weight_version(),
            prompt_tokens=len(req.prompt),
            completion_tokens=len(req.output_ids),
            rid=req.rid,
            text=text,
            output_weight_versions=list(req.output_weight_versions),
            cached_tokens=req.cached_tokens,
            routed_experts=req.routed,
        )
        with contextlib.suppress(InvalidStateError):  # cancelled since the check above
            req.future.set_result(out)
