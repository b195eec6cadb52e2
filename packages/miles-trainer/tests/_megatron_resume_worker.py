"""Worker of test_megatron_resume: R3 and stop-and-resume on 2 gloo processes.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        _megatron_resume_worker.py ROLLOUT_DIR DRIFTED_DIR OUT_DIR LAYOUT_JSON

LAYOUT_JSON holds `MegatronConfig` fields. R3: a trainer on the drifted weights with replay
trains once on the rollout batch (``r3-metrics.json``). Resume: an uninterrupted trainer takes
4 steps and saves ``whole``; a second takes 2 and saves ``ckpt``; a third (RNGs reseeded)
loads ``ckpt``, takes steps 3 and 4 and saves ``resumed``; rank 0 writes both runs' metrics
(``resume-metrics.json``) and every rank its RNG draws after the save and after the load.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path

import torch
from _r3_testlib import rollout_batch
from _trainer_testlib import make_batch

from miles_trainer import LossConfig, TrainerConfig
from miles_trainer.megatron import MegatronConfig
from miles_trainer.megatron.trainer import MegatronTrainer


def main() -> None:
    rollout_dir, drifted, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    layout = MegatronConfig(**json.loads(sys.argv[4]))
    torch.set_num_threads(1)
    base = TrainerConfig(model_path=drifted, lr=1e-3, eps=1e-6, megatron=layout)
    r3 = MegatronTrainer(dataclasses.replace(base, r3=True))
    r3_metrics = r3.train_step(rollout_batch(Path(rollout_dir)))
    del r3
    cfg = dataclasses.replace(
        base, micro_batch_size=2, num_minibatches=2, loss=LossConfig(kl_coef=0.05)
    )
    batches = [make_batch(5, seed=s) for s in (1, 2, 3, 4)]
    whole = MegatronTrainer(cfg)
    want = [whole.train_step(b) for b in batches]
    whole.save_checkpoint(out / "whole", step=4)
    del whole
    first = MegatronTrainer(cfg)
    for b in batches[:2]:
        first.train_step(b)
    first.save_checkpoint(out / "ckpt", step=2)
    rank = first.rank
    torch.save((torch.rand(4), random.random()), out / f"rng-rank{rank}.pt")
    del first
    torch.manual_seed(1234)
    random.seed(1234)
    resumed = MegatronTrainer(cfg)
    assert resumed.load_checkpoint(out / "ckpt").step == 2
    torch.save((torch.rand(4), random.random()), out / f"rng-resumed-rank{rank}.pt")
    got = [resumed.train_step(b) for b in batches[2:]]
    resumed.save_checkpoint(out / "resumed", step=4)
    if rank == 0:
        (out / "r3-metrics.json").write_text(json.dumps(r3_metrics))
        (out / "resume-metrics.json").write_text(json.dumps({"want": want[2:], "got": got}))


if __name__ == "__main__":
    main()
