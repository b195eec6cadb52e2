"""miles-env: isolated sandboxes for agentic RL, and Harbor-format terminal tasks.

``sb = await create_sandbox(spec, backend="local")`` gives a sandbox with the same async
protocol on every backend (local bubblewrap, podman, Daytona, E2B, Modal, AgentEnv):
``exec``, ``read_file`` / ``write_file``, ``upload_dir`` / ``download_dir``, ``close``,
``alive``. `check_tasks` runs Harbor task directories, each in its own sandbox, and returns
one `TaskResult` (reward and reason) per task; `run_task` runs one with any async agent.
"""

from miles_env.harbor.check import TaskResult, check_tasks, run_task
from miles_env.sandbox import BACKENDS, Sandbox, SandboxClosedError, create_sandbox
from miles_env.spec import ExecResult, SandboxSpec
from miles_env.version import __version__

__all__ = [
    "BACKENDS",
    "ExecResult",
    "Sandbox",
    "SandboxClosedError",
    "SandboxSpec",
    "TaskResult",
    "__version__",
    "check_tasks",
    "create_sandbox",
    "run_task",
]
