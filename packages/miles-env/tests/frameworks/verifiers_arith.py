"""A tiny Verifiers (v1) taskset for the integration tests, imported by id
(``verifiers_arith``) in Verifiers' own Python; run as a module it serves its toolset (that is
how Verifiers starts a task's MCP tool server).

Two addition tasks; one tool, ``add`` (a `Toolset` without a name prefix); the rubric: a
``correct`` reward (weight 1: the answer is in the last reply), a ``used_tool`` reward
(weight 0.5) and a ``turns`` metric.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: Any) -> list[vf.Toolset]:
        return [AddToolset(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        return 1.0 if str(task.answer) in trace.last_reply else 0.0

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return 1.0 if trace.tool_messages else 0.0

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self) -> Iterator[ArithTask]:
        for a, b in ((20, 22), (3, 4)):
            data = ArithData(
                id=f"add-{a}-{b}",
                system_prompt="You are a careful calculator.",
                prompt=f"What is {a} + {b}? Use the add tool.",
                answer=a + b,
            )
            yield ArithTask(data, self.config.task)


__all__ = ["ArithTaskset"]

if __name__ == "__main__":
    AddToolset.run()
