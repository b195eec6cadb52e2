"""miles-trainer: RL losses, advantage estimators and an FSDP2 policy trainer.

Public surface: `LossConfig`, `QATConfig`, `TrainerConfig`, `TrainBatch`, `FSDPTrainer`,
`policy_loss`, `grpo_advantages`, `reinforce_pp_advantages`. Importing the package does not
initialise ``torch.distributed`` or CUDA; constructing an `FSDPTrainer` does.
"""

from miles_trainer._advantages import grpo_advantages, reinforce_pp_advantages
from miles_trainer._batch import TrainBatch
from miles_trainer._config import LossConfig, QATConfig, TrainerConfig
from miles_trainer._fsdp import FSDPTrainer
from miles_trainer._losses import kl_estimate, policy_loss
from miles_trainer.version import __version__

__all__ = [
    "FSDPTrainer",
    "LossConfig",
    "QATConfig",
    "TrainBatch",
    "TrainerConfig",
    "__version__",
    "grpo_advantages",
    "kl_estimate",
    "policy_loss",
    "reinforce_pp_advantages",
]
