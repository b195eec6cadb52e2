"""Harbor-format tasks: read a task directory, run it in a sandbox, get its reward."""

from miles_env.harbor.check import (
    TaskResult,
    Verdict,
    builtin_tasks_dir,
    check_tasks,
    open_task_sandbox,
    run_task,
    run_tasks,
    verify,
)
from miles_env.harbor.task import HarborTask, TaskError, find_tasks, load_task

__all__ = [
    "HarborTask",
    "TaskError",
    "TaskResult",
    "Verdict",
    "builtin_tasks_dir",
    "check_tasks",
    "find_tasks",
    "load_task",
    "open_task_sandbox",
    "run_task",
    "run_tasks",
    "verify",
]
