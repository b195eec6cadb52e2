"""Agentic RL in the loop: Harbor tasks, Verifiers tasksets (``task.name: verifiers``), HUD
task rows (``task.name: hud``) and NeMo Gym task rows (``task.name: nemo_gym``) as prompts, a
scripted tool-calling policy for CPU runs, per-run agentic metrics and their plot.

Recipes ``terminal`` and ``agentic-coding`` put it together::

    task:    {name: harbor, params: {toolset: bash}, reward_fn: "miles_env.rollout:episode_reward"}
    rollout: {generate_fn: multi_turn, agent: "miles_env.rollout:terminal_agent"}

Each episode runs through the TITO session server in a fresh sandbox (``miles_env``); each
sample reports its episode's numbers in ``metadata["metrics"]`` and the loop logs their means
under ``rollout/agentic/`` (``plot_agentic`` draws them: ``agentic.png``).
"""

try:
    import miles_env  # noqa: F401
except ModuleNotFoundError as e:  # an optional component of the meta-package
    if e.name != "miles_env":
        raise
    raise ImportError("agentic tasks need miles-env: pip install 'miles[env]'") from e

from miles.agentic.hud import HudTaskSet
from miles.agentic.nemo_gym import NemoGymTaskSet
from miles.agentic.plot import plot_agentic
from miles.agentic.scripted import ScriptedPolicy, scripted_policy
from miles.agentic.task import HarborTaskSet
from miles.agentic.verifiers import VerifiersTaskSet

__all__ = [
    "HarborTaskSet",
    "HudTaskSet",
    "NemoGymTaskSet",
    "ScriptedPolicy",
    "VerifiersTaskSet",
    "plot_agentic",
    "scripted_policy",
]
