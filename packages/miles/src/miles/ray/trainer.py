"""One trainer rank as a Ray actor: the torch.distributed environment, then ``miles.loop.train``.

The same call torchrun makes in each of its processes; the launcher (:mod:`miles.ray.launcher`)
gives every rank its ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles.ray._import import import_ray

__all__ = ["RankError", "TrainerRank"]


class RankError(Exception):
    """A rank's exception whose class does not survive pickling (e.g. one whose ``__init__``
    takes keyword-only arguments), carried as its class name, module, nearest built-in base
    and message; :meth:`rebuild` makes an exception of the same name, base and message, so
    the command line reports it as it would without Ray."""

    def __init__(self, name: str, module: str, base: str, message: str) -> None:
        super().__init__(name, module, base, message)

    @classmethod
    def of(cls, e: BaseException) -> RankError:
        base = next(c for c in type(e).__mro__ if c.__module__ == "builtins")
        return cls(type(e).__name__, type(e).__module__, base.__name__, str(e))

    def rebuild(self) -> BaseException:
        import builtins

        name, module, base, message = self.args
        base_class = getattr(builtins, base, RuntimeError)
        rebuilt: BaseException = type(name, (base_class,), {"__module__": module})(message)
        return rebuilt

    def __str__(self) -> str:
        return f"{self.args[1]}.{self.args[0]}: {self.args[3]}"


def _portable(e: Exception) -> Exception:
    """``e`` if it unpickles as itself, else a :class:`RankError` describing it."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return RankError.of(e)
    return e


class TrainerRank:
    """A Ray actor class; one per rank, each in its bundle of the trainer placement group.

    Args:
        env: variables set in this worker before torch is imported (``OMP_NUM_THREADS``, ...).
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        os.environ.update(env)

    def where(self) -> tuple[str, str]:
        """(node id, node IP address) of this rank."""
        ray = import_ray()
        return ray.get_runtime_context().get_node_id(), str(ray.util.get_node_ip_address())

    def free_port(self) -> int:
        """A TCP port free on this node (rank 0's, for the rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def run(
        self,
        cfg: Any,
        *,
        dist_env: Mapping[str, str],
        cwd: str,
        sys_path: Sequence[str],
        resume: bool,
        progress: bool,
    ) -> dict[str, str] | None:
        """Run the loop as this rank; rank 0 returns where the outputs are.

        Args:
            cfg: the run (``miles.config.RunConfig``).
            dist_env: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ... (``LOCAL_RANK`` is
                recomputed here when Ray gave this rank a GPU: its index among the visible ones).
            cwd: the launching shell's directory (relative paths and modules resolve as there,
                when it exists on this node).
            sys_path: the launching process's import path (entries this node has are added).
            resume: ``miles train --resume``.
            progress: rank 0 prints a line per finished step.
        """
        os.environ.update(dist_env)
        ray = import_ray()
        gpus = [str(g) for g in ray.get_gpu_ids()]
        if gpus:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
            os.environ["LOCAL_RANK"] = str(visible.index(gpus[0]) if gpus[0] in visible else 0)
        if os.path.isdir(cwd):
            os.chdir(cwd)
        sys.path.extend(p for p in sys_path if p not in sys.path and os.path.isdir(p))
        from miles.cli import _quiet_libraries, _quiet_third_party_noise
        from miles.loop import train

        _quiet_third_party_noise()  # as the command line does in its own process
        _quiet_libraries()
        printer = None
        if progress and dist_env["RANK"] == "0" and cfg.run.out_dir:
            printer = _StepPrinter(Path(cfg.run.out_dir) / "metrics.jsonl", cfg.run.num_steps)
        try:
            result = train(cfg, resume=resume)
        except Exception as e:
            portable = _portable(e)
            if portable is e:
                raise
            raise portable from e  # the text of both tracebacks travels with it
        finally:
            if printer is not None:
                printer.stop()
        if result is None:
            return None
        return {
            "run_dir": str(result.run_dir.resolve()),
            "metrics_path": str(result.metrics_path.resolve()),
            "final_checkpoint": str(result.final_checkpoint.resolve()),
            "plot_path": str(Path(result.plot_path).resolve()),
        }


class _StepPrinter:
    """Prints ``step N/M reward R`` for each new row of metrics.jsonl (Ray forwards the lines to
    the launching shell; the loop's own progress bar does not survive that)."""

    def __init__(self, path: Path, total: int) -> None:
        self._path, self._total = path, total
        self._done = threading.Event()
        self._offset = 0
        self._thread = threading.Thread(target=self._run, name="miles-steps", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(1.0):
            self._print_new()

    def _print_new(self) -> None:
        try:
            with self._path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            reward = row.get("rollout/reward_mean")
            if isinstance(reward, int | float):
                print(f"miles train: step {row['step']}/{self._total} reward {reward:.3f}")
        sys.stdout.flush()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._print_new()
