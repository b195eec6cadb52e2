"""The run configuration: component configs owned by their packages, plus the loop's own.

A recipe is a YAML file, a Python file with a ``recipe()`` function, or the name of a built-in
recipe (``miles/recipes/<name>.py``). It fills these dataclasses; unknown keys are errors.

YAML shape (every section optional except ``model_path``)::

    name: arith-tiny
    model_path: ~/.cache/miles/tiny-qwen3-arith
    engine:   {dtype: float32, max_running_requests: 128}     # miles_rollout.EngineConfig
    sampling: {temperature: 1.0, max_new_tokens: 8}           # miles_rollout.SamplingParams
    trainer:  {lr: 1e-4, loss: {clip_low: 0.2}}               # miles_trainer.TrainerConfig
    rollout:  {prompts_per_step: 16, n_samples_per_prompt: 8}
    task:     {name: arithmetic, params: {max_operand: 99}}
    transfer: {method: push, bucket_mb: 64, verify: true}   # push | p2p | delta | colocated
    run:      {num_steps: 60, save_every: 0}
    ray:      {trainer_ranks: 2, cpus_per_rank: 1}               # only under miles train --ray
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from miles._dataclass_build import build_dataclass, to_plain
from miles._overrides import parse_overrides
from miles.ray.settings import RaySettings
from miles_rollout import EngineConfig, SamplingParams
from miles_rollout.fleet import FleetConfig
from miles_trainer import TrainerConfig

__all__ = [
    "ColocatedSettings",
    "DeltaSettings",
    "EvalSettings",
    "P2PSettings",
    "RolloutSettings",
    "RunConfig",
    "RunSettings",
    "TaskSettings",
    "TransferSettings",
    "load_recipe",
]


ROLLOUT_MODES = ("sync", "async")
REWARD_ERROR_POLICIES = ("drop", "zero", "fail")  # as miles_rollout.reward's, without importing it
_POLICIES = ("keep", "retry", "drop", "reject")
_FALLBACKS = ("keep", "retry", "drop")


@dataclass(kw_only=True, slots=True)
class RolloutSettings:
    """How the loop uses the engines.

    Attributes:
        prompts_per_step: prompts per RL step (the rollout batch size).
        n_samples_per_prompt: samples per prompt (GRPO's group size G).
        max_concurrency: bound on generate requests in flight.
        engine_url: URL of an SGLang-compatible server or sglang-router; ``None`` runs the
            embedded engine in this process.
        generate_fn: how a sample is generated: ``"single_turn"`` (one generate call, the
            default), ``"multi_turn"`` (``agent`` talks to the policy through a TITO session
            server: exact token ids, tool and observation tokens masked out of the loss), or a
            dotted path to ``async generate(ctx: miles_rollout.GenerateContext, sample) ->
            sample``.
        agent: for ``multi_turn``: dotted path to ``async agent(base_url, sample, request) ->
            dict | None``; ``base_url`` is the session's OpenAI base URL.
        mode: ``"sync"``: each step generates its groups with the current weights, then
            trains. ``"async"``: the engines keep generating while the trainer trains; steps
            take completed groups from a bounded buffer (``miles.rollout.AsyncRollout``).
        buffer_capacity: async: completed groups the buffer holds before the producer stops
            starting new ones (default: two steps' worth). At least ``prompts_per_step``.
        max_staleness: async: the bound on a group's staleness, i.e. the trainer's version
            minus the oldest weight version that produced one of its tokens. 0 trains only on
            tokens of the trainer's current weights.
        staleness_policy: async: what happens to a group over the bound when a step takes it:
            ``"keep"`` it, ``"retry"`` (regenerate the prompt under current weights), ``"drop"``
            it; ``"reject"`` refuses it when it completes, before it enters the buffer; or a
            dotted path ``"pkg.module:fn"`` to ``fn(view: miles.rollout.GroupView) -> "keep" |
            "retry" | "drop"``.
        staleness_fallback: the decision when a user staleness function raises.
        max_drop_frac: stop the run when more than this share of a step's groups was dropped
            (a sample aborted or failed: engine errors, a reward function that raised).
        admission_pacing: async: start new prompts only while ``accepted + running <=
            (max_staleness + version + 1) * prompts_per_step`` (AReaL's rule), bounding
            staleness at admission instead of discarding slow groups. On by default: without
            it the producer runs a whole buffer ahead and the groups that age past the bound
            are thrown away (the demo dropped 23 groups per step of 16 trained).
        api_key: the engines' API key (``Authorization: Bearer``), sent by the rollout
            client, the weight pushes and the evaluation client, and given to a ``fleet``'s
            engines and router; ``null``: ``$MILES_API_KEY`` when set, else none. Never
            written to the run directory.
        request_timeout_s: the most seconds one generate request may take before it is
            abandoned (and retried); ``null``: no limit.
        max_retries: how many times a generate request that failed (connection error,
            timeout, HTTP 5xx, e.g. a dead engine behind the router or a full queue) is
            retried, with exponential backoff, before its sample fails (and its group is
            dropped, see ``max_drop_frac``). A 4xx (a bad request) is never retried.
    """

    prompts_per_step: int = 8
    n_samples_per_prompt: int = 8
    max_concurrency: int = 256
    engine_url: str | None = None
    generate_fn: str | None = None
    agent: str | None = None
    mode: str = "sync"
    buffer_capacity: int | None = None
    max_staleness: int = 1
    staleness_policy: str = "drop"
    staleness_fallback: str = "drop"
    admission_pacing: bool = True
    max_drop_frac: float = 0.5
    api_key: str | None = None
    request_timeout_s: float | None = 600.0
    max_retries: int = 2

    def __post_init__(self) -> None:
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(
                f"rollout.request_timeout_s must be > 0 (or null for none), got "
                f"{self.request_timeout_s}"
            )
        if self.max_retries < 0:
            raise ValueError(f"rollout.max_retries must be >= 0, got {self.max_retries}")
        if not 0.0 <= self.max_drop_frac <= 1.0:
            raise ValueError(f"rollout.max_drop_frac must be in [0, 1], got {self.max_drop_frac}")
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.n_samples_per_prompt < 2:
            raise ValueError(
                f"n_samples_per_prompt must be >= 2 (group-normalised advantages need a group), "
                f"got {self.n_samples_per_prompt}"
            )
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.mode not in ROLLOUT_MODES:
            raise ValueError(
                f"rollout.mode must be one of {list(ROLLOUT_MODES)}, got {self.mode!r}"
            )
        if self.buffer_capacity is None:
            self.buffer_capacity = 2 * self.prompts_per_step
        if self.buffer_capacity < self.prompts_per_step:
            raise ValueError(
                f"rollout.buffer_capacity ({self.buffer_capacity} groups) is smaller than one "
                f"step's batch (rollout.prompts_per_step={self.prompts_per_step}): the trainer "
                "could never get a full batch; raise it or leave it unset (two steps' worth)"
            )
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.staleness_policy not in _POLICIES and ":" not in self.staleness_policy:
            raise ValueError(
                f"rollout.staleness_policy must be one of {list(_POLICIES)} or a dotted path "
                f"'pkg.module:fn', got {self.staleness_policy!r}"
            )
        if self.staleness_fallback not in _FALLBACKS:
            raise ValueError(
                f"rollout.staleness_fallback must be one of {list(_FALLBACKS)}, got "
                f"{self.staleness_fallback!r}"
            )


@dataclass(kw_only=True, slots=True)
class TaskSettings:
    """Where prompts and rewards come from.

    Attributes:
        name: ``"arithmetic"`` (built in) or a dotted path ``"package.module:factory"`` to a
            callable that takes ``**params`` and returns an object with ``sample(n) ->
            list[PromptItem]`` and ``reward(response, label) -> float``.
        params: keyword arguments for the task.
        reward_fn: optional dotted path to ``fn(sample) -> float`` (sync or async) that
            replaces the task's reward (built in: ``miles.rewards:math_equivalence``,
            ``miles.rewards:exact_match``, ``miles.rewards:code_tests``).
        reward_timeout_s: a reward call that takes longer fails its sample with the reason
            (``null``: no deadline).
        reward_errors: what a reward function that raises (or times out, or returns NaN)
            does to its sample: ``"drop"`` (the sample fails and its group is dropped,
            ``rollout.max_drop_frac`` bounds how many), ``"zero"`` (reward 0.0, it trains) or
            ``"fail"`` (stop the run). Each failure is logged naming the function and the
            sample, and counted (``rollout/reward_errors``). A reward that is not a number
            stops the run under every policy.
    """

    name: str = "arithmetic"
    params: dict[str, Any] = field(default_factory=dict)
    reward_fn: str | None = None
    reward_timeout_s: float | None = 60.0
    reward_errors: str = "drop"

    def __post_init__(self) -> None:
        if self.reward_errors not in REWARD_ERROR_POLICIES:
            raise ValueError(
                f"task.reward_errors must be one of {list(REWARD_ERROR_POLICIES)}, got "
                f"{self.reward_errors!r}"
            )
        if self.reward_timeout_s is not None and not self.reward_timeout_s > 0:
            raise ValueError(
                f"task.reward_timeout_s must be > 0 (or null for none), got {self.reward_timeout_s}"
            )


TRANSFER_METHODS = ("push", "p2p", "delta", "colocated")
_P2P_TRANSPORTS = ("tcp", "shm")
_DELTA_ENCODINGS = ("xor", "overwrite")


@dataclass(kw_only=True, slots=True)
class P2PSettings:
    """``transfer.method: p2p``: every trainer rank sends its own shards, re-sharded on the way.

    Attributes:
        transport: between trainer ranks and the engine's receiver: ``"tcp"`` (any hosts) or
            ``"shm"`` (same host). One trainer process with the embedded engine uses none.
        host: the address this host's trainer ranks listen on (reachable by the receiver).
        agent: with ``rollout.engine_url``: ``"host:port"`` of a ``miles-transfer p2p-agent``
            already running beside the engine; ``null`` starts one on this host.
    """

    transport: str = "tcp"
    host: str = "127.0.0.1"
    agent: str | None = None

    def __post_init__(self) -> None:
        if self.transport not in _P2P_TRANSPORTS:
            raise ValueError(
                f"transfer.p2p.transport must be one of {list(_P2P_TRANSPORTS)}, got "
                f"{self.transport!r}"
            )
        if self.agent is not None:
            host, _, port = self.agent.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(
                    f"transfer.p2p.agent must be 'host:port' (what miles-transfer p2p-agent "
                    f"prints), got {self.agent!r}"
                )


@dataclass(kw_only=True, slots=True)
class DeltaSettings:
    """``transfer.method: delta``: publish disk deltas that the engines pull and apply.

    Attributes:
        dir: where versions ``weight_v{N:06d}/`` are published (``null``: ``weights/`` in the
            run directory). Engines read it, so it must be on their filesystem.
        local_dir: with ``rollout.engine_url``: where the engine host's copy of each version
            is materialized for ``update_weights_from_disk`` (``null``: ``<dir>/engine``).
        encoding: ``"xor"`` (smallest) or ``"overwrite"`` (idempotent).
        full_every: a full snapshot every this many versions (bounds the delta chain).
    """

    dir: str | None = None
    local_dir: str | None = None
    encoding: str = "xor"
    full_every: int = 10

    def __post_init__(self) -> None:
        if self.encoding not in _DELTA_ENCODINGS:
            raise ValueError(
                f"transfer.delta.encoding must be one of {list(_DELTA_ENCODINGS)}, got "
                f"{self.encoding!r}"
            )
        if self.full_every < 1:
            raise ValueError(f"transfer.delta.full_every must be >= 1, got {self.full_every}")


@dataclass(kw_only=True, slots=True)
class ColocatedSettings:
    """``transfer.method: colocated``: the engine shares the trainer's host (and GPUs); every
    trainer rank on an engine TP rank's GPU sends its own copy (CUDA IPC handles on GPU,
    shared memory on CPU) in one SGLang ``update_weights_from_tensor`` request.

    Attributes:
        allow_pickle_weights: the opt-in this method needs: its payloads are SGLang's torch
            pickles, which an engine must take only from a trusted sender. The embedded engine
            accepts them with this key (on a loopback server with a key of the run's own); an
            engine at ``rollout.engine_url`` needs its own opt-in (``miles-rollout serve
            --allow-pickle-weights``; SGLang always accepts them).
        handle_version: GPU: rewrite the version byte of CUDA IPC handles (``2`` for an engine
            on torch <= 2.12 when the trainer runs torch 2.13); ``null`` keeps torch's.
        check_handles: GPU: check every CUDA IPC payload with cuda-python before sending
            (``pip install 'miles-transfer[cuda]'``).
    """

    allow_pickle_weights: bool = False
    handle_version: int | None = None
    check_handles: bool = False

    def __post_init__(self) -> None:
        if self.handle_version is not None and not 0 <= self.handle_version <= 255:
            raise ValueError(
                f"transfer.colocated.handle_version must be a byte value (0-255) or null, got "
                f"{self.handle_version}"
            )


@dataclass(kw_only=True, slots=True)
class TransferSettings:
    """Weight sync from the trainer to the engines.

    Attributes:
        method: ``"push"``: gather full tensors, send buckets from rank 0 (every engine).
            ``"p2p"``: every trainer rank sends its own shards straight into the engine's
            layout (``p2p``). ``"delta"``: publish disk deltas the engines pull and apply
            before a swap-only pause (``delta``). ``"colocated"``: every trainer rank on the
            engine's GPUs shares its own copy with the engine's TP rank there, CUDA IPC handles
            on GPU, shared memory on CPU (``colocated``; one engine on this host).
        bucket_mb: bucket size in MiB for bucketed sends.
        verify: after every update, compare engine and trainer digests bit for bit.
        p2p: settings of the ``p2p`` method.
        delta: settings of the ``delta`` method.
        colocated: settings of the ``colocated`` method.
    """

    method: str = "push"
    bucket_mb: float = 64.0
    verify: bool = True
    p2p: P2PSettings = field(default_factory=P2PSettings)
    delta: DeltaSettings = field(default_factory=DeltaSettings)
    colocated: ColocatedSettings = field(default_factory=ColocatedSettings)

    def __post_init__(self) -> None:
        if self.method not in TRANSFER_METHODS:
            raise ValueError(
                f"transfer.method must be one of {list(TRANSFER_METHODS)}, got {self.method!r}"
            )
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.method == "colocated" and not self.colocated.allow_pickle_weights:
            raise ValueError(
                "transfer.method colocated sends SGLang's pickled update_weights_from_tensor "
                "payloads (CUDA IPC or shared-memory handles), which an engine must take only "
                "from a trusted sender: set transfer.colocated.allow_pickle_weights: true to opt "
                "in (an engine at rollout.engine_url also needs `miles-rollout serve "
                "--allow-pickle-weights`), or use transfer.method push"
            )


EVAL_MODES = ("none", "shared", "dedicated", "external")


@dataclass(kw_only=True, slots=True)
class EvalSettings:
    """Evaluation on held-out prompts every ``run.eval_every`` steps (also at step 0 and at the
    end); each result is a ``metrics.jsonl`` row ``{"step": s, "eval/...": ...}``.

    Attributes:
        mode: ``"shared"``: on the rollout engines, at the eval step (an async producer pauses
            new samples meanwhile). ``"dedicated"``: a separate engine loads a checkpoint
            snapshot in the background while training goes on (``eval/lag_steps`` says how
            late the result landed). ``"external"``: ``evaluator`` gets the snapshot's path.
            ``"none"``: no evaluation.
        num_prompts: held-out prompts (the task's ``heldout(n)`` when it has one).
        sampled_n: samples per prompt for ``eval/accuracy_sampled`` (at the recipe's sampling
            temperature); greedy decoding gives ``eval/accuracy_greedy``.
        evaluator: ``"pkg.module:fn"``, ``fn(checkpoint_dir: str) -> dict[str, float]`` (return
            ``None`` or raise ``miles.SkipEval`` to skip), for ``mode: external``.
        engine_url: ``dedicated``: an SGLang-compatible server to evaluate on instead of a
            second embedded engine (it must be able to read the snapshots' paths).
    """

    mode: str = "shared"
    num_prompts: int = 64
    sampled_n: int = 4
    evaluator: str | None = None
    engine_url: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in EVAL_MODES:
            raise ValueError(f"eval.mode must be one of {list(EVAL_MODES)}, got {self.mode!r}")
        if self.num_prompts < 1:
            raise ValueError(f"eval.num_prompts must be >= 1, got {self.num_prompts}")
        if self.sampled_n < 0:
            raise ValueError(f"eval.sampled_n must be >= 0, got {self.sampled_n}")
        if self.mode == "external" and not self.evaluator:
            raise ValueError(
                "eval.mode external needs eval.evaluator, a dotted path 'pkg.module:fn' to "
                "fn(checkpoint_dir) -> dict of metrics"
            )


@dataclass(kw_only=True, slots=True)
class RunSettings:
    """The loop itself.

    Attributes:
        num_steps: RL steps (rollout, train, weight update) to run.
        out_dir: run directory; ``None`` means ``runs/<name>-<timestamp>/``.
        save_every: write a resumable checkpoint (``trainer/step_<N>/``: model, optimizer,
            RNG states, the data position and the async buffer) every this many steps;
            ``miles train --resume RUN_DIR`` continues from the newest. 0: none (the final HF
            checkpoint is always written).
        keep_checkpoints: how many resumable checkpoints to keep (the newest).
        deterministic: reproducible runs on CPU (sync rollout): per-request sampling seeds
            from (``engine.seed``, step, group, sample), deterministic trainer kernels; a run
            stopped and resumed then matches the uninterrupted one bit for bit.
        tensorboard: log to TensorBoard too: ``null`` when it is installed, ``true``
            requires it (``pip install 'miles[tensorboard]'``), ``false`` never.
        wandb: log to Weights & Biases too (``pip install 'miles[wandb]'``).
        wandb_project: the W&B project.
        wandb_mode: ``"offline"`` (files under ``<run dir>/wandb``, no network; ``wandb sync``
            uploads them) or ``"online"``.
        plot_every: refresh the PNG reward curve every this many steps.
        progress: show a progress bar.
        eval_every: evaluate every this many steps, and at step 0 and at the end (``eval``
            section); 0 turns evaluation off.
        no_signal_steps: after this many steps in a row where at least 90% of the groups have
            zero reward variance (nothing to learn), warn with the likely causes (or stop, see
            ``no_signal_action``); 0 disables the check.
        no_signal_action: ``"warn"`` or ``"stop"``.
        dump_samples: write every trained sample to ``samples.jsonl`` in the run directory
            (``step``, ``tokens``, ``loss_mask`` and ``weight_versions`` per token (``null``
            where the policy did not generate it), ``staleness``, ``reward``), to audit a run.
    """

    num_steps: int = 60
    out_dir: str | None = None
    save_every: int = 0
    keep_checkpoints: int = 2
    deterministic: bool = False
    tensorboard: bool | None = None
    wandb: bool = False
    wandb_project: str = "miles"
    wandb_mode: str = "offline"
    plot_every: int = 10
    progress: bool = True
    eval_every: int = 0
    no_signal_steps: int = 5
    no_signal_action: str = "warn"
    dump_samples: bool = False

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {self.save_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"run.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.plot_every < 1:
            raise ValueError(f"plot_every must be >= 1, got {self.plot_every}")
        if self.wandb_mode not in ("offline", "online"):
            raise ValueError(
                f"run.wandb_mode must be 'offline' or 'online', got {self.wandb_mode!r}"
            )
        if self.no_signal_steps < 0:
            raise ValueError(f"run.no_signal_steps must be >= 0, got {self.no_signal_steps}")
        if self.no_signal_action not in ("warn", "stop"):
            raise ValueError(
                f"run.no_signal_action must be 'warn' or 'stop', got {self.no_signal_action!r}"
            )
        if self.eval_every < 0:
            raise ValueError(f"run.eval_every must be >= 0, got {self.eval_every}")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """A whole run. ``model_path`` is set once and shared by the engine and the trainer."""

    name: str
    model_path: str
    engine: EngineConfig
    sampling: SamplingParams
    trainer: TrainerConfig
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    task: TaskSettings = field(default_factory=TaskSettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    run: RunSettings = field(default_factory=RunSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    fleet: FleetConfig | None = None
    ray: RaySettings = field(default_factory=RaySettings)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Validate and build a config from a plain dict (see the module docstring)."""
        if not isinstance(data, dict):
            raise ValueError(f"a recipe must be a mapping of sections, got {type(data).__name__}")
        sections = (
            "engine",
            "sampling",
            "trainer",
            "rollout",
            "task",
            "transfer",
            "run",
            "eval",
            "fleet",
            "ray",
        )
        unknown = sorted(set(data) - {"name", "model_path", *sections})
        if unknown:
            raise ValueError(
                f"unknown recipe key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                f"valid top-level keys: name, model_path, {', '.join(sections)}"
            )
        if data.get("fleet") is not None and (data.get("rollout") or {}).get("engine_url"):
            raise ValueError(
                "set either fleet (start engines behind a router) or rollout.engine_url (use "
                "running engines), not both"
            )
        if not data.get("model_path"):
            raise ValueError("the recipe must set model_path (a local HF checkpoint directory)")
        model_path = os.path.expandvars(os.path.expanduser(str(data["model_path"])))
        name = str(data.get("name") or "run")
        for s in sections:
            if data.get(s) is not None and not isinstance(data[s], dict):
                raise ValueError(f"recipe section '{s}' must be a mapping, got {data[s]!r}")
        sec = {s: dict(data.get(s) or {}) for s in sections}
        return cls(
            name=name,
            model_path=model_path,
            engine=build_dataclass(EngineConfig, sec["engine"], "engine", model_path=model_path),
            sampling=build_dataclass(SamplingParams, sec["sampling"], "sampling"),
            trainer=build_dataclass(
                TrainerConfig, sec["trainer"], "trainer", model_path=model_path
            ),
            rollout=build_dataclass(RolloutSettings, sec["rollout"], "rollout"),
            task=build_dataclass(TaskSettings, sec["task"], "task"),
            transfer=build_dataclass(TransferSettings, sec["transfer"], "transfer"),
            run=build_dataclass(RunSettings, sec["run"], "run"),
            eval=build_dataclass(EvalSettings, sec["eval"], "eval"),
            fleet=(
                build_dataclass(FleetConfig, sec["fleet"], "fleet", model_path=model_path)
                if data.get("fleet") is not None
                else None
            ),
            ray=build_dataclass(RaySettings, sec["ray"], "ray"),
        )

    def __post_init__(self) -> None:
        t = self.trainer
        if t.lr_decay_style != "constant" and t.lr_decay_steps is None:
            # Decay over the whole run: every optimizer step after the warm-up.
            t.lr_decay_steps = max(self.run.num_steps * t.num_minibatches - t.lr_warmup_steps, 1)
        if self.run.deterministic:
            if self.rollout.mode != "sync":
                raise ValueError(
                    "run.deterministic needs rollout.mode sync (async scheduling depends on timing)"
                )
            self.trainer.deterministic = True
        if self.transfer.method == "colocated" and self.fleet is not None:
            raise ValueError(
                "transfer.method colocated updates one engine on the trainer's host (the "
                "embedded engine or rollout.engine_url), not a fleet behind a router: remove "
                "the fleet section, or use transfer.method push (every engine of the fleet)"
            )

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data (written to the run directory)."""
        d = to_plain(self)
        for section in ("rollout", "fleet"):  # secrets stay out of config.yaml
            if (d.get(section) or {}).get("api_key") is not None:
                d[section]["api_key"] = "<redacted>"
        d["engine"].pop("model_path", None)
        d["trainer"].pop("model_path", None)
        if d.get("fleet") and str(d["fleet"].get("launcher")).startswith("miles.ray."):
            # Placed by `miles train --ray` for this run only: a resumed run is placed by its
            # own command line (with or without --ray).
            d["fleet"]["launcher"], d["fleet"]["launcher_args"] = None, {}
        return d


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {key}: '{p}' is not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides; values are parsed as YAML (``1e-4``, ``true``)."""
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value)
    return data


def _load_python_recipe(path: Path) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location(f"_miles_recipe_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import recipe file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(
            f"recipe file {path} failed to import: {_where(e, path)}; fix the file (miles "
            "train --debug ... shows the traceback)"
        ) from e
    fn = getattr(module, "recipe", None)
    if not callable(fn):
        raise ValueError(f"recipe file {path} must define a function recipe() returning a dict")
    try:
        data = fn()
    except Exception as e:
        raise ValueError(
            f"recipe() in {path} raised {_where(e, path)}; fix the recipe (miles train --debug "
            "... shows the traceback)"
        ) from e
    if not isinstance(data, dict):
        raise ValueError(f"recipe() in {path} must return a dict, got {type(data).__name__}")
    return data


def _where(e: BaseException, path: Path) -> str:
    """``Type: message (line N)``, with the deepest line of ``path`` in the traceback."""
    import traceback

    line = None
    for frame in traceback.extract_tb(e.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = frame.lineno
    if isinstance(e, SyntaxError) and e.lineno is not None:
        line = e.lineno
    at = f" at line {line}" if line is not None else ""
    return f"{type(e).__name__}: {e}{at}"


def _importable(*dirs: Path) -> None:
    """Let dotted paths in a recipe (``task.name``, ``task.reward_fn``, ...) name modules in the
    recipe's directory or the working directory. Appended to ``sys.path``, so an installed
    package of the same name still wins."""
    for d in dirs:
        entry = str(d.resolve())
        if entry not in sys.path:
            sys.path.append(entry)
    importlib.invalidate_caches()


def builtin_recipes() -> list[str]:
    """Names of the built-in recipes (``miles train <name>``)."""
    folder = Path(__file__).parent / "recipes"
    return sorted(p.stem.replace("_", "-") for p in folder.glob("[!_]*.py"))


def load_recipe(spec: str, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a recipe by built-in name, YAML path or Python path, apply overrides, validate.

    Raises:
        FileNotFoundError: the recipe file does not exist.
        ValueError: malformed recipe, unknown key, bad value (the message names it).
    """
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".py"):
        if not path.is_file():
            raise FileNotFoundError(f"recipe file not found: {path}")
        _importable(path.parent, Path.cwd())
        if path.suffix == ".py":
            data = _load_python_recipe(path)
        else:
            try:
                data = yaml.safe_load(path.read_text())
            except yaml.YAMLError as e:
                raise ValueError(f"recipe {path} is not valid YAML: {e}") from e
            if data is None:
                data = {}
    elif spec in builtin_recipes():
        module = importlib.import_module(f"miles.recipes.{spec.replace('-', '_')}")
        data = module.recipe()
    else:
        raise ValueError(
            f"unknown recipe {spec!r}: give a .yaml or .py file or one of the built-in recipes: "
            f"{', '.join(builtin_recipes())}"
        )
    if not isinstance(data, dict):
        raise ValueError(f"recipe {spec} must be a mapping of sections, got {type(data).__name__}")
    data.setdefault("name", path.stem if path.suffix else spec)
    return RunConfig.from_dict(apply_overrides(data, overrides))
