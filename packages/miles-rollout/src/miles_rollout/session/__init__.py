"""TITO (token in, token out) sessions: an OpenAI chat endpoint that keeps exact token ids.

Agent frameworks speak chat messages; RL trains on the ids the policy generated. A session
renders the chat template once, then tokenizes only what each turn appends and keeps the
generated ids verbatim, so a multi-turn conversation becomes one training sample with a loss
mask of 1 exactly on generated tokens.

- :func:`serve_sessions` / ``miles-rollout sessions``: the HTTP server (OpenAI chat
  completions, and the Responses API mapped onto the same turn: ``session.responses``).
- :class:`TitoRenderer`: rendering and tokenizing turns (one family table entry per template).
- :class:`Trajectory`: the token state of one sample and the history policy.
"""

from miles_rollout.session.families import FAMILIES, TemplateFamily, detect_family
from miles_rollout.session.render import TitoRenderer
from miles_rollout.session.server import (
    SessionServer,
    SessionServerHandle,
    build_session_app,
    serve_sessions,
    start_sessions,
)
from miles_rollout.session.tool_parsers import ParsedMessage, ToolCall, parse_tool_calls
from miles_rollout.session.trajectory import Trajectory, TurnPlan, decode_routed_experts

__all__ = [
    "FAMILIES",
    "ParsedMessage",
    "SessionServer",
    "SessionServerHandle",
    "TemplateFamily",
    "TitoRenderer",
    "ToolCall",
    "Trajectory",
    "TurnPlan",
    "build_session_app",
    "decode_routed_experts",
    "detect_family",
    "parse_tool_calls",
    "serve_sessions",
    "start_sessions",
]
