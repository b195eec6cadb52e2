"""Per-request sampling parameters, with SGLang's names and conventions."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["SamplingParams"]

# SGLang sampling fields the embedded engine does not implement. A request may carry them with
# their neutral value (the sglang-router re-serialises requests and may add them); any other
# value is rejected instead of being silently ignored, which would change results.
_NEUTRAL_SGLANG_FIELDS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "custom_params": None,
    "stream_interval": None,
    "logit_bias": None,
}

# SGLang calls the per-request seed ``sampling_seed``.
_ALIASES = {"sampling_seed": "seed"}


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample one request.

    Attributes:
        temperature: divides the logits before sampling; ``0`` means greedy (argmax).
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches
            ``top_p``; ``1.0`` is off.
        top_k: keep the ``top_k`` most likely tokens; ``-1`` is off; ``1`` is greedy.
        min_p: drop tokens whose probability is below ``min_p`` times the top probability;
            ``0.0`` is off.
        max_new_tokens: the most tokens to generate; ``None`` means up to the context
            length. A value that would overrun the context length is shortened to fit
            (SGLang does the same), and the request then ends with finish reason
            ``length``.
        stop_token_ids: tokens that end the request (the token is kept in the output).
            The model's EOS tokens also stop, unless ``ignore_eos`` is set.
        stop: strings that end the request once the decoded output contains one of them
            (needs a tokenizer). The tokens stay in ``output_ids``; ``text`` is cut before
            the string.
        ignore_eos: do not stop at the model's EOS tokens (``stop_token_ids`` still stop).
        seed: makes this request's sampling reproducible: the same seed, prompt, parameters
            and weights give the same tokens whatever else is in the batch. ``None`` draws
            a seed from the engine's seeded random stream. On the wire SGLang calls this
            ``sampling_seed``.

    Logprobs do not depend on ``top_k`` / ``top_p`` / ``min_p``: they are
    ``log_softmax(logits / temperature)`` (temperature 1 when greedy), see the contract in
    ``docs/architecture.md``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int | None = 128
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or at least 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_new_tokens is not None and (
            not _is_int(self.max_new_tokens) or self.max_new_tokens < 0
        ):
            raise ValueError(
                f"max_new_tokens must be None or an integer >= 0, got {self.max_new_tokens!r}"
            )
        bad_ids = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad_ids:
            raise ValueError(f"stop_token_ids must be non-negative integers, got {bad_ids}")
        bad_stops = [s for s in self.stop if not isinstance(s, str) or not s]
        if bad_stops:
            raise ValueError(f"stop must hold non-empty strings, got {bad_stops}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an integer, got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax token (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Build from a JSON-style dict with SGLang's field names.

        ``None`` values mean "default" (as in SGLang). SGLang fields the engine does not
        implement are accepted only with their neutral value.

        Raises:
            ValueError: unknown keys (named in the message), unsupported SGLang features, or
                invalid values.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params must be a JSON object, got {type(d).__name__}")
        own = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        unknown: list[str] = []
        unsupported: list[str] = []
        for raw_key, value in d.items():
            key = _ALIASES.get(raw_key, raw_key)
            if key in own:
                if value is not None or key in ("max_new_tokens", "seed"):
                    if key in kwargs:
                        raise ValueError(f"sampling_params sets {key!r} twice ({raw_key!r})")
                    kwargs[key] = value
            elif key in _NEUTRAL_SGLANG_FIELDS:
                neutral = _NEUTRAL_SGLANG_FIELDS[key]
                if value is not None and value != neutral and value != [] and value != {}:
                    unsupported.append(f"{key}={value!r} (only {neutral!r} is supported)")
            else:
                unknown.append(raw_key)
        if unknown:
            raise ValueError(
                f"unknown sampling_params keys: {sorted(unknown)}; known keys: "
                f"{sorted(own | set(_ALIASES))}"
            )
        if unsupported:
            raise ValueError(
                "sampling_params not supported by the miles-rollout engine: "
                + ", ".join(unsupported)
            )
        if "stop_token_ids" in kwargs and not isinstance(kwargs["stop_token_ids"], list):
            raise ValueError("stop_token_ids must be a list of integers")
        if "stop" in kwargs and not isinstance(kwargs["stop"], (str, list)):
            raise ValueError("stop must be a string or a list of strings")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-style dict with SGLang's field names (``seed`` becomes ``sampling_seed``).

        Fields at their default are left out, so a real SGLang server sees only what was set.
        """
        out: dict[str, Any] = {}
        default = SamplingParams()
        for f in fields(self):
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                out["sampling_seed" if f.name == "seed" else f.name] = value
        return out


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
