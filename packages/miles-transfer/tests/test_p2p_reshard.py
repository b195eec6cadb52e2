"""Re-sharding copies: native C++ and the PyTorch reference write identical bytes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from p2p_testutil import DENSE, MOE, random_bits

from miles_transfer import plan_transfer
from miles_transfer.p2p import (
    copy_ops,
    pack,
    packed_bytes,
    reshard_native_available,
    reshard_native_error,
    unpack,
)
from miles_transfer.p2p.layouts import (
    ModelShape,
    fsdp_layout,
    materialize,
    megatron_layout,
    qwen3_params,
    sglang_layout,
)

native = pytest.mark.skipif(
    not reshard_native_available(),
    reason=f"native extension not built ({reshard_native_error()}); install with a C++ compiler",
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _run(plan, full, d, how, backend, threads=None):
    shards = {s: materialize(plan.src, s, full) for s in plan.sources_of(d)}
    out = plan.dst.rank(d).allocate()
    for s in plan.sources_of(d):
        ops = plan.ops_between(s, d)
        if how == "direct":
            copy_ops(ops, shards[s], out, backend=backend, threads=threads)
        else:
            buf = torch.full((packed_bytes(ops) + 5,), 0xAB, dtype=torch.uint8)
            assert pack(ops, shards[s], buf, backend=backend, threads=threads) == packed_bytes(ops)
            assert torch.all(buf[packed_bytes(ops) :] == 0xAB)  # nothing written past the end
            unpack(ops, buf, out, backend=backend, threads=threads)
    return out


@native
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["fsdp3", "megatron_tp2_pp2", "megatron_moe"]),
    st.sampled_from([(1, 1), (2, 1), (4, 1), (4, 2), (2, 2)]),
    st.sampled_from(["direct", "packed"]),
    st.integers(1, 4),
    st.integers(0, 1000),
)
def test_native_and_torch_write_identical_bytes(src_kind, tp_ep, how, threads, seed):
    tp, ep = tp_ep
    m = MOE if src_kind == "megatron_moe" else DENSE
    src = {
        "fsdp3": fsdp_layout(qwen3_params(m), 3),
        "megatron_tp2_pp2": megatron_layout(m, tp=2, pp=2),
        "megatron_moe": megatron_layout(m, tp=2, ep=2),
    }[src_kind]
    if not m.num_experts:
        ep = 1
    plan = plan_transfer(src, sglang_layout(m, tp=tp, ep=ep))
    full = random_bits(qwen3_params(m), seed)
    for d in range(plan.dst.world_size):
        ref = materialize(plan.dst, d, full)
        a = _run(plan, full, d, how, "torch")
        b = _run(plan, full, d, how, "native", threads)
        for name in ref:
            assert torch.equal(_bits(a[name]), _bits(ref[name])), name
            assert torch.equal(_bits(b[name]), _bits(ref[name])), name


@native
def test_native_threads_split_long_rows_and_many_small_ones():
    # 1 MiB rows (cut into chunks) and 2-byte rows (many per task), over 1..8 threads.
    m = ModelShape(hidden=2**19, intermediate=4, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=1, vocab=3, dtype=torch.float16)  # fmt: skip
    plan = plan_transfer(fsdp_layout(qwen3_params(m), 2), sglang_layout(m, tp=2))
    full = random_bits(qwen3_params(m), 1)
    ref = materialize(plan.dst, 1, full)
    for threads in (1, 2, 8):
        got = _run(plan, full, 1, "direct", "native", threads)
        for name in ref:
            assert torch.equal(_bits(got[name]), _bits(ref[name])), (threads, name)


def test_errors_name_the_tensor_and_what_to_do():
    plan = plan_transfer(fsdp_layout(qwen3_params(DENSE), 2), sglang_layout(DENSE, tp=2))
    full = random_bits(qwen3_params(DENSE))
    shards = materialize(plan.src, 0, full)
    out = plan.dst.rank(0).allocate()
    ops = plan.ops_between(0, 0)
    missing = dict(shards)
    del missing["model.norm.weight"]
    with pytest.raises(ValueError, match=r"no source tensor named 'model\.norm\.weight'"):
        copy_ops(ops, missing, out)
    wrong = dict(out)
    wrong["model.norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="allocate it from the layout"):
        copy_ops(ops, shards, wrong)
    with pytest.raises(ValueError, match="allocate packed_bytes"):
        pack(ops, shards, torch.empty(packed_bytes(ops) - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack(ops, shards, torch.empty(packed_bytes(ops), dtype=torch.int16))
    with pytest.raises(ValueError, match="backend must be"):
        copy_ops(ops, shards, out, backend="cuda")  # type: ignore[arg-type]
    noncontig = dict(shards)
    w = shards["model.layers.0.self_attn.o_proj.weight"]
    noncontig["model.layers.0.self_attn.o_proj.weight"] = w.t().contiguous().t()
    with pytest.raises(ValueError, match="contiguous"):
        copy_ops(ops, noncontig, out)


def test_without_the_extension_the_torch_reference_runs_with_a_warning():
    code = (
        "import warnings, torch\n"
        "from miles_transfer.p2p import *\n"
        "from miles_transfer.p2p.layouts import *\n"
        "from p2p_testutil import DENSE, random_bits\n"
        "assert not reshard_native_available()\n"
        "assert 'MILES_TRANSFER_DISABLE_NATIVE' in reshard_native_error()\n"
        "plan = plan_transfer(fsdp_layout(qwen3_params(DENSE), 2), sglang_layout(DENSE, tp=2))\n"
        "full = random_bits(qwen3_params(DENSE))\n"
        "shards = {s: materialize(plan.src, s, full) for s in range(2)}\n"
        "out = {1: plan.dst.rank(1).allocate()}\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    reshard_local(plan, shards, out)\n"
        "assert any('PyTorch reference' in str(x.message) for x in w), w\n"
        "ref = materialize(plan.dst, 1, full)\n"
        "bits = lambda t: t.view(torch.int16)\n"
        "assert all(torch.equal(bits(ref[k]), bits(out[1][k])) for k in ref)\n"
        "try:\n"
        "    reshard_local(plan, shards, out, backend='native')\n"
        "except RuntimeError as e:\n"
        "    assert 'C++ compiler' in str(e)\n"
        "else:\n"
        "    raise AssertionError('native backend ran without the extension')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, MILES_TRANSFER_DISABLE_NATIVE="1", OMP_NUM_THREADS="1")
    here = os.path.dirname(__file__)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.slow
def test_without_a_compiler_the_package_installs_and_uses_the_reference(tmp_path):
    """`pip install` with no C++ compiler: a wheel without _ext, an import that works."""
    import venv
    import zipfile
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[1]
    # A fresh venv's pip builds the wheel: the test runner's interpreter may have no pip (Pants).
    venv.EnvBuilder(with_pip=True).create(tmp_path / "v")
    py = tmp_path / "v" / "bin" / "python"
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"))
    subprocess.run(
        [py, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "w", pkg],
        check=True, env=env, timeout=600,
    )  # fmt: skip
    (wheel,) = (tmp_path / "w").glob("miles_transfer-*.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if "_ext" in n]
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "torch==2.13.0", wheel], check=True, timeout=600
    )
    code = (
        "import torch, warnings, miles_transfer.p2p as m, miles_transfer.p2p.layouts as lay\n"
        "assert not m.reshard_native_available()\n"
        "assert 'no C++ compiler' in m.reshard_native_error()\n"
        "s = lay.ModelShape(hidden=8, intermediate=8, num_layers=1, num_heads=2, num_kv_heads=1,\n"
        "                 head_dim=4, vocab=10)\n"
        "p = m.plan_transfer(lay.fsdp_layout(lay.qwen3_params(s), 2), lay.sglang_layout(s, tp=2))\n"
        "full = {n: torch.randn(v.shape).to(v.dtype) for n, v in lay.qwen3_params(s).items()}\n"
        "out = {0: p.dst.rank(0).allocate()}\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    m.reshard_local(p, {r: lay.materialize(p.src, r, full) for r in range(2)}, out)\n"
        "assert any('PyTorch reference' in str(x.message) for x in w)\n"
        "ref = lay.materialize(p.dst, 0, full)\n"
        "assert all(torch.equal(ref[k], out[0][k]) for k in ref)\n"
        "print('ok')\n"
    )
    # This install has no extension on purpose: CI's MILES_REQUIRE_NATIVE=1 does not apply.
    plain = {k: v for k, v in os.environ.items() if k != "MILES_REQUIRE_NATIVE"}
    proc = subprocess.run(
        [py, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300, env=plain
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
