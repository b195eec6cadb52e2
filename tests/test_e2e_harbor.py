"""Harbor's own agent (terminus-2: LiteLLM chat calls, commands typed into tmux in the task's
container) runs a Harbor trial of a built-in task, in Harbor's Python and Harbor's podman
environment, with a session of the real TITO session server (over the embedded engine) as its
model provider; Harbor's verifier gives the reward.

The model is a tiny random Llama with SmolLM2's tokenizer: what it says is noise (it never
emits its end-of-turn token, so the requests carry a stop string that ends each reply after a
few tokens), so the test checks the path (what reached the session, what came back), not skill.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import call_json, save_tiny_smol, tito_sessions

pytest.importorskip("miles_env")

from miles_env.backends import podman as podman_backend
from miles_env.integrations.harbor import (
    AGENT_IMAGE,
    HarborAgent,
    HarborTrialConfig,
    build_agent_image,
    harbor_python,
)

TASK = Path(podman_backend.__file__).resolve().parents[1] / "tasks" / "csv-totals"


def _harbor_ready() -> str | None:
    """Why Harbor's podman trials cannot run here, or None."""
    try:
        python = harbor_python()
    except FileNotFoundError as e:
        return str(e)
    if not (python.parent / "podman-compose").exists():
        pip = python.parent / "pip"
        return f"podman-compose is not in Harbor's venv: {pip} install podman-compose"
    ok, why = podman_backend.available()
    if not ok:
        return f"podman backend: {why}"
    return None


@pytest.fixture(scope="module")
def agent_image() -> str:
    why = _harbor_ready()
    if why:
        pytest.skip(why)
    exists = subprocess.run(
        ["podman", *podman_backend._GLOBAL, "image", "exists", AGENT_IMAGE], capture_output=True
    )
    if exists.returncode != 0:
        try:
            build_agent_image()
        except RuntimeError as e:  # apt could not reach Debian
            pytest.skip(f"could not build {AGENT_IMAGE}: {e}")
    return AGENT_IMAGE


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # terminus-2's prompt alone is ~900 tokens
    model = save_tiny_smol(
        tmp_path_factory.mktemp("models") / "tiny-smol", max_position_embeddings=8192
    )
    with tito_sessions(model, max_running_requests=2) as s:
        yield s


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_harbor_terminus_2_trial_through_a_tito_session(
    agent_image: str, sessions: Any, tmp_path: Path
) -> None:
    h, tok = sessions.h, sessions.tokenizer
    sid = call_json("POST", f"{h.url}/sessions", {})["session_id"]
    agent = HarborAgent(
        HarborTrialConfig(
            agent="terminus-2", model_name="openai/tiny", max_turns=2, base_image=agent_image
        )
    )
    sample = SimpleNamespace(label=str(TASK), metadata={})
    request = {"max_tokens": 24, "temperature": 1.0, "stop": ["e"]}
    md = asyncio.run(agent(h.session_url(sid), sample, request))

    # Harbor's verifier ran tests/test.sh in the container: the noise solved nothing.
    assert md["task"] == "csv-totals"
    assert md["verifier_error"] is None, md
    assert md["reward"] == 0.0
    assert md["scores"] == {"reward": 0.0}
    assert md["reward_reason"].startswith("Harbor's verifier: reward 0.0; tests/test.sh said:")
    assert "revenue.csv" in md["reward_reason"], md["reward_reason"]
    assert md["stopped"] == "done"
    assert md["metrics"]["agentic/turns"] == 2.0

    samples = call_json("GET", f"{h.url}/sessions/{sid}/samples")["samples"]
    assert len(samples) == 1, [s["messages"] for s in samples]
    s = samples[0]
    # What terminus-2 sent: its own prompt with the task's instruction, then (the reply not
    # being its JSON) its feedback as the second user turn.
    instruction = (TASK / "instruction.md").read_text().strip()
    roles = [m["role"] for m in s["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert "command-line tasks" in s["messages"][0]["content"]
    assert instruction in s["messages"][0]["content"]
    n_prompt, n_resp = s["prompt_length"], s["response_length"]
    assert len(s["tokens"]) == n_prompt + n_resp
    assert len(s["loss_mask"]) == len(s["rollout_logprobs"]) == n_resp
    assert instruction in tok.decode(s["tokens"][:n_prompt])
    # The loss mask is 1 exactly on the two replies the engine generated (each at most
    # max_tokens), 0 on the feedback turn between them, which holds terminus-2's words.
    runs = _runs(s["loss_mask"])
    assert len(runs) == 2
    assert runs[0][0] == 0
    assert runs[1][1] == n_resp
    response = s["tokens"][n_prompt:]
    for (a, b), reply in zip(runs, (s["messages"][1], s["messages"][3]), strict=True):
        assert 1 <= b - a <= 24 + 1  # + the end-of-turn token that closes a stopped reply
        text = tok.decode(response[a:b], skip_special_tokens=True)
        assert text.startswith(reply["content"] or "")
    between = tok.decode(response[runs[0][1] : runs[1][0]])
    assert s["messages"][2]["content"].strip()[:60] in between


def test_harbor_trial_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="openai/<name>"):
        HarborTrialConfig(model_name="tiny")
    with pytest.raises(ValueError, match="max_turns"):
        HarborTrialConfig(max_turns=0)
    with pytest.raises(ValueError, match="timeout_s"):
        HarborTrialConfig(timeout_s=0)


def test_a_missing_harbor_python_names_the_setup_script(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"setup_agent_frameworks\.sh harbor"):
        harbor_python(tmp_path / "nope" / "python")


def test_a_directory_that_is_not_a_harbor_task_is_refused(tmp_path: Path) -> None:
    from miles_env.integrations.harbor import run_harbor_trial

    try:
        harbor_python()  # checked first
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with pytest.raises(FileNotFoundError, match=r"no task\.toml"):
        asyncio.run(run_harbor_trial(tmp_path, "http://127.0.0.1:1/v1"))
