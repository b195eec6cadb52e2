"""Ray placement for ``miles train RECIPE --ray [ADDRESS]`` (extra ``miles[ray]``).

The recipe's trainer ranks, engines and router run as Ray actors in placement groups, on one
machine or across the nodes of a Ray cluster; every rank runs the same ``miles.loop.train`` as
under torchrun. The recipe's ``ray`` section (:class:`RaySettings`) says how to place them.
Importing this package does not import Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.ray.settings import RaySettings

if TYPE_CHECKING:
    from miles.config import RunConfig
    from miles.loop import RunResult

__all__ = ["RaySettings", "launch"]


def launch(cfg: RunConfig, *, address: str | None = None, resume: bool = False) -> RunResult:
    """Run ``cfg`` with Ray placing its processes (:func:`miles.ray.launcher.launch`)."""
    from miles.ray.launcher import launch as _launch

    return _launch(cfg, address=address, resume=resume)
