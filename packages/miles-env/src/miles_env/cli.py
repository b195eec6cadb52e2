"""The ``miles-env`` command line (also ``miles env``).

    miles-env check [DIR] [--policy oracle|noop] [--json] [--backend local|podman]
    miles-env backends
    miles-env podman-base [--tag TAG] [--suite SUITE]

``check`` runs every Harbor task under DIR (no DIR: the built-in terminal-task suite), each
in its own sandbox, and prints one line per task with its reward, then a summary
(``--json``: one JSON object per task instead, with ``task`` and ``reward``). It exits 0 when
every task could be run to a reward, 1 when some could not (their lines say why), 2 on a
usage error: one line naming the problem and the fix (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from miles_env.harbor.check import POLICIES, TaskResult, builtin_tasks_dir, check_tasks

__all__ = ["build_parser", "main"]

EXIT_TASK_ERRORS = 1
EXIT_USAGE = 2


def build_parser(prog: str = "miles-env") -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    p = argparse.ArgumentParser(prog=prog, description="Sandboxes and Harbor tasks for agentic RL.")
    p.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="run Harbor tasks, each in its own sandbox")
    c.add_argument(
        "dir",
        nargs="?",
        help=f"a task directory or a directory of tasks (default: the built-in suite, "
        f"{builtin_tasks_dir()})",
    )
    c.add_argument("--policy", choices=POLICIES, default="oracle", help="agent (default oracle)")
    c.add_argument("--json", action="store_true", help="one JSON object per task")
    c.add_argument("--backend", choices=("local", "podman"), default="local")
    c.add_argument("--concurrency", type=int, help="tasks at a time (default: CPUs, max 4)")
    c.add_argument(
        "--podman-base", help="podman: local image to build each Dockerfile FROM (no registry)"
    )
    c.set_defaults(fn=_check)
    b = sub.add_parser("backends", help="which sandbox backends work here, and why not")
    b.set_defaults(fn=_backends)
    pb = sub.add_parser("podman-base", help="build the podman base image with debootstrap")
    pb.add_argument("--tag", help="image tag (default localhost/miles-env/debian:bookworm)")
    pb.add_argument("--suite", default="bookworm", help="Debian suite (default bookworm)")
    pb.set_defaults(fn=_podman_base)
    return p


def _line(r: TaskResult) -> str:
    status = "ERROR " if r.error else ""
    why = f"  {status}{r.reason}" if r.error or r.reward < 1.0 else ""
    return f"{r.task:<28} reward {r.reward:.2f}  ({r.duration_s:.1f} s){why}"


def _check(args: argparse.Namespace) -> int:
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")

    def show(r: TaskResult) -> None:
        print(json.dumps(r.to_json()) if args.json else _line(r), flush=True)

    start = time.monotonic()
    results = check_tasks(
        args.dir,
        policy=args.policy,
        backend=args.backend,
        concurrency=args.concurrency,
        podman_base=args.podman_base,
        on_result=show,
    )
    errors = sum(r.error for r in results)
    if not args.json:
        mean = sum(r.reward for r in results) / len(results) if results else 0.0
        full = sum(r.reward >= 1.0 for r in results)
        print(
            f"{len(results)} tasks, policy {args.policy}: mean reward {mean:.3f}, "
            f"{full} at 1.0, {errors} could not run ({time.monotonic() - start:.1f} s)"
        )
    if not results:
        print(f"miles-env: no tasks under {args.dir}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_TASK_ERRORS if errors else 0


def _backends(_: argparse.Namespace) -> int:
    from miles_env.backends import availability
    from miles_env.sandbox import BACKENDS

    for name in BACKENDS:
        ok, why = availability(name)
        print(f"{name:<10} {'available' if ok else 'unavailable: ' + why}")
    return 0


def _podman_base(args: argparse.Namespace) -> int:
    from miles_env.backends.podman import BASE_IMAGE, build_base_image

    print(build_base_image(args.tag or BASE_IMAGE, suite=args.suite))
    return 0


def main(argv: list[str] | None = None, prog: str = "miles-env") -> int:
    """Entry point of the ``miles-env`` console script and of ``miles env``."""
    args = build_parser(prog).parse_args(argv)
    try:
        return int(args.fn(args))
    except (ValueError, ImportError, OSError) as e:  # input, missing extras, files, sockets
        if args.debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
