"""Worker of test_trainer_distributed: run the scenario under torchrun and save the result.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        _trainer_dist_worker.py MODEL_DIR OUT_DIR

Each rank writes OUT_DIR/rank{r}.json; all ranks write OUT_DIR/ckpt (save_hf_checkpoint), and
the same scenario in bfloat16 compute to OUT_DIR/ckpt-bf16 (fp32 master weights) and
OUT_DIR/rank{r}-bf16.json; then the multi-turn scenario (packing, token budget, critic):
OUT_DIR/rank{r}-multiturn.json and, from rank 0, the full policy and critic parameters in
OUT_DIR/multiturn.pt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _trainer_testlib import (
    full_params,
    make_batch,
    multiturn_config,
    run_multiturn_scenario,
    run_scenario,
    scenario_config,
)

from miles_trainer import FSDPTrainer


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    trainer = FSDPTrainer(scenario_config(model_dir))
    metrics = run_scenario(trainer)
    trainer.save_hf_checkpoint(out / "ckpt")
    # Different batches on different ranks must be refused on every rank.
    mismatch = ""
    try:
        trainer.train_step(make_batch(4, seed=100 + trainer.rank))
    except ValueError as e:
        mismatch = str(e)
    record = {"world_size": trainer.world_size, "metrics": metrics, "mismatch": mismatch}
    (out / f"rank{trainer.rank}.json").write_text(json.dumps(record))

    bf16 = FSDPTrainer(scenario_config(model_dir, "bfloat16"))
    metrics = run_scenario(bf16)
    bf16.save_hf_checkpoint(out / "ckpt-bf16", dtype="float32")
    (out / f"rank{bf16.rank}-bf16.json").write_text(json.dumps({"metrics": metrics}))

    multi = FSDPTrainer(multiturn_config(model_dir))
    metrics = run_multiturn_scenario(multi)
    assert multi.critic is not None
    params = {"policy": full_params(multi.model), "critic": full_params(multi.critic)}
    if multi.rank == 0:
        torch.save(params, out / "multiturn.pt")
    (out / f"rank{multi.rank}-multiturn.json").write_text(json.dumps({"metrics": metrics}))


if __name__ == "__main__":
    main()
