"""The manifest on disk is checked field by field when read, and committed state is never
dropped by a fresh start that nobody asked for (issue 31)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _offload_testlib import HYPER, TINY_BUCKET_MB, assert_same_params, make_params, reference, run

import miles_offload as mo


def _nvme(params: list[torch.Tensor], path: Path, **kw: Any) -> mo.AdamW:
    return mo.AdamW(params, **HYPER, offload="nvme", path=path, bucket_mb=TINY_BUCKET_MB, **kw)


@pytest.fixture
def committed(tmp_path: Path) -> Path:
    """A directory holding two committed steps."""
    params = make_params()
    opt = _nvme(params, tmp_path)
    run(params, opt, range(2))
    opt.close()
    return tmp_path


def _edit(path: Path, fn: Any) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(fn(manifest)))


def _set(key: str, value: Any) -> Any:
    return lambda m: {**m, key: value}


def _bucket(i: int, key: str, value: Any) -> Any:
    def fn(m: dict) -> dict:
        m["buckets"][i][key] = value
        return m

    return fn


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda m: [m], "not a miles-offload manifest (a JSON list, not an object)"),
        (lambda m: "manifest", "a JSON str, not an object"),
        (_set("version", 2), "not a miles-offload manifest (version 1)"),
        (_set("layout", None), "field layout must be a string, got null"),
        (_set("generation", "2"), 'field generation must be an integer >= 0, got "2"'),
        (_set("generation", True), "field generation must be an integer >= 0, got true"),
        (_set("buckets", {"0": 1}), "field buckets must be a list"),
        (_bucket(1, "slot", None), "field buckets[1].slot must be 0 or 1, got null"),
        (_bucket(0, "slot", 2), "field buckets[0].slot must be 0 or 1, got 2"),
        (
            _bucket(2, "generation", 99),
            "field buckets[2].generation must be an integer in [0, 3], got 99",
        ),
        (lambda m: {**m, "buckets": [None, *m["buckets"][1:]]}, "field buckets[0] must be"),
    ],
)
def test_a_manifest_of_the_wrong_shape_names_the_file_and_field(
    committed: Path, damage: Any, message: str
) -> None:
    _edit(committed, damage)
    fresh = [torch.zeros_like(p).requires_grad_() for p in make_params()]
    with pytest.raises(mo.CorruptStateError) as info:
        _nvme(fresh, committed, resume=True)
    text = str(info.value)
    assert str(committed / "manifest.json") in text
    assert message in text
    assert "restore it from a checkpoint" in text  # the remedy
    assert all(torch.count_nonzero(p) == 0 for p in fresh)  # nothing was loaded


def test_a_fresh_start_over_committed_state_is_refused(committed: Path) -> None:
    before = {f.name: f.read_bytes() for f in committed.iterdir() if f.name != ".lock"}
    with pytest.raises(ValueError, match="holds optimizer state") as info:
        _nvme(make_params(), committed)
    text = str(info.value)
    assert "resume=False would overwrite it" in text
    assert "resume=True" in text
    assert f"rm -r {committed}" in text
    assert "overwrite=True" in text
    after = {f.name: f.read_bytes() for f in committed.iterdir() if f.name != ".lock"}
    assert after == before  # nothing was written
    # The directory is not left locked: resuming works, and so does an explicit start over.
    fresh = [torch.zeros_like(p).requires_grad_() for p in make_params()]
    _nvme(fresh, committed, resume=True).close()
    assert_same_params(fresh, reference(2)[0])
    params = make_params()
    opt = _nvme(params, committed, overwrite=True)
    run(params, opt, range(1))
    opt.close()
    again = [torch.zeros_like(p).requires_grad_() for p in make_params()]
    _nvme(again, committed, resume=True).close()
    assert_same_params(again, reference(1)[0])
