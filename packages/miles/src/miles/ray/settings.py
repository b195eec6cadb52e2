"""The recipe's ``ray`` section: how ``miles train --ray`` places the run (no Ray import here)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RaySettings"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
ENGINE_HOSTS = ("loopback", "node")


@dataclass(kw_only=True, slots=True)
class RaySettings:
    """Placement under ``miles train --ray [ADDRESS]``; ignored without ``--ray``.

    Trainer ranks are Ray actors in one placement group (one bundle per rank); the fleet's
    engines (the recipe's ``fleet`` section) are actors in a second one (one bundle per engine);
    the router is an actor on rank 0's node. Resources are Ray's logical units.

    Attributes:
        trainer_ranks: trainer processes, i.e. the torch.distributed world size (a multiple of
            ``trainer.megatron.tp * pp`` for Megatron).
        cpus_per_rank: CPUs each rank reserves.
        gpus_per_rank: 0 (CPU, gloo) or 1 (one GPU per rank, NCCL); a fraction lets the
            one rank share its GPU with engines (``trainer_ranks: 1``: NCCL refuses two ranks
            on one GPU; leave the trainer room with SGLang's ``mem_fraction_static``).
        cpus_per_engine: CPUs each fleet engine reserves.
        gpus_per_engine: GPUs each fleet engine reserves; ``null``: what one engine of the
            fleet's backend uses (SGLang: ``tp_size`` x ``dp_size``, or ``tp_size`` with DP
            attention; the embedded engine: 0).
        strategy: placement-group strategy of both groups: ``PACK`` (as few nodes as possible),
            ``SPREAD``, ``STRICT_PACK`` (one node) or ``STRICT_SPREAD`` (a node per bundle).
        engine_host: the address each engine binds: ``loopback`` (127.0.0.1; every engine must
            then be on rank 0's node) or ``node`` (its node's IP address, reachable from the
            other nodes; needs ``fleet.api_key`` or ``$MILES_API_KEY``).
        num_cpus: ``--ray`` without an address starts a Ray on this machine with this many
            CPUs; ``null``: the machine's CPU count, or what the recipe reserves if more.
        num_gpus: the same for GPUs; ``null``: the GPUs Ray detects.
        placement_timeout_s: how long the placement groups may wait for the cluster's
            resources before the run stops (naming what it asked for).
        env: extra environment variables for every rank and engine (``MILES_*``,
            ``OMP_NUM_THREADS``, ``PYTHONPATH``, ``TOKENIZERS_PARALLELISM``, ``NCCL_*`` and
            ``GLOO_*`` of the launching shell are passed on already).
    """

    trainer_ranks: int = 1
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    cpus_per_engine: float = 1.0
    gpus_per_engine: float | None = None
    strategy: str = "PACK"
    engine_host: str = "loopback"
    num_cpus: int | None = None
    num_gpus: int | None = None
    placement_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.trainer_ranks < 1:
            raise ValueError(f"ray.trainer_ranks must be >= 1, got {self.trainer_ranks}")
        if not 0 <= self.gpus_per_rank <= 1:
            raise ValueError(
                f"ray.gpus_per_rank must be 0 (CPU), 1 (a GPU per rank) or a fraction, got "
                f"{self.gpus_per_rank}"
            )
        if 0 < self.gpus_per_rank < 1 and self.trainer_ranks > 1:
            raise ValueError(
                f"ray.gpus_per_rank={self.gpus_per_rank} could put two of the "
                f"{self.trainer_ranks} ranks on one GPU, which NCCL refuses: use 1, or "
                "trainer_ranks: 1"
            )
        for name in ("cpus_per_rank", "cpus_per_engine"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ray.{name} must be >= 0, got {getattr(self, name)}")
        if self.gpus_per_engine is not None and not self.gpus_per_engine >= 0:
            raise ValueError(
                f"ray.gpus_per_engine must be >= 0 (or null), got {self.gpus_per_engine}"
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"ray.strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        if self.engine_host not in ENGINE_HOSTS:
            raise ValueError(
                f"ray.engine_host must be 'loopback' or 'node', got {self.engine_host!r}"
            )
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"ray.{name} must be >= 0 (or null), got {value}")
        if not self.placement_timeout_s > 0:
            raise ValueError(f"ray.placement_timeout_s must be > 0, got {self.placement_timeout_s}")
        bad = [k for k, v in self.env.items() if not isinstance(v, str)]
        if bad:
            raise ValueError(f"ray.env values must be strings; quote {', '.join(bad)}")
