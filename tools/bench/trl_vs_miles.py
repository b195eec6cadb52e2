"""End-to-end GRPO step time: ``miles train`` vs TRL's ``GRPOTrainer``, same work, same run.

Why: TRL's GRPOTrainer is the RL trainer most people would reach for instead of miles, so it is
our named peer. This script runs both on the same checkpoint, prompts, reward and settings, one
after the other and interleaved (miles, TRL, TRL, miles, ...), and reports per-step wall time,
completions per second and the miles speed-up (TRL s/step / miles s/step). The machine is
shared and noisy, so only ratios measured in one run mean anything.

What is held equal on both sides: the model directory (a tiny Qwen3 from
``tools/make_tiny_model.py``), the arithmetic prompts (``ArithmeticTask(seed=1)``, the same
prompts in the same order at every step), the exact-match reward, 8 prompts x 8 samples per
step (64 completions; TRL counts them in ``per_device_train_batch_size=64``), completions of
exactly ``--tokens`` tokens (miles ``ignore_eos``, TRL ``min_new_tokens``), temperature 1.0 with
no top-k/top-p, the learning rate, one optimizer step per batch with no old-logprob pass (TRL
``num_iterations=1`` skips it; miles ``trainer.loss.use_rollout_logprobs=true``), no KL (beta 0),
clip 0.2/0.28, fp32, no checkpoints or logging inside the timed steps. Each side runs in its own
process: miles through ``.venv/bin/miles train``, TRL in ``.venv-bench``
(``tools/bench/setup_trl_venv.sh``) so its dependencies cannot disturb ours.

Timing: per-step wall time from step 2 on (step 1 is warm-up; process start-up, model loading
and the final checkpoint are excluded). miles reports ``time_step_s`` (and its rollout / train /
weight-update split) in ``metrics.jsonl``; TRL is timed by a callback between consecutive step
ends, with its generate-and-score call timed separately. The table gives the median step and,
in parentheses, the ratio of the best steps (the least disturbed ones on a shared machine).

Workloads: ``demo`` is the demo policy (0.40M params) with 8-token completions; ``gen`` is a
10.4M-parameter Qwen3 (random weights, the demo's tokenizer) with 64-token completions.

Threads: ``--threads 1`` gives each side one torch thread; with two threads on two cores, any
other process on the machine stalls torch's OpenMP barriers and the side with more small ops
(HF ``generate``) slows down by up to 10x, so two-thread figures are only meaningful on an
otherwise idle machine (the 1-minute load average after each run is printed and recorded).

Precision: both sides fp32 by default (the issue's TRL settings). ``--miles-set
engine.dtype=bfloat16 --miles-set trainer.dtype=bfloat16`` runs miles in bf16 (fp32 master
weights); ``--trl-bf16`` runs TRL with its own ``bf16=True`` (CPU autocast), for an honest
bf16-vs-bf16 row. PYTHONPATH reaches the miles side only (to time another checkout's sources).

Laptop:   tools/bench/setup_trl_venv.sh                                 # once, ~1-4 min
          .venv/bin/python tools/bench/trl_vs_miles.py --threads 1    # both workloads, 5-10 min
          .venv/bin/python tools/bench/trl_vs_miles.py --workload demo --repeats 3
Cluster:  not meant for GPUs (both sides run with the CPU settings TRL documents).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROMPTS_PER_STEP = 8
SAMPLES_PER_PROMPT = 8
TASK_PARAMS = {"max_operand": 99, "ops": "+", "seed": 1}  # the arith-tiny recipe's task
LR = 2e-4  # the arith-tiny recipe's learning rate
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
ADAM_EPS = 1e-6

# name -> (model spec overrides for tools/make_tiny_model.py or None for the demo policy,
#          completion tokens, default steps)
WORKLOADS: dict[str, dict[str, Any]] = {
    "demo": {"model": None, "tokens": 8, "steps": 21},
    "gen": {
        "model": {
            "hidden_size": 384,
            "intermediate_size": 1152,
            "num_layers": 6,
            "num_heads": 6,
            "num_kv_heads": 2,
            "sft_steps": 0,
        },
        "tokens": 64,
        "steps": 9,
    },
}


# ---------------------------------------------------------------------------------------------
# TRL side: runs inside .venv-bench (only the standard library is imported at module level).


def _trl_worker(spec_path: str) -> int:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    tokens, steps = spec["tokens"], spec["steps"]
    rows = [{"prompt": p["messages"], "label": p["label"]} for p in spec["prompts"]]
    assert len(rows) == steps * PROMPTS_PER_STEP

    def exact_match(completions: list[Any], label: list[int], **_: Any) -> list[float]:
        # The same rule as miles_rollout.tasks.ArithmeticTask.reward.
        out = []
        for c, lab in zip(completions, label):
            text = (c[0]["content"] if isinstance(c, list) else c).strip()
            digits = text[1:] if text.startswith("-") else text
            out.append(1.0 if digits.isdigit() and int(text) == int(lab) else 0.0)
        return out

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.begin = 0.0

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=spec["bf16"],  # the setting is False; --trl-bf16 measures True
            fp16=False,
            use_vllm=False,
            gradient_checkpointing=False,
            model_init_kwargs={"dtype": torch.float32},
            per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES_PER_PROMPT,
            num_generations=SAMPLES_PER_PROMPT,
            gradient_accumulation_steps=1,
            num_iterations=1,
            max_steps=steps,
            max_completion_length=tokens,
            generation_kwargs={"min_new_tokens": tokens},
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            adam_epsilon=ADAM_EPS,
            max_grad_norm=1.0,
            beta=0.0,
            epsilon=CLIP_LOW,
            epsilon_high=CLIP_HIGH,
            loss_type="dapo",  # token mean over the batch, as miles' "token-mean"
            shuffle_dataset=False,  # prompts in the order miles sees them
            seed=0,
            logging_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        clock = StepClock()
        t_load = time.perf_counter()
        trainer = GRPOTrainer(
            model=spec["model_path"],
            reward_funcs=exact_match,
            args=config,
            train_dataset=Dataset.from_list(rows),
            callbacks=[clock],
        )
        t_load = time.perf_counter() - t_load
        gen_s: list[float] = []
        lengths: list[float] = []
        rewards: list[float] = []
        inner = trainer._generate_and_score_completions

        def timed(inputs: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(inputs)
            gen_s.append(time.perf_counter() - t0)
            lengths.append(float(out["completion_mask"].sum(dim=1).float().mean()))
            rewards.append(float(trainer._metrics["train"]["reward"][-1]))
            return out

        trainer._generate_and_score_completions = timed  # type: ignore[method-assign]
        trainer.train()
    marks = [clock.begin, *clock.ends]
    result = {
        "step_s": [b - a for a, b in itertools.pairwise(marks)],
        "rollout_s": gen_s,
        "response_len_mean": lengths,
        "reward_mean": rewards,
        "load_s": t_load,
        "threads": torch.get_num_threads(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
        },
    }
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------
# Driver: runs in miles' .venv.


def _model_dir(workload: str) -> Path:
    sys.path.insert(0, str(ROOT / "tools"))
    import make_tiny_model as mtm

    overrides = WORKLOADS[workload]["model"]
    if overrides is None:
        return mtm.ensure(quiet=True)
    spec = mtm.TinyModelSpec(**overrides)
    h, n = spec.hidden_size, spec.num_layers
    return mtm.ensure(spec, mtm.default_cache_dir() / f"bench-qwen3-h{h}-l{n}", quiet=True)


def _param_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            n = 1
            for d in f.get_slice(name).get_shape():
                n *= int(d)
            total += n
    return total


def _prompts(steps: int) -> list[dict[str, Any]]:
    from miles_rollout.tasks import ArithmeticTask

    task = ArithmeticTask(**TASK_PARAMS)
    return [
        {"messages": item.messages, "label": int(item.label)}
        for item in task.sample(steps * PROMPTS_PER_STEP)
    ]


def _env(threads: int | None, *, keep_pythonpath: bool) -> dict[str, str]:
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    if not keep_pythonpath:  # TRL's venv must not see our sources
        env.pop("PYTHONPATH", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def _run_miles(
    model_dir: Path, tokens: int, steps: int, work: Path, extra: list[str], env: dict[str, str]
) -> dict[str, Any]:
    out = work / "run"
    sets = [
        f"model_path={model_dir}",
        f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
        f"rollout.n_samples_per_prompt={SAMPLES_PER_PROMPT}",
        f"sampling.max_new_tokens={tokens}",
        "sampling.ignore_eos=true",
        "sampling.temperature=1.0",
        f"trainer.lr={LR}",
        f"trainer.eps={ADAM_EPS}",
        f"trainer.micro_batch_size={PROMPTS_PER_STEP * SAMPLES_PER_PROMPT}",
        f"trainer.loss.clip_low={CLIP_LOW}",
        f"trainer.loss.clip_high={CLIP_HIGH}",
        "trainer.loss.kl_coef=0.0",
        "trainer.loss.use_rollout_logprobs=true",
        *(f"task.params.{k}={v}" for k, v in TASK_PARAMS.items() if k != "ops"),
        "run.tensorboard=false",
        "run.plot_every=1000000",
        "run.save_every=0",
        *extra,
    ]
    cmd = [str(ROOT / ".venv/bin/miles"), "train", "arith-tiny", "--steps", str(steps)]
    cmd += ["--out", str(out), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"miles failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "step_s": [r["time/step_s"] for r in recs],
        "rollout_s": [r["time/rollout_s"] for r in recs],
        "train_s": [r["time/train_s"] for r in recs],
        "update_s": [r["time/update_s"] for r in recs],
        "response_len_mean": [r["rollout/response_len_mean"] for r in recs],
        "reward_mean": [r["rollout/reward_mean"] for r in recs],
        "wall_s": wall,
        "cmd": cmd,
    }


def _run_trl(
    python: Path,
    model_dir: Path,
    tokens: int,
    steps: int,
    work: Path,
    env: dict[str, str],
    *,
    bf16: bool = False,
) -> dict[str, Any]:
    spec = {
        "model_path": str(model_dir),
        "tokens": tokens,
        "steps": steps,
        "prompts": _prompts(steps),
        "result_path": str(work / "trl_result.json"),
        "bf16": bf16,
    }
    spec_path = work / "trl_spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [str(python), str(Path(__file__).resolve()), "--trl-worker", str(spec_path)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"TRL failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(Path(spec["result_path"]).read_text())
    result["wall_s"] = wall
    result["train_s"] = [s - g for s, g in zip(result["step_s"], result["rollout_s"])]
    return result


def _steady(runs: list[dict[str, Any]], key: str, warmup: int) -> list[float]:
    return [x for r in runs for x in r[key][warmup:]]


def _summary(runs: list[dict[str, Any]], keys: list[str], warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in keys:
        xs = _steady(runs, k, warmup)
        out[k] = {
            "median": statistics.median(xs),
            "mean": statistics.fmean(xs),
            "min": min(xs),
            "n": len(xs),
        }
    out["per_run_median_step_s"] = [statistics.median(r["step_s"][warmup:]) for r in runs]
    return out


def _git_state() -> str:
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "packages"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return rev + ("+dirty(packages)" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    p.add_argument(
        "--steps", type=int, help="steps per run, warm-up included (default: per workload)"
    )
    p.add_argument("--repeats", type=int, default=2, help="runs of each side, interleaved")
    p.add_argument("--warmup", type=int, default=1, help="leading steps excluded from timing")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for both sides (default: torch's, one per core); 1 is far less "
        "sensitive to other processes on a shared machine",
    )
    p.add_argument("--trl-python", type=Path, default=ROOT / ".venv-bench/bin/python")
    p.add_argument(
        "--trl-bf16",
        action="store_true",
        help="TRL with its own bf16=True (CPU autocast) instead of the issue's bf16=False",
    )
    p.add_argument(
        "--miles-set", action="append", default=[], help="extra miles --set override (repeatable)"
    )
    p.add_argument("--out", type=Path, help="write results.json here (default: runs/bench-...)")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_worker:
        return _trl_worker(args.trl_worker)
    if not args.trl_python.is_file():
        raise SystemExit(
            f"{args.trl_python} not found: run tools/bench/setup_trl_venv.sh first (it makes "
            ".venv-bench with TRL), or pass --trl-python"
        )
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    out_dir = args.out or ROOT / "runs" / f"bench-trl-vs-miles-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "git": _git_state(),
        "cpus": os.cpu_count(),
        "argv": sys.argv,
        "workloads": {},
    }
    # PYTHONPATH reaches the miles side only (to benchmark another checkout's sources).
    env = _env(args.threads, keep_pythonpath=True)
    trl_env = _env(args.threads, keep_pythonpath=False)
    report["threads"] = args.threads
    report["trl_bf16"] = args.trl_bf16
    rows = []
    for name in names:
        wl = WORKLOADS[name]
        steps = args.steps or wl["steps"]
        if steps <= args.warmup:
            raise SystemExit(f"--steps ({steps}) must exceed --warmup ({args.warmup})")
        model_dir = _model_dir(name)
        params = _param_count(model_dir)
        print(f"[{name}] model {model_dir} ({params / 1e6:.2f}M params), {wl['tokens']} tokens")
        runs: dict[str, list[dict[str, Any]]] = {"miles": [], "trl": []}
        for r in range(args.repeats):
            order = ["miles", "trl"] if r % 2 == 0 else ["trl", "miles"]
            for side in order:
                work = out_dir / name / f"{side}-{r}"
                work.mkdir(parents=True, exist_ok=True)
                load_before = os.getloadavg()[0]
                if side == "miles":
                    res = _run_miles(model_dir, wl["tokens"], steps, work, args.miles_set, env)
                else:
                    res = _run_trl(
                        args.trl_python,
                        model_dir,
                        wl["tokens"],
                        steps,
                        work,
                        trl_env,
                        bf16=args.trl_bf16,
                    )
                res["loadavg_1m_before"] = load_before
                res["loadavg_1m_after"] = os.getloadavg()[0]
                lens = set(res["response_len_mean"])
                if lens != {float(wl["tokens"])}:
                    raise RuntimeError(f"{side} made completions of mean length {lens}")
                med = statistics.median(res["step_s"][args.warmup :])
                print(
                    f"  {side:5s} run {r}: {med:.3f} s/step (median), wall {res['wall_s']:.1f}s, "
                    f"load {load_before:.1f} -> {res['loadavg_1m_after']:.1f}"
                )
                runs[side].append(res)
        m = _summary(runs["miles"], ["step_s", "rollout_s", "train_s", "update_s"], args.warmup)
        t = _summary(runs["trl"], ["step_s", "rollout_s", "train_s"], args.warmup)
        completions = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
        ms, ts = m["step_s"]["median"], t["step_s"]["median"]
        row = {
            "workload": name,
            "params_M": round(params / 1e6, 2),
            "tokens": wl["tokens"],
            "steps": steps,
            "timed_steps_per_side": m["step_s"]["n"],
            "miles_s_per_step": ms,
            "trl_s_per_step": ts,
            "miles_speedup": ts / ms,
            # Best step of each side: on a shared machine, the least disturbed one.
            "miles_speedup_best": t["step_s"]["min"] / m["step_s"]["min"],
            "miles_completions_per_s": completions / ms,
            "trl_completions_per_s": completions / ts,
            "miles_split_s": {k: m[k]["median"] for k in ("rollout_s", "train_s", "update_s")},
            "trl_split_s": {k: t[k]["median"] for k in ("rollout_s", "train_s")},
        }
        rows.append(row)
        report["workloads"][name] = {
            "model_dir": str(model_dir),
            "summary": row,
            "miles": m,
            "trl": t,
            "runs": runs,
        }
        trl_versions = runs["trl"][0]["versions"]
        report["trl_versions"] = trl_versions
        report["trl_threads"] = runs["trl"][0]["threads"]
    (out_dir / "results.json").write_text(json.dumps(report, indent=1))
    print(f"\nresults: {out_dir / 'results.json'}  (git {report['git']}, {report['date']})")
    print(
        "| workload | steps (timed) | miles s/step | TRL s/step | miles speed-up (best) "
        "| completions/s miles | completions/s TRL | miles rollout / train / update s "
        "| TRL generate / train s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        sp, tp = row["miles_split_s"], row["trl_split_s"]
        print(
            f"| {row['workload']} ({row['params_M']}M, {row['tokens']} tok) "
            f"| {row['steps']} ({row['timed_steps_per_side']}) "
            f"| {row['miles_s_per_step']:.3f} | {row['trl_s_per_step']:.3f} "
            f"| {row['miles_speedup']:.2f}x ({row['miles_speedup_best']:.2f}x) "
            f"| {row['miles_completions_per_s']:.0f} "
            f"| {row['trl_completions_per_s']:.0f} "
            f"| {sp['rollout_s']:.3f} / {sp['train_s']:.3f} / {sp['update_s']:.3f} "
            f"| {tp['rollout_s']:.3f} / {tp['train_s']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
