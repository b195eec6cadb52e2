"""Engines behind the real sglang-router: ``FleetConfig(...).build()`` or ``miles-rollout fleet``.

    with FleetConfig(model_path="./ckpt", engines=2).build() as fleet:
        async with SGLangClient(fleet.url) as client:
            await client.generate(ids, routing_key="session-17")   # sticks to one engine/rank

The package README's "Fleet" section says what is verified how.
"""

from miles_rollout.fleet.config import FleetConfig
from miles_rollout.fleet.engines import StartupError
from miles_rollout.fleet.fleet import EngineHandle, Fleet, FleetEvent

__all__ = ["EngineHandle", "Fleet", "FleetConfig", "FleetEvent", "StartupError"]
