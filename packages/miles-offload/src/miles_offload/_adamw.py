"""`AdamW` with its state (fp32 master weights, exp_avg, exp_avg_sq) offloaded per bucket."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from miles_offload._format import header_bytes
from miles_offload._layout import Bucket, layout_digest, partition
from miles_offload._math import CHUNK, adamw_segment
from miles_offload._store import CpuStore, NvmeStore

__all__ = ["OFFLOAD_TARGETS", "AdamW"]

OFFLOAD_TARGETS = ("cpu", "nvme")
_MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_HYPER = ("lr", "betas", "eps", "weight_decay", "maximize")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _is_dtensor(t: torch.Tensor) -> bool:
    return callable(getattr(t, "to_local", None)) and hasattr(t, "device_mesh")


class AdamW(Optimizer):
    """AdamW whose optimizer state lives in CPU memory or in files, one bucket at a time.

    The update is `torch.optim.AdamW`'s single-tensor implementation (``foreach=False``,
    ``fused=False``, ``capturable=False``, ``amsgrad=False``), applied with the same torch ops
    in the same order to fp32 master weights: with fp32 parameters the parameters and the
    whole state equal torch's bit for bit after any number of steps. Parameters of other
    dtypes (bf16 weights) are updated from their fp32 master copy and receive its cast.

    The parameters (their local shards, for FSDP2 DTensor parameters) are cut into buckets of
    about ``bucket_mb`` MiB of state. ``offload="cpu"`` keeps every bucket in CPU memory
    (pinned when CUDA is available). ``offload="nvme"`` keeps each bucket in files under
    ``path`` and streams them through three resident buffers: while bucket i is updated,
    bucket i+1 is read and bucket i-1 written (io_uring, O_DIRECT). Each file has a header
    with the layout, steps and CRC-32C checksums, and a crash during `step` leaves the
    previous step's state committed (two slots per bucket and an atomically replaced
    manifest).

    `state_dict` returns torch's AdamW format (``step``, ``exp_avg``, ``exp_avg_sq`` per
    parameter, DTensors for DTensor parameters, plus ``master`` for non-fp32 parameters), so
    state moves between this optimizer, other bucket sizes and `torch.optim.AdamW`.

    Args:
        params: parameters or param groups (contiguous tensors, or DTensors with contiguous
            local shards); every parameter belongs to exactly one group.
        lr: learning rate (a float), >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled weight decay, >= 0.
        maximize: maximize the objective instead of minimizing it.
        offload: "cpu" or "nvme".
        path: directory of the bucket files (``offload="nvme"``); give each rank its own.
        bucket_mb: state MiB per bucket (master + both moments), > 0. With "nvme", peak
            resident state is three buckets, and the first read and the last write of a step
            are not overlapped, so more buckets pipeline better (docs/benchmarks.md: 17
            buckets of 64 MiB ran at 0.83-1.22x of the I/O bound, 9 of 128 MiB at 0.56x in
            an earlier, busier run).
        moment_dtype: "float32" (exact) or "bfloat16" (moments stored in bf16, updated in
            fp32: 8 instead of 12 bytes per parameter; not bit-equal to torch).
        resume: with "nvme", continue from the state committed in ``path`` (same parameters,
            bucket_mb and moment_dtype); the parameters receive the master weights. Every
            bucket is verified as it is read: on `CorruptStateError` the parameters of the
            buckets read before the damaged one already hold their masters, so reload the
            model's weights together with the optimizer state.
        overwrite: with "nvme" and ``resume=False``, start fresh even though ``path`` holds
            committed state (replaced at the first commit). Without it that is an error:
            starting over must be asked for (or the directory deleted).
        queue_depth: I/O requests in flight per transfer (nvme).
        block_size_kb: KiB per I/O request, a multiple of 4 (nvme).
        io_backend: "auto", "io_uring", "threads" or "python" (see `miles_offload.Pager`).
        durable: fdatasync files and the manifest at every step (nvme); False trades power-
            loss safety for speed (a crashed process still leaves consistent state).

    Raises:
        ValueError: a bad hyperparameter or option (the message says which and why),
            ``resume`` without state in ``path`` or with state of another layout, or committed
            state in ``path`` without ``resume`` or ``overwrite``.
        CorruptStateError: ``resume`` found damaged state (the message names the file).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        offload: str = "cpu",
        path: str | os.PathLike[str] | None = None,
        bucket_mb: float = 64.0,
        moment_dtype: str = "float32",
        resume: bool = False,
        overwrite: bool = False,
        queue_depth: int = 32,
        block_size_kb: int = 1024,
        io_backend: str = "auto",
        durable: bool = True,
    ) -> None:
        if isinstance(lr, torch.Tensor) or not (lr >= 0.0 and math.isfinite(lr)):
            raise ValueError(f"lr must be a finite float >= 0, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two values in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if offload not in OFFLOAD_TARGETS:
            raise ValueError(f"offload must be one of {OFFLOAD_TARGETS}, got {offload!r}")
        if offload == "nvme" and path is None:
            raise ValueError('offload="nvme" needs path= (a directory on node-local disk)')
        if resume and offload != "nvme":
            raise ValueError('resume=True reads files: it needs offload="nvme"')
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if moment_dtype not in _MOMENT_DTYPES:
            raise ValueError(
                f"moment_dtype must be one of {tuple(_MOMENT_DTYPES)}, got {moment_dtype!r}"
            )
        if block_size_kb <= 0 or block_size_kb % 4:
            raise ValueError(f"block_size_kb must be a positive multiple of 4, got {block_size_kb}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "maximize": maximize,
        }
        self._frozen = False
        super().__init__(params, defaults)
        self._frozen = True
        self.offload = offload
        self._params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._group_of: list[dict[str, Any]] = [g for g in self.param_groups for _ in g["params"]]
        locals_ = [_local(p) for p in self._params]
        for i, t in enumerate(locals_):
            if not t.is_contiguous():
                raise ValueError(
                    f"parameter {i} (shape {tuple(t.shape)}) is not contiguous; miles_offload "
                    "updates parameters in place through flat views"
                )
            if not t.is_floating_point():
                raise ValueError(f"parameter {i} has dtype {t.dtype}; AdamW needs floating point")
        self._shapes = [tuple(t.shape) for t in locals_]
        self._dtypes = [t.dtype for t in locals_]
        mdtype = _MOMENT_DTYPES[moment_dtype]
        self.moment_dtype = mdtype
        per_elem = 4 + 2 * mdtype.itemsize
        bucket_elems = max(16, int(bucket_mb * 2**20) // per_elem)

        def hbytes(segs: list[Any]) -> int:
            tmp = Bucket(0, tuple(segs), 0, mdtype, 0, 0, 0, 0, 0)
            return header_bytes(tmp.describe(self._shapes, self._dtypes))

        nvme = offload == "nvme"
        self._buckets = partition(
            [t.numel() for t in locals_], bucket_elems, mdtype, hbytes if nvme else None
        )
        self._steps = [torch.tensor(0.0) for _ in self._params]
        pin = torch.cuda.is_available()
        self._store: CpuStore | NvmeStore
        if nvme:
            assert path is not None
            descs = [b.describe(self._shapes, self._dtypes) for b in self._buckets]
            self._store = NvmeStore(
                path,
                self._buckets,
                descs,
                self._steps,
                layout_digest(self._buckets, self._shapes, self._dtypes),
                resume=resume,
                overwrite=overwrite,
                queue_depth=queue_depth,
                block_size=block_size_kb * 1024,
                backend=io_backend,
                durable=durable,
                pin=pin,
            )
        else:
            self._store = CpuStore(self._buckets, pin=pin)
        self._scratch = torch.empty(0, dtype=torch.float32)
        try:
            if resume:
                assert isinstance(self._store, NvmeStore)
                for p, step in self._store.read_steps().items():
                    self._steps[p].fill_(step)
                self._resume_params()
            else:
                self._store.visit(list(range(len(self._buckets))), self._fill_fresh, read=False)
        except BaseException:
            self._store.close()  # files, I/O threads and the directory lock
            raise
        self._sync_state()

    # ------------------------------------------------------------------ info

    @property
    def num_buckets(self) -> int:
        """How many buckets the state is cut into."""
        return len(self._buckets)

    @property
    def resident_bytes(self) -> int:
        """Bytes of bucket buffers this optimizer holds in memory (all buckets with "cpu",
        the three-buffer pool with "nvme")."""
        return self._store.resident_bytes

    @property
    def peak_resident_bytes(self) -> int:
        """Most bytes of bucket buffers in use at once so far (measured by the pipeline)."""
        return self._store.peak_resident_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of the whole optimizer state (every bucket, padding and headers included)."""
        return sum(b.nbytes for b in self._buckets)

    def io_stats(self) -> dict[str, Any]:
        """The pager's backend and counters (nvme), else an empty dict."""
        if isinstance(self._store, NvmeStore):
            return {"backend": self._store.backend, **self._store.pager_stats()}
        return {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the bucket layout is fixed afterwards."""
        if getattr(self, "_frozen", False):
            raise ValueError(
                "miles_offload.AdamW cannot take new param groups after construction (the "
                "bucket layout is fixed); pass every group to the constructor"
            )
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ bucket callbacks

    def _sections(self, bucket: Bucket, buf: torch.Tensor):  # type: ignore[no-untyped-def]
        master, avg, sq = bucket.views(buf)
        for s in bucket.segments:
            sl = slice(s.offset, s.offset + s.numel)
            flat = _local(self._params[s.param]).detach().view(-1)[s.start : s.start + s.numel]
            yield s, flat, master[sl], avg[sl], sq[sl]

    def _fill_fresh(self, bucket: Bucket, buf: torch.Tensor) -> None:
        buf[bucket.header_bytes : bucket.nbytes].zero_()
        for _, flat, master, _, _ in self._sections(bucket, buf):
            master.copy_(flat)

    def _copy_out(self, bucket: Bucket, buf: torch.Tensor) -> None:
        with torch.no_grad():
            for _, flat, master, _, _ in self._sections(bucket, buf):
                flat.copy_(master)

    def _resume_params(self) -> None:
        """Give the parameters the committed masters; if a bucket turns out damaged, give back
        the values the parameters had (kept in CPU memory bucket by bucket as they are
        overwritten) so that a failed resume leaves them as they were."""
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []

        def copy_out(bucket: Bucket, buf: torch.Tensor) -> None:
            for _, flat, _, _, _ in self._sections(bucket, buf):
                saved.append((flat, flat.to("cpu", copy=True)))
            self._copy_out(bucket, buf)

        try:
            with torch.no_grad():
                self._store.visit(list(range(len(self._buckets))), copy_out, write=False)
        except BaseException:
            with torch.no_grad():
                for flat, old in saved:
                    flat.copy_(old)
            raise

    def _sync_state(self) -> None:
        """Expose per-parameter steps in ``self.state`` (the moments stay offloaded)."""
        for p, step in zip(self._params, self._steps):
            if float(step) > 0:
                self.state[p] = {"step": step}
            else:
                self.state.pop(p, None)

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW update of every parameter that has a gradient (others keep their state).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads: list[torch.Tensor | None] = []
        for i, p in enumerate(self._params):
            g = p.grad
            if g is None:
                grads.append(None)
                continue
            g = _local(g)
            if g.is_sparse:
                raise ValueError("miles_offload.AdamW does not support sparse gradients")
            if tuple(g.shape) != self._shapes[i]:
                raise ValueError(
                    f"parameter {i}: gradient shape {tuple(g.shape)} != {self._shapes[i]}"
                )
            grads.append(g.reshape(-1))
        order = [
            b.index for b in self._buckets if any(grads[s.param] is not None for s in b.segments)
        ]
        if not order:
            return loss
        stepped = [i for i, g in enumerate(grads) if g is not None]
        for i in stepped:
            self._steps[i] += 1
        hyper = [
            {k: g[k] for k in _HYPER} if grads[i] is not None else None
            for i, g in enumerate(self._group_of)
        ]
        for h in hyper:
            if h is not None and isinstance(h["lr"], torch.Tensor):
                h["lr"] = float(h["lr"])

        updated: list[int] = []

        def update(bucket: Bucket, buf: torch.Tensor) -> None:
            updated.append(bucket.index)
            for s, flat, master, avg, sq in self._sections(bucket, buf):
                g = grads[s.param]
                if g is None:
                    continue
                h = hyper[s.param]
                assert h is not None
                adamw_segment(
                    master,
                    g[s.start : s.start + s.numel],
                    avg,
                    sq,
                    step=self._steps[s.param].item(),
                    lr=h["lr"],
                    beta1=h["betas"][0],
                    beta2=h["betas"][1],
                    eps=h["eps"],
                    weight_decay=h["weight_decay"],
                    maximize=h["maximize"],
                    scratch=self._scratch_for(s.numel),
                )
                flat.copy_(master)

        try:
            self._store.visit(order, update, reorder=True)
        except BaseException:
            for i in stepped:  # nothing was committed: the steps roll back with the state
                self._steps[i] -= 1
            if isinstance(self._store, NvmeStore):
                self._restore_params(updated)
            raise
        self._sync_state()
        return loss

    def _restore_params(self, order: list[int]) -> None:
        """After a failed step: give the parameters of the buckets that were updated (they
        had already copied their new values out) the committed masters again."""
        try:
            self._store.visit(order, self._copy_out, write=False)
        except Exception as exc:  # the step's own error is the one to raise
            import warnings

            warnings.warn(
                f"miles_offload: after a failed step the parameters could not be restored from "
                f"the committed state ({exc}); reload them with load_state_dict() or resume=True",
                RuntimeWarning,
                stacklevel=3,
            )

    def _scratch_for(self, n: int) -> torch.Tensor:
        need = min(n, CHUNK) * (3 if self.moment_dtype != torch.float32 else 1)
        if self._scratch.numel() < need:
            self._scratch = torch.zeros(need, dtype=torch.float32)  # pre-faulted, reused
        return self._scratch

    # ------------------------------------------------------------------ state dict

    def state_dict(self) -> dict[str, Any]:
        """torch AdamW's format: ``{"state": {index: {...}}, "param_groups": [...]}``.

        Parameters that never took a step have no entry (as with torch). Tensors are fresh
        CPU copies; for DTensor parameters they are DTensors with the parameter's placements.
        For non-fp32 parameters the fp32 master weights come as ``"master"``.
        """
        state: dict[int, dict[str, Any]] = {}
        for i, step in enumerate(self._steps):
            if float(step) > 0:
                entry: dict[str, Any] = {"step": step.clone()}
                names = ["exp_avg", "exp_avg_sq"]
                if self._dtypes[i] != torch.float32:
                    names.append("master")
                for name in names:
                    dtype = torch.float32 if name == "master" else self.moment_dtype
                    entry[name] = torch.empty(self._shapes[i], dtype=dtype)
                state[i] = entry

        def collect(bucket: Bucket, buf: torch.Tensor) -> None:
            for s, _, master, avg, sq in self._sections(bucket, buf):
                if s.param not in state:
                    continue
                entry = state[s.param]
                for name, src in (("exp_avg", avg), ("exp_avg_sq", sq), ("master", master)):
                    if name in entry:
                        entry[name].view(-1)[s.start : s.start + s.numel].copy_(src)

        self._store.visit([b.index for b in self._buckets], collect, write=False)
        for i, entry in state.items():
            p = self._params[i]
            if _is_dtensor(p):
                from torch.distributed.tensor import DTensor

                for name in ("exp_avg", "exp_avg_sq", "master"):
                    if name in entry:
                        entry[name] = DTensor.from_local(
                            entry[name].to(_local(p).device),
                            p.device_mesh,  # type: ignore[attr-defined]
                            p.placements,  # type: ignore[attr-defined]
                            shape=p.shape,
                            stride=p.stride(),
                            run_check=False,
                        )
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state in torch AdamW's format (from this class, any bucket size, or torch).

        Hyperparameters of the groups are taken from ``state_dict``; parameters without an
        entry start fresh (step 0, zero moments). Master weights come from ``"master"`` when
        present, else from the parameters' current values. The new state is committed as a
        whole (with "nvme": written to the free slots, then the manifest is replaced).

        Raises:
            ValueError: the groups or shapes do not match this optimizer's parameters, an
                entry lacks ``step``, ``exp_avg`` or ``exp_avg_sq``, or the state is of another
                algorithm (amsgrad, or Adam's coupled weight decay); checked before anything
                is loaded.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)
        ):
            raise ValueError(
                "state_dict has param groups of sizes "
                f"{[len(g['params']) for g in groups]}, this optimizer "
                f"{[len(g['params']) for g in self.param_groups]}"
            )
        for k, saved in enumerate(groups):
            # State of another algorithm would load without complaint and change the results.
            if saved.get("amsgrad", False):
                raise ValueError(
                    f"state_dict param group {k} has amsgrad=True; miles_offload.AdamW "
                    "implements AdamW without amsgrad: load state saved with amsgrad=False"
                )
            if not saved.get("decoupled_weight_decay", True) and saved.get("weight_decay", 0):
                raise ValueError(
                    f"state_dict param group {k} comes from Adam with (coupled) weight_decay="
                    f"{saved['weight_decay']}; miles_offload.AdamW decays decoupled (AdamW): "
                    "load AdamW state, or state saved with weight_decay=0"
                )
        index: dict[Any, int] = {}  # saved key -> position in this optimizer's flat order
        for saved in groups:
            for key in saved["params"]:
                index[key] = len(index)
        saved_state = state_dict["state"]
        entries: list[dict[str, torch.Tensor] | None] = [None] * len(self._params)
        for key, entry in saved_state.items():
            if key not in index:
                raise ValueError(f"state_dict has state for unknown parameter {key!r}")
            i = index[key]
            local: dict[str, torch.Tensor] = {}
            for name, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    continue
                v = _local(value).detach().cpu()
                if name != "step" and tuple(v.shape) != self._shapes[i]:
                    raise ValueError(
                        f"state_dict entry {key!r}.{name} has shape {tuple(v.shape)}, the "
                        f"parameter's local shape is {self._shapes[i]}"
                    )
                local[name] = v
            missing = [n for n in ("step", "exp_avg", "exp_avg_sq") if n not in entry]
            if missing:
                raise ValueError(
                    f"state_dict entry {key!r} has no {missing}: AdamW state needs 'step', "
                    "'exp_avg' and 'exp_avg_sq' per parameter (torch.optim.AdamW's format); "
                    "nothing was loaded"
                )
            local["step"] = torch.as_tensor(entry["step"], dtype=torch.float32).detach().cpu()
            entries[i] = local

        filled: list[int] = []

        def fill(bucket: Bucket, buf: torch.Tensor) -> None:
            filled.append(bucket.index)
            buf[bucket.header_bytes : bucket.nbytes].zero_()
            for s, flat, master, avg, sq in self._sections(bucket, buf):
                e = entries[s.param]
                sl = slice(s.start, s.start + s.numel)
                src = e["master"] if e is not None and "master" in e else None
                master.copy_(src.reshape(-1)[sl] if src is not None else flat)
                if e is not None:
                    avg.copy_(e["exp_avg"].reshape(-1)[sl])
                    sq.copy_(e["exp_avg_sq"].reshape(-1)[sl])
                flat.copy_(master)

        old = [float(s) for s in self._steps]
        for i, e in enumerate(entries):
            self._steps[i].fill_(float(e["step"]) if e is not None else 0.0)
        try:
            self._store.visit([b.index for b in self._buckets], fill, read=False)
        except BaseException:  # nothing was committed: steps and parameters roll back
            for step, before in zip(self._steps, old):
                step.fill_(before)
            if isinstance(self._store, NvmeStore):
                self._restore_params(filled)
            raise
        for saved, g in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = tuple(v) if k == "betas" else v
        self._sync_state()

    def close(self) -> None:
        """Release the bucket buffers, files and I/O threads (nvme state stays on disk)."""
        self._store.close()
