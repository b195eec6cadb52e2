"""The ``miles`` command line.

    miles train RECIPE [--set section.key=value ...] [--steps N] [--out DIR] [--ray [ADDRESS]]
    miles recipes
    miles plot RUN_DIR
    miles env check [DIR] [--policy oracle|noop] [--json]   (needs miles[env])

RECIPE is a built-in name (``arith-tiny``), a YAML file or a Python file with ``recipe()``.
Mistakes in the input (missing or damaged checkpoint, malformed recipe or ``--set`` value,
unknown key, a recipe() that raises, prompt longer than the context, a task or reward function
that breaks its contract, an engine that cannot be reached or serves another model, a full
disk) print one line naming the problem and exit with status 2; ``--debug`` shows the
traceback. A run stopped by its guards exits 1. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys
from pathlib import Path

__all__ = ["main"]

EXIT_USAGE = 2


def _train(args: argparse.Namespace) -> int:
    from miles import require_components
    from miles._overrides import parse_overrides

    parse_overrides(args.set or [])  # a typo is reported now, not after the components load

    require_components("miles train")
    from miles.config import load_recipe
    from miles.loop import RunResult, train

    overrides = list(args.set or [])
    if args.steps is not None:
        overrides.append(f"run.num_steps={args.steps}")
    if args.no_progress:
        overrides.append("run.progress=false")
    recipe = args.recipe
    if args.resume is not None:
        if recipe is not None or args.out is not None:
            raise ValueError(
                "--resume RUN_DIR continues that run with its own recipe (RUN_DIR/config.yaml): "
                "give neither a recipe nor --out"
            )
        run_dir = Path(args.resume)
        recipe = str(run_dir / "config.yaml")
        if not Path(recipe).is_file():
            raise FileNotFoundError(f"{run_dir} is not a miles run directory (no config.yaml)")
        overrides.append(f"run.out_dir={run_dir}")
    elif recipe is None:
        hint = ""
        if args.ray:  # `miles train --ray arith-tiny`: argparse took the recipe as the address
            hint = f"; --ray took {args.ray!r} as the Ray address: write the recipe before --ray"
        raise ValueError(f"give a recipe (see `miles recipes`) or --resume RUN_DIR{hint}")
    elif args.out is not None:
        overrides.append(f"run.out_dir={args.out}")
    cfg = load_recipe(recipe, overrides)
    _quiet_libraries()
    result: RunResult | None
    if args.ray is not None:
        from miles.ray import launch

        result = launch(cfg, address=args.ray or None, resume=args.resume is not None)
    else:
        result = train(cfg, resume=args.resume is not None)
    if result is not None:
        print(f"run directory: {result.run_dir}")
        print(f"  metrics:     {result.metrics_path}")
        print(f"  reward plot: {result.plot_path}")
        print(f"  checkpoint:  {result.final_checkpoint}")
    return 0


def _quiet_libraries() -> None:
    """Keep the terminal for the loop's own progress bar (no per-load bars from transformers)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def recipe_description(name: str) -> str:
    """The first line of a built-in recipe's docstring, without its ``name:`` prefix."""
    import importlib

    module = importlib.import_module(f"miles.recipes.{name.replace('-', '_')}")
    first = (module.__doc__ or "").strip().splitlines()[:1]
    line = first[0] if first else ""
    return line.removeprefix(f"{name}:").strip()


def _recipes(_: argparse.Namespace) -> int:
    from miles.config import builtin_recipes

    names = builtin_recipes()
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name:<{width}}  {recipe_description(name)}".rstrip())
    return 0


def _plot(args: argparse.Namespace) -> int:
    from miles._runlog import plot_reward_curve

    run_dir = Path(args.run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} not found: is {run_dir} a miles run directory?")
    print(plot_reward_curve(metrics, run_dir / "reward_curve.png"))
    return 0


def _env(args: argparse.Namespace) -> int:
    """``miles env ...``: the miles-env command line (sandboxes, Harbor task checks)."""
    try:
        from miles_env.cli import main as env_main
    except ImportError as e:
        raise ImportError("miles env needs miles-env: pip install 'miles[env]'") from e
    return env_main((["--help"] if args.env_help else []) + list(args.env_args), prog="miles env")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    p = argparse.ArgumentParser(prog="miles", description="RL post-training for LLMs.")
    p.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run RL training from a recipe")
    t.add_argument("recipe", nargs="?", help="built-in recipe name, or a .yaml / .py recipe file")
    t.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a recipe value, e.g. --set trainer.lr=1e-4 (repeatable)",
    )
    t.add_argument("--steps", type=int, help="shorthand for --set run.num_steps=N")
    t.add_argument("--out", help="run directory (default runs/<name>-<timestamp>)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its newest checkpoint (run.save_every); --steps sets the new "
        "total",
    )
    t.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="place the trainer ranks (ray.trainer_ranks), the fleet's engines and the router as "
        "Ray actors (pip install 'miles[ray]'): on a Ray started for this run, or on the "
        "cluster at ADDRESS (auto, HOST:PORT, ray://HOST:PORT)",
    )
    t.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,  # does not reset `miles --debug train`
        help="show full tracebacks for errors",
    )
    t.set_defaults(fn=_train)
    r = sub.add_parser("recipes", help="list the built-in recipes")
    r.set_defaults(fn=_recipes)
    pl = sub.add_parser("plot", help="(re)draw a run's reward curve PNG")
    pl.add_argument("run_dir")
    pl.set_defaults(fn=_plot)
    # Everything after `env` goes to miles-env's own parser (imported only when used).
    e = sub.add_parser("env", help="sandboxes and Harbor task checks (miles-env)", add_help=False)
    e.add_argument("-h", "--help", action="store_true", dest="env_help")
    e.add_argument("env_args", nargs=argparse.REMAINDER)
    e.set_defaults(fn=_env)
    return p


def _quiet_third_party_noise() -> None:
    """Where torchao is installed (a test dependency of miles-quant), transformers imports it,
    and on a CPU machine it logs that its CUDA-only kernels cannot load, and torch warns about
    the enums it registers: nothing a miles run does depends on either, so the command line
    keeps them out of the run's output (errors still show)."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


# Errors of the components and libraries that mean "the input or the environment is wrong",
# matched by class name along the MRO so that no component is imported to check.
_EXPECTED_NAMES = {
    "RewardError",  # the user's reward function: the message names it and the sample
    "ReceiverError",  # an engine refused or failed a weight update
    "SGLangHTTPError",  # an engine answered an error
    "StartupError",  # a fleet process did not come up (the message holds its log)
    "CorruptStateError",  # offloaded optimizer state failed its checks
    "WeightMismatchError",  # the engine holds other bytes than the trainer sent
    "SafetensorError",  # a damaged safetensors file
    "YAMLError",
    "ClientError",  # aiohttp: an engine that cannot be reached
}


def _expected(e: BaseException) -> bool:
    if isinstance(e, ValueError | ImportError | OSError):  # OSError: files, sockets, disks
        return True
    return any(cls.__name__ in _EXPECTED_NAMES for cls in type(e).__mro__)


def _message(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        text += "; free space there (or point run.out_dir at another disk) and run again"
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``miles`` console script."""
    args = build_parser().parse_args(argv)
    debug = bool(getattr(args, "debug", False))
    _quiet_third_party_noise()
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        print("miles: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from miles.guards import RunStoppedError

        if isinstance(e, RunStoppedError) and not debug:
            print(f"miles: stopped: {e}", file=sys.stderr)
            return 1
        if debug or not _expected(e):
            raise
        print(f"miles: error: {_message(e)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
