"""A code-test runner: the response's program against the label's tests, in a sandbox.

The program is the last fenced code block of the response (```` ```python ```` or plain
```` ``` ````), else the whole response. It is written to ``solution.py``; the tests (the
label: a string of Python, or ``{"tests": str, "timeout_s": float}``) to
``test_solution.py``, which starts with ``from solution import *``; ``python3
test_solution.py`` runs in a fresh miles-env sandbox (no network, 512 MiB, 64 processes,
destroyed afterwards). Reward 1.0 when it exits 0. A program that fails, crashes or runs past
its time limit scores 0.0, with the reason in ``sample.metadata["reward_info"]``: that is the
policy's failure, graded. A sandbox that cannot start raises (the sample fails, as any reward
error does).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["SANDBOX_SPEC", "code_tests", "extract_code"]

SANDBOX_SPEC: dict[str, Any] = {
    "workdir": "/app",
    "memory_mb": 512,
    "pids": 64,
    "network": "none",
    "ttl_s": 300,
}
DEFAULT_TIMEOUT_S = 10.0
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_TAIL = 2000  # characters of output kept in reward_info


def extract_code(text: str) -> str:
    """The last fenced code block (Python or untagged preferred), else the whole text."""
    blocks = _FENCE.findall(text or "")
    py = [body for lang, body in blocks if lang.lower() in ("", "python", "py", "python3")]
    if py:
        return str(py[-1])
    if blocks:
        return str(blocks[-1][1])
    return text or ""


def _tests_of(label: Any) -> tuple[str, float]:
    if isinstance(label, str):
        return label, DEFAULT_TIMEOUT_S
    if isinstance(label, dict) and isinstance(label.get("tests"), str):
        return label["tests"], float(label.get("timeout_s", DEFAULT_TIMEOUT_S))
    raise ValueError(
        "code_tests needs the label to be the test code (a string) or {'tests': str, "
        f"'timeout_s': float}}, got {type(label).__name__}"
    )


async def code_tests(sample: Any) -> float:
    """Run the response's code against the label's tests in a local sandbox; 1.0 if they pass.

    Raises:
        ImportError: miles-env is not installed (``pip install 'miles[env]'``).
        ValueError: the label holds no tests.
    """
    try:
        from miles_env import create_sandbox
    except ImportError as e:
        raise ImportError("code_tests needs miles-env: pip install 'miles[env]'") from e
    tests, timeout_s = _tests_of(sample.label)
    code = extract_code(sample.response or "")
    async with await create_sandbox(SANDBOX_SPEC, backend="local") as sb:
        await sb.write_file("solution.py", code)
        await sb.write_file("test_solution.py", "from solution import *  # noqa\n\n" + tests)
        r = await sb.exec(["python3", "test_solution.py"], timeout=timeout_s)
    passed = r.exit_code == 0 and not r.timed_out
    sample.metadata["reward_info"] = {
        "passed": passed,
        "exit_code": r.exit_code,
        "timed_out": r.timed_out,
        "stderr": r.stderr[-_TAIL:],
        "stdout": r.stdout[-_TAIL:],
    }
    return 1.0 if passed else 0.0
