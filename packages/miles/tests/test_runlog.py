"""Run outputs: Weights & Biases offline (no network) next to TensorBoard, both optional."""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles._runlog import RunLog, read_metrics
from miles.config import RunSettings


def _wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of an offline ``run-*.wandb`` file (a LevelDB-style log: a 7-byte
    W&B header, then 32 KiB blocks of records with 7-byte headers: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data = raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        buf = data if kind in (1, 2) else buf + data  # FULL / FIRST start a record
        if kind in (1, 4):  # FULL / LAST end one
            rec = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            rec.ParseFromString(buf)
            yield rec


@pytest.mark.slow  # the wandb-core service starts in 10-20 s on the shared machine
def test_wandb_offline_logs_the_scalars_without_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: never reach a server
    log = RunLog(tmp_path, tensorboard=False, wandb=True, name="t", config={"trainer": {"lr": 0.5}})
    for step in (1, 2, 3):
        log.log({"step": step, "rollout/reward_mean": step / 4, "note": "x", "ok": True})
    log.close()
    assert [r["rollout/reward_mean"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        0.25,
        0.5,
        0.75,
    ]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (log_file,) = runs[0].glob("run-*.wandb")  # the offline log `wandb sync` uploads

    def read() -> tuple[list[tuple[Any, Any]], str]:
        history, config = [], ""
        for rec in _wandb_records(log_file):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in rec.history.item
                }
                history.append((items["_step"], items["rollout/reward_mean"]))
            elif kind == "run":  # the run record carries the config given to wandb.init
                config += "".join(i.key + i.value_json for i in rec.run.config.update)
        return history, config

    # W&B's service process writes the file; on a cold, loaded machine the history records
    # were seen landing after finish() returned (a Pants run): wait for them, generously.
    deadline = time.monotonic() + 60
    history, config = read()
    while len(history) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
        history, config = read()
    assert history == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert 'trainer{"lr":0.5}' in config


def test_asked_for_backends_say_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'miles\[wandb\]'"):
        RunLog(tmp_path, tensorboard=False, wandb=True)
    with pytest.raises(ImportError, match=r"pip install 'miles\[tensorboard\]'"):
        RunLog(tmp_path, tensorboard=True)
    log = RunLog(tmp_path, tensorboard=None)  # "when installed": quietly off
    log.log({"step": 1, "x": 1.0})
    log.close()
    with pytest.raises(ValueError, match="wandb_mode must be 'offline' or 'online'"):
        RunSettings(wandb_mode="cloud")
