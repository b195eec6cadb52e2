"""Harbor-format tasks: read a task directory, run it in a sandbox, get its reward."""

from miles_env.harbor.check import TaskResult, builtin_tasks_dir, check_tasks, run_task, run_tasks
from miles_env.harbor.task import HarborTask, TaskError, find_tasks, load_task

__all__ = [
    "HarborTask",
    "TaskError",
    "TaskResult",
    "builtin_tasks_dir",
    "check_tasks",
    "find_tasks",
    "load_task",
    "run_task",
    "run_tasks",
]
