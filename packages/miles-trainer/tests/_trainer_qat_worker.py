"""Worker of test_trainer_qat: one INT4-QAT train step on FSDP2 ranks (torchrun), then save.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        _trainer_qat_worker.py MODEL_DIR OUT_DIR

Rank r writes OUT_DIR/rank{r}.json: the logprobs of the batch before the step (every rank
computes every sample, through the fake-quantized forward) and the step's metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _trainer_testlib import make_batch

from miles_trainer import FSDPTrainer, QATConfig, TrainerConfig


def qat_config(model_dir: str, qat: bool = True) -> TrainerConfig:
    """The scenario of the QAT tests: bf16 compute, lr large enough to move the experts."""
    return TrainerConfig(
        model_path=model_dir,
        dtype="bfloat16",
        lr=1e-3,
        eps=1e-6,
        micro_batch_size=4,
        qat=QATConfig() if qat else None,
    )


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    trainer = FSDPTrainer(qat_config(model_dir))
    batch = make_batch(8, seed=1)
    logprobs = trainer.compute_logprobs(batch.tokens, batch.response_lengths)
    metrics = trainer.train_step(batch)
    record = {"logprobs": logprobs, "metrics": metrics, "world_size": trainer.world_size}
    (out / f"rank{trainer.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
