"""miles-rollout: an embedded CPU inference engine with SGLang's HTTP API, and the SGLang client."""

from miles_rollout.client import EngineClient, LocalEngineClient, SGLangClient, SGLangHTTPError
from miles_rollout.config import EngineConfig
from miles_rollout.engine import Engine
from miles_rollout.generate import MultiTurnGenerate, make_generate_fn
from miles_rollout.outputs import FinishReason, GenerateOutput
from miles_rollout.rollout import (
    RewardFn,
    RolloutResult,
    encode_prompt,
    generate_rollout,
    rollout_metrics,
)
from miles_rollout.sample import Sample, SampleStatus
from miles_rollout.sampling_params import SamplingParams
from miles_rollout.server import ServerHandle, serve
from miles_rollout.session import serve_sessions
from miles_rollout.tasks import ArithmeticTask
from miles_rollout.types import GenerateContext, GenerateFn, PromptItem, Task
from miles_rollout.version import __version__

__all__ = [
    "ArithmeticTask",
    "Engine",
    "EngineClient",
    "EngineConfig",
    "FinishReason",
    "GenerateContext",
    "GenerateFn",
    "GenerateOutput",
    "LocalEngineClient",
    "MultiTurnGenerate",
    "PromptItem",
    "RewardFn",
    "RolloutResult",
    "SGLangClient",
    "SGLangHTTPError",
    "Sample",
    "SampleStatus",
    "SamplingParams",
    "ServerHandle",
    "Task",
    "__version__",
    "encode_prompt",
    "generate_rollout",
    "make_generate_fn",
    "rollout_metrics",
    "serve",
    "serve_sessions",
]
