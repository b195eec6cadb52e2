"""Rank 0's rollout side of the loop: engines, the synchronous and asynchronous sources."""

from miles.rollout.asynchronous import AsyncRollout
from miles.rollout.batch import build_train_batch
from miles.rollout.buffer import GroupView
from miles.rollout.engines import RolloutEngines
from miles.rollout.sync import SyncRollout

__all__ = ["AsyncRollout", "GroupView", "RolloutEngines", "SyncRollout", "build_train_batch"]
