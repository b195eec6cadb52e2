"""Environments of agent frameworks as Miles `Environment`s, driven by `run_episode`.

- ``miles_env.integrations.nemo_gym.NemoGymEnv``: a NeMo Gym resources server (tools as
  ``POST /<tool>``, the reward from ``/verify``); ``NemoGymAgent`` runs NeMo Gym's own agent
  loop with a TITO session's Responses endpoint as its model.
- ``miles_env.integrations.openenv.OpenEnvEnv``: an OpenEnv environment server (the action as
  one tool, reset / step / state over its ``/ws`` session).
- ``miles_env.integrations.verifiers.VerifiersEnv``: a Verifiers (v1) taskset (its toolsets
  and rubric) through a bridge in Verifiers' Python; ``VerifiersAgent`` runs Verifiers' own
  loop with a TITO session as its provider.
- Harbor task directories: ``miles_env.environment.TerminalEnv`` (native).

Each speaks its framework's wire protocol over HTTP (aiohttp: ``pip install
'miles-env[rollout]'``), so the framework's server runs in its own Python.
"""

__all__: list[str] = []
