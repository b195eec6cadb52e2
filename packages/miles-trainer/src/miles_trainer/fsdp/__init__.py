"""The FSDP2 backend: `FSDPTrainer` (``fsdp/trainer.py``) and its layout, checkpoint and
optimizer pieces. Importing this package stays light; ``miles_trainer.fsdp.trainer`` loads torch
distributed."""
