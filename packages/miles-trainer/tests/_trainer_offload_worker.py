"""Worker of test_trainer_offload: the distributed scenario with offload "none" and "nvme".

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        _trainer_offload_worker.py MODEL_DIR OUT_DIR

For each mode: two train steps, a state_dict() / load_state_dict() round trip (DCP's
get_state_dict/set_state_dict), one more step. Rank 0 saves the full parameters to
OUT_DIR/<mode>.pt; every rank saves its local optimizer-state shards to
OUT_DIR/<mode>-rank<r>.pt.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from _trainer_testlib import full_params, make_batch, run_scenario, scenario_config

from miles_trainer import FSDPTrainer, OffloadConfig


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    for mode in ("none", "nvme"):
        cfg = dataclasses.replace(
            scenario_config(model_dir),
            offload=OffloadConfig(mode=mode, path=str(out / "state"), bucket_mb=0.05),
        )
        trainer = FSDPTrainer(cfg)
        run_scenario(trainer)
        state = trainer.state_dict()
        trainer.load_state_dict(state)
        trainer.train_step(make_batch(5, seed=13))
        params = full_params(trainer.model)
        if trainer.rank == 0:
            torch.save(params, out / f"{mode}.pt")
        optim = trainer.state_dict()["optimizer"]["state"]
        local = {
            fqn: {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in entry.items()}
            for fqn, entry in optim.items()
        }
        torch.save(local, out / f"{mode}-rank{trainer.rank}.pt")


if __name__ == "__main__":
    main()
