"""miles-trainer: the RL loss hub, advantage estimators, and policy trainers (FSDP2, Megatron).

Public surface: the configs (`TrainerConfig` and its nested parts), `TrainBatch`, the `Trainer`
protocol with `FSDPTrainer`, checkpoints (`CheckpointInfo`, `CheckpointError`, `export_hf`),
the contexts user hooks receive (`LossContext`, `AdvantageContext`, `GroupView`), and the loss
and advantage functions. Everything else lives
in the submodules (``miles_trainer.losses``, ``miles_trainer.advantages``, ...).
``TrainerConfig.build()`` makes the trainer of ``TrainerConfig.backend``. Importing the package
does not initialise ``torch.distributed`` or CUDA; constructing a trainer does.
"""

from miles_trainer.advantages import (
    AdvantageConfig,
    AdvantageContext,
    GroupView,
    OverlongConfig,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from miles_trainer.batch import TrainBatch
from miles_trainer.checkpoint import CheckpointError, CheckpointInfo, export_hf
from miles_trainer.config import (
    CriticConfig,
    OffloadConfig,
    QATConfig,
    ReferenceConfig,
    TrainerConfig,
)
from miles_trainer.fsdp.config import FSDPConfig
from miles_trainer.fsdp.trainer import FSDPTrainer
from miles_trainer.losses import LossConfig, LossContext, MismatchConfig, kl_estimate, policy_loss
from miles_trainer.trainer import NonFiniteError, Trainer
from miles_trainer.version import __version__

__all__ = [
    "AdvantageConfig",
    "AdvantageContext",
    "CheckpointError",
    "CheckpointInfo",
    "CriticConfig",
    "FSDPConfig",
    "FSDPTrainer",
    "GroupView",
    "LossConfig",
    "LossContext",
    "MismatchConfig",
    "NonFiniteError",
    "OffloadConfig",
    "OverlongConfig",
    "QATConfig",
    "ReferenceConfig",
    "TrainBatch",
    "Trainer",
    "TrainerConfig",
    "__version__",
    "export_hf",
    "grpo_advantages",
    "kl_estimate",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
]
