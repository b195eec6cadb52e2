"""The checkpoint command line (miles-quant-checkpoint, tools/quantize_checkpoint.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _checkpoint_testlib import build, qwen3_moe_config, save
from _quant_testlib import same_bits

import miles_quant as mq
from miles_quant.checkpoint import load_quantized
from miles_quant.checkpoint_cli import main


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(build(qwen3_moe_config()), tmp_path_factory.mktemp("cli") / "moe")


def test_export_with_precision_flags(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "nv"
    argv = [str(src), str(out), "-f", "nvfp4", "--keep-first-layers", "1", "--keep", "*.o_proj"]
    assert main([*argv, "--no-progress"]) == 0
    assert "tensors quantized" in capsys.readouterr().out
    state = load_quantized(out, dequantize=False)
    assert not isinstance(state["model.layers.0.mlp.experts.0.up_proj.weight"], mq.QuantizedTensor)
    assert not isinstance(state["model.layers.1.self_attn.o_proj.weight"], mq.QuantizedTensor)
    q = state["model.layers.1.mlp.experts.2.down_proj.weight"]
    assert isinstance(q, mq.QuantizedTensor)
    # Written once more over it, with an activation amax from "calibration".
    amax = tmp_path / "amax.json"
    amax.write_text(json.dumps({"model.layers.1.self_attn.q_proj": 26.88}))
    assert main([*argv, "--overwrite", "--input-amax", str(amax)]) == 0
    again = load_quantized(out, dequantize=False)
    r = again["model.layers.1.mlp.experts.2.down_proj.weight"]
    assert isinstance(r, mq.QuantizedTensor)
    assert same_bits(q.data, r.data)
    for m in "qkv":  # one fused group, one input scale
        t = again[f"model.layers.1.self_attn.{m}_proj.input_scale"]
        assert float(t) == pytest.approx(0.01)  # type: ignore[arg-type]


def test_dry_run_writes_nothing(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dry"
    assert main([str(src), str(out), "-f", "int4_g128", "--only", "*.experts.*", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "24 tensors quantized" in text
    assert "keep      model.layers.0.mlp.gate.weight  (always kept)" in text
    assert not out.exists()


def test_dequantize_round_trip(src: Path, tmp_path: Path) -> None:
    q = tmp_path / "q"
    assert main([str(src), str(q), "-f", "mxfp4", "--scale-rule", "rceil", "--no-progress"]) == 0
    plain = tmp_path / "plain"
    assert main([str(q), str(plain), "--dequantize", "--dtype", "float32", "--no-progress"]) == 0
    cfg = json.loads((plain / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["dtype"] == "float32"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{src}", "{out}"], "choose a format with -f/--format"),
        (["{src}/nope", "{out}", "-f", "nvfp4"], "is not a directory"),
        (["{src}", "{out}", "-f", "nvfp4", "--keep", "re:("], "bad regular expression"),
        (["{src}", "{src}/..", "-f", "nvfp4"], "exists; pass overwrite=True"),
        (["{src}", "{src}", "-f", "nvfp4", "--overwrite"], "must differ from the source"),
        (["{src}", "{out}", "-f", "nvfp4", "--scale-rule", "even"], "mxfp4 only"),
        (["{src}", "{out}", "-f", "nvfp4", "--dtype", "float16"], "pass --dequantize too"),
        (["{src}", "{out}", "-f", "nvfp4", "--dequantize"], "drop -f/--format"),
        (["{src}", "{out}", "-f", "nvfp4", "--calib-out", "{out}.json"], "pass --calib-data"),
        (["{src}", "{out}", "-f", "nvfp4", "--input-amax", "{src}/config.json"], "numbers"),
        (["{src}", "{out}", "-f", "nvfp4", "--input-amax", "{src}/chat_template.jinja"], "JSON"),
    ],
)
def test_errors_exit_2(
    argv: list[str], message: str, src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.format(src=src, out=tmp_path / "out") for a in argv]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-f", "int8"], "invalid choice"),
        (["-f", "nvfp4", "--threads", "0"], "expected a positive integer, got 0"),
        (["-f", "nvfp4", "--threads", "-2"], "expected a positive integer, got -2"),
        (["-f", "nvfp4", "--threads", "two"], "expected a positive integer, got 'two'"),
    ],
)
def test_usage_errors_exit_2(
    flags: list[str], message: str, src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main([str(src), str(tmp_path / "o"), *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_runs_as_a_program(src: Path, tmp_path: Path) -> None:
    # tools/quantize_checkpoint.py (the same main) runs in tests/test_quant_tool.py: tools/ is
    # not part of this package's Pants sandbox.
    out = tmp_path / "fp8"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "miles_quant.checkpoint_cli", str(src), str(out)]
    run = subprocess.run(
        [*cmd, "-f", "fp8_block128", "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout
    assert json.loads((out / "config.json").read_text())["quantization_config"]["fmt"] == "e4m3"
