"""miles-env: isolated sandboxes for agentic RL, and Harbor-format terminal tasks.

``sb = await create_sandbox(spec, backend="local")`` gives a sandbox with the same async
protocol on every backend (local bubblewrap, podman, Daytona, E2B, Modal, AgentEnv):
``exec``, ``read_file`` / ``write_file``, ``upload_dir`` / ``download_dir``, ``close``,
``alive``. `check_tasks` runs Harbor task directories, each in its own sandbox.
"""

from miles_env.sandbox import BACKENDS, Sandbox, SandboxClosedError, create_sandbox
from miles_env.spec import ExecResult, SandboxSpec
from miles_env.version import __version__

__all__ = [
    "BACKENDS",
    "ExecResult",
    "Sandbox",
    "SandboxClosedError",
    "SandboxSpec",
    "__version__",
    "create_sandbox",
]
