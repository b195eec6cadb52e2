"""One weight receiver in front of every engine of a fleet (weight updates bypass the router)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from miles_transfer import HTTPReceiver

__all__ = ["FanoutReceiver"]


class FanoutReceiver:
    """A ``miles_transfer.WeightReceiver`` that sends every bucket to each live engine.

    The engine list is read at each update, so engines that joined since (a replacement for
    one that died) get the full weights and version with the next update. An engine that
    fails an update and no longer answers ``/health`` is left out (it died; the fleet
    reports it); an engine that answers and still fails raises.

    Args:
        urls: returns the base URLs of the live engines.
        dtype: the precision every engine serves (read from the first engine when ``None``).
        api_key: sent as ``Authorization: Bearer`` to each engine.
    """

    def __init__(
        self,
        urls: Callable[[], Sequence[str]],
        *,
        dtype: torch.dtype | None = None,
        api_key: str | None = None,
    ) -> None:
        self._urls = urls
        self._api_key = api_key
        self._receivers: dict[str, HTTPReceiver] = {}
        self._batch: list[HTTPReceiver] | None = None
        self._updated: list[HTTPReceiver] | None = None  # who got the last complete update
        self._dead: set[str] = set()
        self.dropped = 0  # engines left out because they died during an update
        first = self._receiver(self._live()[0])
        self.dtype: torch.dtype = dtype if dtype is not None else first.dtype

    def _live(self) -> list[str]:
        urls = [u for u in self._urls() if u not in self._dead]
        if not urls:
            raise RuntimeError("the fleet has no live engine to update")
        return urls

    def _receiver(self, url: str) -> HTTPReceiver:
        if url not in self._receivers:
            self._receivers[url] = HTTPReceiver(url, api_key=self._api_key)
        return self._receivers[url]

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Send one bucket to every engine of this update (fixed at its first bucket)."""
        items = list(named_tensors)
        if self._batch is None:
            self._batch = [self._receiver(u) for u in self._live()]
            for r in self._batch:
                if r.dtype != self.dtype:
                    raise ValueError(
                        f"engine {r.base_url} serves {r.dtype}, the others {self.dtype}: every "
                        "engine of a fleet must serve the same precision"
                    )
        for r in list(self._batch):
            try:
                r.update_weights_from_tensor(
                    items, weight_version=weight_version, flush_cache=flush_cache
                )
            except Exception:
                if _answers(r.base_url):
                    raise
                self._dead.add(r.base_url)
                self._batch.remove(r)
                self.dropped += 1
                if not self._batch:
                    raise
        if weight_version is not None:  # the last bucket: the next update re-reads the fleet
            self._updated, self._batch = self._batch, None

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """Every engine's digests; a name whose digests differ between engines maps to a
        value that cannot match any digest (so verification names it)."""
        engines = (
            self._updated
            if self._updated is not None
            else [self._receiver(u) for u in self._live()]
        )
        sums = [r.weights_checksum(names) for r in engines]
        out = dict(sums[0])
        for r, other in zip(engines[1:], sums[1:]):
            for name, digest in out.items():
                if other.get(name) != digest:
                    out[name] = f"differs on {r.base_url}"
        return out


def _answers(url: str) -> bool:
    """Whether the engine at ``url`` still answers ``/health`` (within 5 s)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
