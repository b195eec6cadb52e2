"""One rank of a Megatron-backend run under torchrun (or alone), for the tests.

    torchrun --standalone --nproc_per_node 2 _megatron_worker.py MODEL_DIR OUT_DIR SPEC_JSON

SPEC_JSON: {"megatron": {MegatronConfig fields}, "trainer": {TrainerConfig fields},
"steps": [batch seeds], "batch_size": n}. Every rank checks that `named_hf_tensors` right after
construction equals the checkpoint bit for bit (the TP / EP / PP gather) and that its
`megatron_shards` equal miles-transfer's `megatron_layout` slicing of the checkpoint, then runs
one `train_step` per seed. Rank 0 writes ``result.json`` (metrics per step, the initial logprobs)
and, after the last step, ``params.safetensors`` (`named_hf_tensors`) and ``grads.safetensors``
(`named_hf_grads`, when it can: one data-parallel replica or no distributed optimizer).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _megatron_testlib import checkpoint_state
from _trainer_testlib import make_batch
from safetensors.torch import save_file

from miles_trainer import LossConfig, MismatchConfig, TrainerConfig
from miles_trainer.megatron import MegatronConfig
from miles_trainer.megatron.trainer import MegatronTrainer


def main() -> None:
    model_dir, out_dir, spec = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    mismatch = spec.get("mismatch_upper")
    loss = LossConfig(
        **spec.get("loss", {}),
        mismatch=None if mismatch is None else MismatchConfig(upper=mismatch),
    )
    cfg = TrainerConfig(
        model_path=model_dir,
        backend="megatron",
        megatron=MegatronConfig(**spec.get("megatron", {})),
        loss=loss,
        **spec.get("trainer", {}),
    )
    trainer = cfg.build()
    assert isinstance(trainer, MegatronTrainer)
    rank = trainer.rank

    want = checkpoint_state(model_dir)
    got = dict(trainer.named_hf_tensors())
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name, t in want.items():
        assert torch.equal(got[name].cpu(), t), f"rank {rank}: gathered {name} differs"

    try:  # this rank's shards are what miles-transfer's megatron_layout says (P2P)
        from miles_transfer.p2p.layouts import ModelShape, materialize, megatron_layout
    except ImportError:
        from miles_transfer import ModelShape, materialize, megatron_layout
    shape = ModelShape.from_hf_config(trainer.hf_config, dtype=torch.float32)
    layout = megatron_layout(shape, **trainer.megatron_layout_args())
    expected = materialize(layout, rank, want)
    shards = trainer.megatron_shards()
    assert shards.keys() == expected.keys(), sorted(set(shards) ^ set(expected))
    for name, t in expected.items():
        assert torch.equal(shards[name].cpu(), t), f"rank {rank}: shard {name} differs"

    probe = make_batch(3, seed=99)
    logprobs = trainer.compute_logprobs(probe.tokens, probe.response_lengths)
    metrics = [
        trainer.train_step(make_batch(spec.get("batch_size", 5), seed=s)) for s in spec["steps"]
    ]
    params = {n: t.cpu().contiguous() for n, t in trainer.named_hf_tensors()}
    grads = {}
    if trainer.data_parallel_size == 1 or not cfg.megatron.distributed_optimizer:
        grads = {n: t.cpu().contiguous() for n, t in trainer.named_hf_grads()}
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(params, str(out_dir / "params.safetensors"))
        if grads:
            save_file(grads, str(out_dir / "grads.safetensors"))
        record = {"world": trainer.world_size, "metrics": metrics, "logprobs": logprobs}
        (out_dir / "result.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
