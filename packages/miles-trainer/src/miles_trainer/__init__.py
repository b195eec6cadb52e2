"""miles-trainer: the RL loss hub, advantage estimators, and policy trainers (FSDP2, Megatron).

Public surface: the configs (`TrainerConfig` and its parts), `TrainBatch`, the `Trainer`
protocol and `FSDPTrainer`, and the loss and advantage functions. ``TrainerConfig.build()``
makes the trainer of ``TrainerConfig.backend``. Importing the package does not initialise
``torch.distributed`` or CUDA; constructing a trainer does.
"""

from miles_trainer.advantages import grpo_advantages, reinforce_pp_advantages
from miles_trainer.batch import TrainBatch
from miles_trainer.config import LossConfig, OffloadConfig, QATConfig, TrainerConfig
from miles_trainer.fsdp.config import FSDPConfig
from miles_trainer.fsdp.trainer import FSDPTrainer
from miles_trainer.losses import kl_estimate, policy_loss
from miles_trainer.trainer import Trainer
from miles_trainer.version import __version__

__all__ = [
    "FSDPConfig",
    "FSDPTrainer",
    "LossConfig",
    "OffloadConfig",
    "QATConfig",
    "TrainBatch",
    "Trainer",
    "TrainerConfig",
    "__version__",
    "grpo_advantages",
    "kl_estimate",
    "policy_loss",
    "reinforce_pp_advantages",
]
