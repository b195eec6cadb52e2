"""Generate functions: how one prompt becomes one trajectory (see ``miles_rollout.types``).

- :func:`single_turn_generate`: one ``/generate`` call, loss mask all ones.
- :class:`MultiTurnGenerate`: a user's agent talks OpenAI chat to a TITO session; the sample
  is the session's exact ids with a loss mask of 1 on generated tokens only.
- :func:`make_generate_fn`: either of them by name, or a user's own by dotted path.
"""

from miles_rollout.generate.loading import load_callable, make_generate_fn
from miles_rollout.generate.multi_turn import MultiTurnGenerate, chat_request_fields
from miles_rollout.generate.single_turn import encode_prompt, single_turn_generate

__all__ = [
    "MultiTurnGenerate",
    "chat_request_fields",
    "encode_prompt",
    "load_callable",
    "make_generate_fn",
    "single_turn_generate",
]
