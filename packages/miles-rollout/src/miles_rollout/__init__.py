"""miles-rollout: an embedded CPU inference engine with SGLang's HTTP API, and the SGLang client."""

from miles_rollout.client import EngineClient, LocalEngineClient, SGLangClient, SGLangHTTPError
from miles_rollout.config import EngineConfig
from miles_rollout.engine import Engine
from miles_rollout.outputs import FinishReason, GenerateOutput
from miles_rollout.sampling_params import SamplingParams
from miles_rollout.server import ServerHandle, serve
from miles_rollout.version import __version__

__all__ = [
    "Engine",
    "EngineClient",
    "EngineConfig",
    "FinishReason",
    "GenerateOutput",
    "LocalEngineClient",
    "SGLangClient",
    "SGLangHTTPError",
    "SamplingParams",
    "ServerHandle",
    "__version__",
    "serve",
]
