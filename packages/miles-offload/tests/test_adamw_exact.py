"""miles_offload.AdamW equals torch.optim.AdamW (single-tensor, foreach=False) bit for bit:
parameters and every state tensor after N steps, for the CPU and the NVMe targets, with
save-and-resume in the middle and resume with a different bucket size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _offload_testlib import (
    HYPER,
    TINY_BUCKET_MB,
    assert_same_params,
    assert_same_state,
    make_params,
    reference,
    run,
)

import miles_offload as mo

STEPS = 7


def _opt(params: list[torch.Tensor], offload: str, tmp: Path, **kw) -> mo.AdamW:
    kw.setdefault("bucket_mb", TINY_BUCKET_MB)
    sub = kw.pop("sub", "state")
    path = tmp / sub if offload == "nvme" else None
    return mo.AdamW(params, **HYPER, offload=offload, path=path, **kw)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("foreach", [False, True])
def test_matches_torch_adamw(offload: str, foreach: bool, tmp_path: Path) -> None:
    # foreach=True: the trainer's variant, which gives the same bits as the single-tensor loop.
    want_p, want_sd = reference(STEPS, foreach=foreach)
    params = make_params()
    opt = _opt(params, offload, tmp_path)
    assert opt.num_buckets > 5  # several buckets, parameters split across them
    run(params, opt, range(STEPS))
    assert_same_params(params, want_p)
    assert_same_state(opt.state_dict(), want_sd)
    # torch's step tensors are exposed as optimizer.state (for schedulers and DCP).
    assert float(opt.state[params[0]]["step"]) == STEPS


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_resume_mid_run_with_other_bucket_size(offload: str, tmp_path: Path) -> None:
    want_p, want_sd = reference(STEPS)
    params = make_params()
    first = _opt(params, offload, tmp_path, sub="a")
    run(params, first, range(3))
    saved = first.state_dict()
    first.close()
    # Same bucket size, and a much larger one (one bucket).
    for bucket_mb, sub in ((TINY_BUCKET_MB, "b"), (64.0, "c")):
        resumed_params = [p.detach().clone().requires_grad_() for p in params]
        second = _opt(resumed_params, offload, tmp_path, bucket_mb=bucket_mb, sub=sub)
        second.load_state_dict(saved)
        run(resumed_params, second, range(3, STEPS))
        assert_same_params(resumed_params, want_p)
        assert_same_state(second.state_dict(), want_sd)


def test_state_moves_between_torch_and_offload(tmp_path: Path) -> None:
    want_p, want_sd = reference(STEPS)
    params = make_params()
    torch_opt = torch.optim.AdamW(params, **HYPER, foreach=False)
    run(params, torch_opt, range(4))
    off = _opt(params, "nvme", tmp_path)
    off.load_state_dict(torch_opt.state_dict())
    run(params, off, range(4, 6))
    back = torch.optim.AdamW(params, **HYPER, foreach=False)
    back.load_state_dict(off.state_dict())
    run(params, back, range(6, STEPS))
    assert_same_params(params, want_p)
    assert_same_state(back.state_dict(), want_sd)


def test_resume_from_the_nvme_directory(tmp_path: Path) -> None:
    want_p, want_sd = reference(STEPS)
    params = make_params()
    first = _opt(params, "nvme", tmp_path)
    run(params, first, range(4))
    first.close()
    # A fresh process would rebuild the model from anything: resume restores the masters.
    fresh = [torch.zeros_like(p).requires_grad_() for p in params]
    second = _opt(fresh, "nvme", tmp_path, resume=True)
    run(fresh, second, range(4, STEPS))
    assert_same_params(fresh, want_p)
    assert_same_state(second.state_dict(), want_sd)
    second.close()
    with pytest.raises(ValueError, match="another bucket layout"):
        _opt(fresh, "nvme", tmp_path, resume=True, bucket_mb=1.0)
    with pytest.raises(ValueError, match="resume=False to start fresh"):
        _opt(fresh, "nvme", tmp_path, resume=True, sub="empty")


def test_param_groups_maximize_and_lr_changes(tmp_path: Path) -> None:
    def groups(params: list[torch.Tensor]) -> list[dict]:
        return [
            {"params": params[:3], "lr": 3e-3, "weight_decay": 0.0},
            {"params": params[3:], "maximize": True},
        ]

    ref_params = make_params()
    ref = torch.optim.AdamW(groups(ref_params), **HYPER, foreach=False)
    params = make_params()
    opt = mo.AdamW(groups(params), **HYPER, offload="nvme", path=tmp_path, bucket_mb=TINY_BUCKET_MB)

    def halve_lr(opt: torch.optim.Optimizer) -> None:
        for g in opt.param_groups:
            g["lr"] *= 0.5

    run(ref_params, ref, range(5), hook=lambda k: halve_lr(ref))
    run(params, opt, range(5), hook=lambda k: halve_lr(opt))
    assert_same_params(params, [p.detach() for p in ref_params])
    assert_same_state(opt.state_dict(), ref.state_dict())


def test_bf16_moments_are_close_and_layout_independent(tmp_path: Path) -> None:
    want_p, _ = reference(STEPS)
    runs = []
    for offload, bucket_mb in (("cpu", TINY_BUCKET_MB), ("nvme", 1.0)):
        params = make_params()
        opt = _opt(
            params, offload, tmp_path, bucket_mb=bucket_mb, moment_dtype="bfloat16", sub=offload
        )
        run(params, opt, range(STEPS))
        sd = opt.state_dict()
        assert sd["state"][0]["exp_avg"].dtype == torch.bfloat16
        runs.append((params, sd))
    (pa, sa), (pb, sb) = runs
    assert_same_params(pa, [p.detach() for p in pb])  # same bits whatever the layout
    assert_same_state(sa, sb)
    err = max((a.detach() - w).abs().max().item() for a, w in zip(pa, want_p))
    assert 0 < err < 1e-3  # close to fp32 moments, not equal


def test_bf16_parameters_get_the_cast_of_fp32_masters(tmp_path: Path) -> None:
    want_p, _ = reference(STEPS)
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in make_params()]
    masters = [p.detach().float() for p in params]
    ref_params = [m.clone().requires_grad_() for m in masters]
    ref = torch.optim.AdamW(ref_params, **HYPER, foreach=False)
    opt = _opt(params, "nvme", tmp_path)
    for k in range(3):
        from _offload_testlib import set_grads, skip_for

        set_grads(ref_params, k, skip=skip_for(k))
        for p, r in zip(params, ref_params):
            p.grad = None if r.grad is None else r.grad.to(torch.bfloat16)
            r.grad = None if r.grad is None else r.grad.to(torch.bfloat16).float()
        ref.step()
        opt.step()
    sd = opt.state_dict()
    for i, (p, r) in enumerate(zip(params, ref_params)):
        assert torch.equal(sd["state"][i]["master"], r.detach())
        assert torch.equal(p.detach(), r.detach().to(torch.bfloat16))
    del want_p


def test_bad_options_raise_clear_errors(tmp_path: Path) -> None:
    params = make_params()
    with pytest.raises(ValueError, match="needs path="):
        mo.AdamW(params, offload="nvme")
    with pytest.raises(ValueError, match="offload must be one of"):
        mo.AdamW(params, offload="gpu")
    with pytest.raises(ValueError, match="bucket_mb must be > 0"):
        mo.AdamW(params, bucket_mb=0)
    with pytest.raises(ValueError, match="betas"):
        mo.AdamW(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="not contiguous"):
        mo.AdamW([torch.zeros(4, 4).t().requires_grad_()])
    opt = mo.AdamW(params)
    with pytest.raises(ValueError, match="cannot take new param groups"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    with pytest.raises(ValueError, match="param groups of sizes"):
        opt.load_state_dict({"state": {}, "param_groups": []})


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_empty_parameters_step_like_torch(offload: str, tmp_path: Path) -> None:
    # An FSDP2 rank can hold empty shards (fewer rows than ranks). torch still counts their
    # steps and keeps (empty) moments; so must the offloaded state, also across a resume.
    shapes = [(0, 7), (5,), (0,)]
    ref_params = make_params(shapes)
    ref = torch.optim.AdamW(ref_params, **HYPER, foreach=False)
    params = make_params(shapes)
    opt = _opt(params, offload, tmp_path)
    run(ref_params, ref, range(4))
    run(params, opt, range(4))
    assert_same_params(params, [p.detach() for p in ref_params])
    assert_same_state(opt.state_dict(), ref.state_dict())
    only_empty = [torch.zeros(0, 3, requires_grad=True)]  # a rank with nothing to update
    alone = _opt(only_empty, offload, tmp_path, sub="alone")
    only_empty[0].grad = torch.zeros(0, 3)
    alone.step()
    assert float(alone.state_dict()["state"][0]["step"]) == 1
    if offload == "nvme":
        opt.close()
        again = _opt(make_params(shapes), offload, tmp_path, resume=True)
        assert_same_state(again.state_dict(), ref.state_dict())


def test_resume_with_other_moment_dtype_is_refused(tmp_path: Path) -> None:
    # One small bucket: the same file size with fp32 or bf16 moments (both round up to a page).
    params = [torch.randn(100, requires_grad=True)]
    opt = _opt(params, "nvme", tmp_path)
    params[0].grad = torch.ones(100)
    opt.step()
    opt.close()
    with pytest.raises(ValueError, match="another bucket layout"):
        _opt(params, "nvme", tmp_path, resume=True, moment_dtype="bfloat16")


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_incomplete_state_dict_loads_nothing(offload: str, tmp_path: Path) -> None:
    params = make_params()
    opt = _opt(params, offload, tmp_path)
    run(params, opt, range(2))
    before, before_p = opt.state_dict(), [p.detach().clone() for p in params]
    bad = opt.state_dict()
    del bad["state"][4]["exp_avg_sq"]
    with pytest.raises(ValueError, match=r"entry 4 has no \['exp_avg_sq'\].*nothing was loaded"):
        opt.load_state_dict(bad)
    assert_same_state(opt.state_dict(), before)
    assert_same_params(params, before_p)


def test_state_of_another_algorithm_is_refused() -> None:
    params = make_params()
    opt = mo.AdamW(params, **HYPER)
    amsgrad = torch.optim.AdamW(make_params(), **HYPER, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        opt.load_state_dict(amsgrad.state_dict())
    coupled = torch.optim.Adam(make_params(), lr=1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match="coupled"):
        opt.load_state_dict(coupled.state_dict())
    # Adam without weight decay is AdamW without weight decay: accepted.
    plain = make_params()
    adam = torch.optim.Adam(plain, lr=1e-3)
    run(plain, adam, range(2))
    opt.load_state_dict(adam.state_dict())
    assert_same_state(opt.state_dict(), adam.state_dict())
