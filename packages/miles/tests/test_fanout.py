"""The fleet's fan-out weight receiver against real engine servers: every live engine gets each
update bit for bit, a newcomer catches up at the next update, a dead engine is left out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles.rollout.fanout import FanoutReceiver
from miles_rollout import Engine, EngineConfig, ServerHandle, serve
from miles_transfer import push_weights


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("fanout") / "m"
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture
def servers(model_dir: Path) -> Iterator[list[tuple[Engine, ServerHandle]]]:
    made: list[tuple[Engine, ServerHandle]] = []

    def start() -> tuple[Engine, ServerHandle]:
        engine = EngineConfig(model_path=str(model_dir), num_threads=1).build()
        made.append((engine, serve(engine)))
        return made[-1]

    start()
    start()
    yield made  # the test starts more through made.start
    for engine, handle in made:
        handle.close()
        engine.shutdown()


def _weights(engine: Engine, scale: float) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach() * scale) for n, p in engine.model.named_parameters()]


def test_every_engine_updated_newcomer_catches_up_dead_left_out(
    servers: list[tuple[Engine, ServerHandle]], model_dir: Path
) -> None:
    urls = [h.url for _, h in servers]
    fanout = FanoutReceiver(lambda: list(urls))
    first = servers[0][0]
    report = push_weights(_weights(first, 0.5), fanout, weight_version="1", bucket_bytes=4096)
    assert report.verified
    assert report.buckets > 1
    assert [e.weight_version for e, _ in servers] == ["1", "1"]
    digests = [e.weights_checksum() for e, _ in servers]
    assert digests[0] == digests[1]

    # A newcomer (a replacement engine) joins: it gets the whole next update.
    engine = EngineConfig(model_path=str(model_dir), num_threads=1).build()
    handle = serve(engine)
    servers.append((engine, handle))
    urls.append(handle.url)
    push_weights(_weights(first, 0.25), fanout, weight_version="2", bucket_bytes=4096)
    assert [e.weight_version for e, _ in servers] == ["2", "2", "2"]
    assert engine.weights_checksum() == first.weights_checksum()

    # An engine dies (its server is gone): it is left out, the rest are updated and verified.
    servers[1][1].close()
    report = push_weights(_weights(first, 2.0), fanout, weight_version="3", bucket_bytes=4096)
    assert report.verified
    assert fanout.dropped == 1
    assert [servers[0][0].weight_version, engine.weight_version] == ["3", "3"]


def test_engines_that_disagree_fail_verification(
    servers: list[tuple[Engine, ServerHandle]],
) -> None:
    urls = [h.url for _, h in servers]
    fanout = FanoutReceiver(lambda: urls)
    push_weights(_weights(servers[0][0], 1.0), fanout, weight_version="1")
    # One engine's weights change behind the fan-out's back: its digest cannot match, and
    # the value names the engine.
    name, tensor = _weights(servers[1][0], 3.0)[0]
    servers[1][0].update_weights_from_tensor([(name, tensor)])
    got = fanout.weights_checksum([name])
    assert got[name] == f"differs on {servers[1][1].url}"
