"""A ``WeightReceiver`` over any ``torch.nn.Module``: the simplest inference copy."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

from miles_transfer.digest import tensor_digest

__all__ = ["ModuleReceiver"]


def _floating_dtypes(module: torch.nn.Module) -> set[torch.dtype]:
    return {t.dtype for t in module.state_dict().values() if t.is_floating_point()}


class ModuleReceiver:
    """Serve a plain module as a weight receiver (HF names = ``module.state_dict()`` keys).

    Updates are all-or-nothing: every name, shape and dtype of a call is checked before the
    first copy, so a bad call leaves the module untouched. Updates and checksums hold a lock, so
    one receiver can sit behind a threaded server. A model with tied weights (two names, one
    tensor) is fine: both names are written with the same values.

    Attributes:
        module: the wrapped module (its tensors are updated in place).
        dtype: the floating-point precision it serves; senders cast to it.
        weight_version: the version of the current weights (``"0"`` at start).
    """

    def __init__(self, module: torch.nn.Module, *, dtype: torch.dtype | None = None) -> None:
        """Wrap ``module``.

        Args:
            module: the inference copy.
            dtype: the precision to serve. If given, the module's floating-point parameters and
                buffers are cast to it in place (``module.to(dtype)``). If ``None``, it is the
                module's own floating-point dtype, which must then be unique.

        Raises:
            ValueError: ``dtype`` is not a floating-point dtype, or it is ``None`` and the module
                mixes floating-point dtypes (or has none).
        """
        if dtype is not None:
            if not dtype.is_floating_point:
                raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
            module.to(dtype)
        found = _floating_dtypes(module)
        if dtype is None:
            if len(found) != 1:
                raise ValueError(
                    f"cannot infer the served dtype: the module holds floating dtypes "
                    f"{sorted(map(str, found))}; pass dtype= explicitly"
                )
            dtype = found.pop()
        self.module = module
        self.dtype: torch.dtype = dtype
        self.weight_version = "0"
        self._lock = threading.Lock()

    def _targets(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict(keep_vars=True)

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Copy the tensors into the module; all of them or none.

        Args:
            named_tensors: ``(hf_name, tensor)`` pairs; each must match the target's shape and
                dtype exactly (no silent casts).
            weight_version: if given, the new ``weight_version``.
            flush_cache: accepted for the protocol; a plain module has no cache.

        Raises:
            ValueError: an unknown name, or a shape/dtype mismatch (nothing is written then).
        """
        del flush_cache
        items = list(named_tensors)
        with self._lock:
            targets = self._targets()
            problems = []
            for name, src in items:
                dst = targets.get(name)
                if dst is None:
                    problems.append(f"{name}: no such parameter or buffer")
                elif src.shape != dst.shape or src.dtype != dst.dtype:
                    problems.append(
                        f"{name}: got {src.dtype}{list(src.shape)}, "
                        f"holds {dst.dtype}{list(dst.shape)}"
                    )
            if problems:
                more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
                raise ValueError(
                    "update rejected, nothing written: " + "; ".join(problems[:5]) + more
                )
            with torch.no_grad():
                for name, src in items:
                    targets[name].copy_(src)
            if weight_version is not None:
                self.weight_version = weight_version

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Return ``{name: tensor_digest(weight)}`` for ``names`` (every entry when ``None``).

        Raises:
            ValueError: an unknown name.
        """
        with self._lock:
            targets = self._targets()
            wanted = list(targets) if names is None else list(names)
            unknown = [n for n in wanted if n not in targets]
            if unknown:
                raise ValueError(f"unknown weight names: {unknown[:5]}")
            return {n: tensor_digest(targets[n]) for n in wanted}
