"""``miles train RECIPE --ray [ADDRESS]``: the same run, its processes placed by Ray.

    Ray (local, or the cluster at ADDRESS)
      placement group "trainer": one bundle per rank -> TrainerRank actor -> miles.loop.train
      placement group "engines": one bundle per fleet engine -> ProcessActor -> engine process
      rank 0's node: ProcessActor -> sglang-router

A launcher, not a second loop: every rank runs ``miles.loop.train(cfg)`` exactly as under
torchrun, with the torch.distributed environment set by its actor. Rank 0 owns the rollout and
the run directory; its fleet (the recipe's ``fleet`` section) starts each engine through
:class:`miles.ray.fleet.RayLauncher`. The launcher waits for every rank, reports rank 0's
result, and tears everything down on success, failure, Ctrl-C or SIGTERM: it kills the rank
actors (the engine and router actors die with rank 0, their owner; each process dies with its
actor), removes the placement groups and, for a Ray it started, stops that Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

from miles.config import RunConfig
from miles.loop import RunResult, check_model_dir
from miles.ray._import import import_ray, passthrough_env
from miles.ray.trainer import RankError, TrainerRank

__all__ = ["launch"]

# Rank 0's error explains a run best (the other ranks then fail in a collective): after
# another rank fails, wait this long for rank 0's outcome.
_RANK0_GRACE_S = 30.0
_POLL_S = 0.5  # how often the launcher wakes from waiting on the ranks (signals are seen then)
_FLEET_LAUNCHER = "miles.ray.fleet:RayLauncher"


@dataclasses.dataclass(kw_only=True, slots=True)
class _Plan:
    """What the recipe asks Ray for."""

    ranks: int
    rank_bundle: dict[str, float]
    engines: int
    engine_bundle: dict[str, float]

    def total(self, resource: str) -> float:
        return self.ranks * self.rank_bundle.get(resource, 0.0) + self.engines * (
            self.engine_bundle.get(resource, 0.0)
        )

    def describe(self) -> str:
        text = f"{self.ranks} trainer rank(s) x {self.rank_bundle}"
        if self.engines:
            text += f", {self.engines} engine(s) x {self.engine_bundle}"
        return text


def _bundle(cpus: float, gpus: float, what: str) -> dict[str, float]:
    bundle = {k: float(v) for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}
    if not bundle:
        raise ValueError(
            f"ray.cpus_per_{what} and ray.gpus_per_{what} are both 0: a Ray bundle needs some "
            "resource; set ray.cpus_per_{what} > 0".replace("{what}", what)
        )
    return bundle


def plan(cfg: RunConfig) -> _Plan:
    """Check the recipe against ``--ray`` before anything starts.

    Raises:
        ValueError: a setting that cannot work (the message names the key and the fix).
    """
    settings = cfg.ray
    ranks = settings.trainer_ranks
    if cfg.trainer.backend == "megatron":
        try:
            cfg.trainer.megatron.data_parallel_size(ranks)
        except ValueError as e:
            raise ValueError(f"ray.trainer_ranks={ranks}: {e}") from None
    engines, engine_bundle = 0, {}
    if cfg.fleet is not None:
        fleet = cfg.fleet
        if fleet.launcher is not None and fleet.launcher != _FLEET_LAUNCHER:
            raise ValueError(
                f"fleet.launcher {fleet.launcher!r} places the engines itself; --ray places "
                "them as Ray actors: unset fleet.launcher or run without --ray"
            )
        gpus = settings.gpus_per_engine
        if gpus is None:
            from miles_rollout.fleet.sglang import gpus_per_engine

            gpus = (
                gpus_per_engine(fleet.sglang_args, fleet.dp_size)
                if fleet.backend == "sglang"
                else 0
            )
        engines, engine_bundle = fleet.engines, _bundle(settings.cpus_per_engine, gpus, "engine")
        if settings.engine_host == "node" and not fleet.insecure_no_auth:
            from miles_rollout.auth import resolve_api_key

            if (fleet.api_key or resolve_api_key(cfg.rollout.api_key)) is None:
                raise ValueError(
                    "ray.engine_host=node binds every engine to its node's address, reachable "
                    "from other machines: set fleet.api_key (or $MILES_API_KEY), or "
                    "fleet.insecure_no_auth=true on a trusted network"
                )
    rank_bundle = _bundle(settings.cpus_per_rank, settings.gpus_per_rank, "rank")
    return _Plan(ranks=ranks, rank_bundle=rank_bundle, engines=engines, engine_bundle=engine_bundle)


def launch(cfg: RunConfig, *, address: str | None = None, resume: bool = False) -> RunResult:
    """Run ``cfg`` with its trainer ranks and fleet as Ray actors (see the module docstring).

    Args:
        cfg: the run; its ``ray`` section says how to place it.
        address: a Ray cluster (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``); ``None``
            starts a Ray on this machine for this run only.
        resume: continue the run in ``cfg.run.out_dir`` (``miles train --resume``).

    Returns:
        Rank 0's outputs.

    Raises:
        ImportError: Ray is not installed (the message names the install).
        ValueError: a setting that cannot work, or the cluster lacks the resources.
        ConnectionError: no Ray cluster at ``address``.
        KeyboardInterrupt: Ctrl-C or SIGTERM (everything was torn down first).
    """
    ray = import_ray()
    the_plan = plan(cfg)
    check_model_dir(cfg.model_path)
    cfg = _absolute(cfg)
    run = _RayRun(ray, cfg, the_plan, address)
    with _sigterm_interrupts():
        try:
            return run.run(resume)
        finally:
            run.close()


def _absolute(cfg: RunConfig) -> RunConfig:
    """The run directory as an absolute path (the loop's default name otherwise), so rank 0
    writes where the launching shell expects it."""
    out = cfg.run.out_dir
    if not out:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = str(Path("runs") / f"{cfg.name}-{stamp}")
    run = dataclasses.replace(cfg.run, out_dir=str(Path(out).absolute()))
    return dataclasses.replace(cfg, run=run)


@contextlib.contextmanager
def _sigterm_interrupts() -> Any:
    """SIGTERM tears the run down as Ctrl-C does (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _RayRun:
    """One launch: the Ray session, the placement groups, the rank actors."""

    def __init__(self, ray: ModuleType, cfg: RunConfig, the_plan: _Plan, address: str | None):
        self.ray, self.cfg, self.plan, self.address = ray, cfg, the_plan, address
        self.temp_dir: str | None = None
        self.groups: list[Any] = []
        self.engine_group = ""  # the engines' placement group's name
        self.ranks: list[Any] = []
        self.keep_logs = False  # a rank died: Ray's own logs may say why

    # ------------------------------------------------------------------ start

    def _init(self) -> None:
        settings, ray = self.cfg.ray, self.ray
        if self.address is None:
            need = math.ceil(self.plan.total("CPU"))
            num_cpus = settings.num_cpus or max(os.cpu_count() or 1, need)
            self.temp_dir = tempfile.mkdtemp(prefix="miles-ray-")
            ray.init(
                address="local",
                num_cpus=num_cpus,
                num_gpus=settings.num_gpus,
                include_dashboard=False,
                _temp_dir=self.temp_dir,  # its own sockets and logs, apart from any other Ray
                logging_level=logging.WARNING,
            )
            where = f"a local Ray ({num_cpus} CPUs, logs in {self.temp_dir})"
        else:
            try:
                ray.init(address=self.address, logging_level=logging.WARNING)
            except ConnectionError as e:
                raise ConnectionError(
                    f"cannot connect to the Ray cluster at --ray {self.address} ({e}); start "
                    "it (ray start --head) or give --ray without an address for a local one"
                ) from None
            where = f"the Ray cluster at {self.address}"
        print(f"miles train --ray: {where}; {self.plan.describe()}", file=sys.stderr, flush=True)

    def _placement_groups(self) -> tuple[Any, Any | None]:
        from ray.util.placement_group import placement_group

        ray, settings, p = self.ray, self.cfg.ray, self.plan
        have = ray.cluster_resources()
        if self.address is None:  # a local Ray does not grow: say now what does not fit
            for resource in ("CPU", "GPU"):
                if p.total(resource) > have.get(resource, 0.0) + 1e-9:
                    raise ValueError(
                        f"the recipe reserves {p.total(resource):g} {resource} "
                        f"({p.describe()}) but this machine's Ray has "
                        f"{have.get(resource, 0.0):g}: lower ray.{resource.lower()}s_per_rank / "
                        f"ray.{resource.lower()}s_per_engine, or raise ray.num_{resource.lower()}s"
                    )
        tag = uuid.uuid4().hex[:8]
        trainer = placement_group(
            [dict(p.rank_bundle) for _ in range(p.ranks)],
            strategy=settings.strategy,
            name=f"miles-{tag}-trainer",
        )
        self.groups.append(trainer)
        engines = None
        if p.engines:
            self.engine_group = f"miles-{tag}-engines"
            engines = placement_group(
                [dict(p.engine_bundle) for _ in range(p.engines)],
                strategy=settings.strategy,
                name=self.engine_group,
            )
            self.groups.append(engines)
        ready, _ = ray.wait(
            [g.ready() for g in self.groups],
            num_returns=len(self.groups),
            timeout=settings.placement_timeout_s,
        )
        if len(ready) < len(self.groups):
            raise ValueError(
                f"the Ray cluster did not have {p.describe()} free within "
                f"ray.placement_timeout_s={settings.placement_timeout_s:g} s (it has "
                f"{ray.available_resources()} available of {have}); free or add resources, or "
                "lower ray.trainer_ranks / fleet.engines / the per-rank and per-engine resources"
            )
        return trainer, engines

    def _start_ranks(self, trainer: Any, env: dict[str, str]) -> list[tuple[str, str]]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, p = self.ray, self.plan
        actor_class = ray.remote(TrainerRank)
        for r in range(p.ranks):
            strategy = PlacementGroupSchedulingStrategy(
                trainer, placement_group_bundle_index=r, placement_group_capture_child_tasks=False
            )
            self.ranks.append(
                actor_class.options(
                    num_cpus=p.rank_bundle.get("CPU", 0.0),
                    num_gpus=p.rank_bundle.get("GPU", 0.0),
                    scheduling_strategy=strategy,
                    max_restarts=0,
                ).remote(env)
            )
        return list(ray.get([a.where.remote() for a in self.ranks]))

    def _check_engine_nodes(self, engines: Any, rank0_node: str) -> None:
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(engines).get("bundles_to_node_id", {})
        away = {b: n for b, n in nodes.items() if n != rank0_node}
        if away:
            raise ValueError(
                f"ray.engine_host=loopback binds each engine to 127.0.0.1, but Ray placed "
                f"engine bundle(s) {sorted(away)} on another node than trainer rank 0: set "
                "ray.engine_host=node (with fleet.api_key) or ray.strategy=STRICT_PACK"
            )

    # ------------------------------------------------------------------ run

    def run(self, resume: bool) -> RunResult:
        ray, cfg, p = self.ray, self.cfg, self.plan
        self._init()
        trainer, engines = self._placement_groups()
        env = passthrough_env(cfg.ray.env)
        where = self._start_ranks(trainer, env)
        rank0_node, rank0_ip = where[0]
        if engines is not None and cfg.ray.engine_host == "loopback":
            self._check_engine_nodes(engines, rank0_node)
        same_node = all(node == rank0_node for node, _ in where)
        master_addr = "127.0.0.1" if same_node else rank0_ip
        master_port = ray.get(self.ranks[0].free_port.remote())
        run_cfg = self._rank_config(engines, env)
        per_node: dict[str, list[int]] = {}
        for r, (node, _) in enumerate(where):
            per_node.setdefault(node, []).append(r)
        refs = []
        for r, actor in enumerate(self.ranks):
            node_ranks = per_node[where[r][0]]
            dist_env = {
                "RANK": str(r),
                "WORLD_SIZE": str(p.ranks),
                "LOCAL_RANK": str(node_ranks.index(r)),
                "LOCAL_WORLD_SIZE": str(len(node_ranks)),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
            }
            refs.append(
                actor.run.remote(
                    run_cfg,
                    dist_env=dist_env,
                    cwd=os.getcwd(),
                    sys_path=list(sys.path),
                    resume=resume,
                    progress=cfg.run.progress,
                )
            )
        out = self._wait(refs)
        return RunResult(
            run_dir=Path(out["run_dir"]),
            metrics_path=Path(out["metrics_path"]),
            final_checkpoint=Path(out["final_checkpoint"]),
            plot_path=Path(out["plot_path"]),
        )

    def _rank_config(self, engines: Any, env: dict[str, str]) -> RunConfig:
        """The run as every rank sees it: the fleet placed by Ray; steps printed, not drawn."""
        cfg = self.cfg
        fleet = cfg.fleet
        if fleet is not None and engines is not None:
            fleet = dataclasses.replace(
                fleet,
                launcher=_FLEET_LAUNCHER,
                launcher_args={
                    "placement_group": self.engine_group,
                    "cpus": self.plan.engine_bundle.get("CPU", 0.0),
                    "gpus": self.plan.engine_bundle.get("GPU", 0.0),
                    "engine_host": cfg.ray.engine_host,
                    "env": env,
                },
            )
        run = dataclasses.replace(cfg.run, progress=False)
        return dataclasses.replace(cfg, fleet=fleet, run=run)

    def _wait(self, refs: list[Any]) -> dict[str, str]:
        """Rank 0's result once every rank finished; the most telling error if one failed."""
        ray = self.ray
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        result: dict[str, str] | None = None
        while pending:
            # With a timeout: Python gets control back every _POLL_S, so a Ctrl-C / SIGTERM that
            # arrived while Ray's C++ wait blocked is raised here (a wait without one can sit on
            # it until the run ends: seen on CI, where the run then finished all its steps).
            done, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            if not done:
                continue
            ref = done[0]
            try:
                value = ray.get(ref)
            except ray.exceptions.RayError as e:
                failure, rank = e, rank_of[ref]
                if rank != 0 and refs[0] in pending:
                    first, _ = ray.wait([refs[0]], timeout=_RANK0_GRACE_S)
                    if first:
                        try:
                            ray.get(refs[0])
                        except ray.exceptions.RayError as e0:
                            failure, rank = e0, 0
                raise self._explain(failure, rank) from failure
            if rank_of[ref] == 0:
                result = value
        assert result is not None, "rank 0 returns its outputs"
        return result

    def _explain(self, e: Exception, rank: int) -> BaseException:
        """The rank's own exception (so the CLI reports it as without --ray), else a line
        naming the rank that died."""
        ray = self.ray
        if isinstance(e, ray.exceptions.RayTaskError):
            cause = e.cause
            if isinstance(cause, RankError):
                return cause.rebuild()
            if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
                return cause
        if isinstance(e, ray.exceptions.RayActorError):
            self.keep_logs = True
            return RuntimeError(f"trainer rank {rank} died: {e}")
        return e

    # ------------------------------------------------------------------ stop

    def close(self) -> None:
        """Kill the rank actors (what they own dies with them), remove the placement groups,
        stop a Ray started here; idempotent, and never raises (it runs after errors)."""
        ray = self.ray
        with contextlib.suppress(Exception):
            if ray.is_initialized():
                for actor in self.ranks:
                    with contextlib.suppress(Exception):
                        ray.kill(actor, no_restart=True)
                from ray.util.placement_group import remove_placement_group

                for group in self.groups:
                    with contextlib.suppress(Exception):
                        remove_placement_group(group)
        self.ranks.clear()
        self.groups.clear()
        with contextlib.suppress(Exception):
            ray.shutdown()
        if self.temp_dir is not None:
            if self.keep_logs:
                print(f"miles train --ray: Ray's logs are in {self.temp_dir}", file=sys.stderr)
            else:  # the ranks' output reached this terminal already
                shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
