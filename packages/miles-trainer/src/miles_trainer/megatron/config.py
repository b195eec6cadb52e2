"""Settings only the Megatron-core backend reads (`TrainerConfig.megatron`).

Importing this module needs neither megatron-core nor torch.distributed: a recipe validates
without the backend installed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TRANSFORMER_IMPLS", "MegatronConfig"]

TRANSFORMER_IMPLS = ("local", "transformer_engine")


@dataclass(kw_only=True, slots=True)
class MegatronConfig:
    """How megatron-core lays the policy out over the ranks of a torchrun job.

    The world size must be a multiple of ``tp * pp``; the remaining factor is data parallel
    (``dp = world / (tp * pp)``). Experts are split over ``ep`` ranks of the ``dp * tp`` ranks
    of a pipeline stage (Megatron's expert grid), each expert's matrices over ``etp``.

    Attributes:
        tp: tensor-parallel size (attention heads, MLP columns, vocabulary). >= 1; the query
            groups (``num_key_value_heads``) must divide by it.
        pp: pipeline-parallel stages; the decoder layers must divide by it. >= 1.
        ep: expert-parallel size (MoE models only). >= 1.
        etp: expert tensor-parallel size (each expert's matrices split over this many ranks);
            ``etp * ep`` must divide ``dp * tp``. >= 1.
        sequence_parallel: split the sequence over the TP ranks outside attention and MLP
            (activations of norms and residuals); needs ``tp > 1``.
        distributed_optimizer: Megatron's distributed optimizer: fp32 master weights and Adam
            moments sharded over the data-parallel ranks (ZeRO-1); False keeps them whole on
            every data-parallel rank.
        make_vocab_size_divisible_by: the vocabulary is padded to a multiple of this times
            ``tp`` (Megatron-LM's rule; miles-transfer's `megatron_layout` assumes 128).
            Padded rows carry no HF weight and their logits are masked out. >= 1.
        transformer_impl: "local" (megatron-core's own PyTorch layers: the only choice without
            Transformer Engine, e.g. on CPU) or "transformer_engine" (TE's fused layers; needs
            ``pip install transformer-engine`` and CUDA).
        moe_token_dispatcher: how tokens travel to their experts: "alltoall" or "allgather".
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    make_vocab_size_divisible_by: int = 128
    transformer_impl: str = "local"
    moe_token_dispatcher: str = "allgather"

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "etp", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MegatronConfig.{name} must be an integer >= 1, got {value!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "MegatronConfig.sequence_parallel needs tp > 1 (it splits the sequence over the "
                "tensor-parallel ranks); set tp >= 2 or sequence_parallel: false"
            )
        if self.ep > 1 and self.tp > 1 and not self.sequence_parallel:
            # megatron-core only warns, and its MoE layer then counts every token tp times.
            raise ValueError(
                "MegatronConfig: expert parallelism with tensor parallelism needs "
                "sequence_parallel: true (megatron-core's MoE layer requires it)"
            )
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(
                f"MegatronConfig.transformer_impl must be one of {TRANSFORMER_IMPLS}, got "
                f"{self.transformer_impl!r}"
            )
        if self.moe_token_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(
                "MegatronConfig.moe_token_dispatcher must be 'alltoall' or 'allgather', got "
                f"{self.moe_token_dispatcher!r}"
            )

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size / (tp * pp)``.

        Raises:
            ValueError: the world size is not a multiple of ``tp * pp``, or the expert grid
                ``etp * ep`` does not divide ``dp * tp``.
        """
        mp = self.tp * self.pp
        if world_size % mp:
            raise ValueError(
                f"{world_size} ranks cannot hold MegatronConfig tp={self.tp} x pp={self.pp}: "
                f"launch a multiple of {mp} processes (torchrun --nproc_per_node) or lower tp/pp"
            )
        dp = world_size // mp
        if (dp * self.tp) % (self.etp * self.ep):
            raise ValueError(
                f"MegatronConfig etp={self.etp} x ep={self.ep} must divide dp x tp = "
                f"{dp} x {self.tp} (the ranks of a pipeline stage)"
            )
        return dp
