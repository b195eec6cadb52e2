"""Worker of test_trainer_checkpoint: stop-and-resume on two FSDP2 ranks (gloo).

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        _trainer_resume_worker.py MODEL_DIR OUT_DIR

An uninterrupted trainer takes 4 steps and dumps its state (``full``); a second trainer takes
2 steps, saves ``OUT_DIR/ckpt`` and records its next RNG draws (``rng-rank<r>.pt``); a fresh
third trainer (after the RNGs are reseeded) loads the checkpoint, records its RNG draws
(``rng-resumed-rank<r>.pt``), takes steps 3 and 4 and dumps its state (``resumed``). A dump is
the full parameters and metrics from rank 0 (``<name>.pt``, ``<name>-metrics.pt``) and every
rank's local optimizer-state shards (``<name>-rank<r>.pt``). One launch: torchrun's start-up
costs as much as the whole scenario on the test machine.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
from _trainer_testlib import full_params, make_batch, scenario_config

from miles_trainer import FSDPTrainer


def _dump(trainer: FSDPTrainer, out: Path, name: str, metrics: list[dict[str, float]]) -> None:
    params = full_params(trainer.model)
    optim = trainer.state_dict()["optimizer"]["state"]
    local = {
        fqn: {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in entry.items()}
        for fqn, entry in optim.items()
    }
    torch.save(local, out / f"{name}-rank{trainer.rank}.pt")
    if trainer.rank == 0:
        torch.save(params, out / f"{name}.pt")
        torch.save(metrics, out / f"{name}-metrics.pt")


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    cfg = scenario_config(model_dir)
    full = FSDPTrainer(cfg)
    metrics = [full.train_step(make_batch(5, seed=s)) for s in (1, 2, 3, 4)]
    _dump(full, out, "full", metrics)
    del full
    first = FSDPTrainer(cfg)
    for s in (1, 2):
        first.train_step(make_batch(5, seed=s))
    first.save_checkpoint(out / "ckpt", step=2, client_state={"data_position": 10})
    torch.save((torch.rand(4), random.random()), out / f"rng-rank{first.rank}.pt")
    del first
    torch.manual_seed(1234)
    random.seed(1234)
    trainer = FSDPTrainer(cfg)
    info = trainer.load_checkpoint(out / "ckpt")
    assert (info.step, info.client_state) == (2, {"data_position": 10}), info
    torch.save((torch.rand(4), random.random()), out / f"rng-resumed-rank{trainer.rank}.pt")
    metrics = [trainer.train_step(make_batch(5, seed=s)) for s in (3, 4)]
    _dump(trainer, out, "resumed", metrics)


if __name__ == "__main__":
    main()
