"""How the trainer's weights reach the engines after each step (``transfer.method``)."""

from miles.weight_sync.push import PushSync

__all__ = ["PushSync"]
