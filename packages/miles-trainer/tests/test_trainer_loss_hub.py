"""The loss hub against numbers worked out by hand: GSPO, dual clip, the mismatch corrections
(MIS sequence / geometric, truncate / mask, IcePop), low-variance KL, the Dr. GRPO
aggregation, approximate KL, a user loss by dotted path, and PPO's value loss.

The example is the one of test_trainer_losses.py: 2 sequences x 3 tokens, clip [0.8, 1.28],

    ratios  seq0 [1.5, 0.7, 1.0]  A = +1  mask [1, 1, 1]   pg [-1.28, -0.7, -1.0]  sum -2.98
            seq1 [0.5, 1.2, 1.3]  A = -2  mask [1, 1, 0]   pg [ 1.6,   2.4]        sum  4.0

Mismatch weights w = exp(old - rollout): seq0 [2, 0.5, 1], seq1 [3, 1, (masked)].
    sequence:  rho0 = 2 * 0.5 * 1 = 1,          rho1 = 3 * 1 = 3
    geometric: rho0 = (2 * 0.5 * 1)^(1/3) = 1,  rho1 = (3 * 1)^(1/2) = 1.7320508
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from miles_trainer import LossConfig, MismatchConfig, kl_estimate, policy_loss
from miles_trainer.losses import aggregate, value_loss

RATIOS = [[1.5, 0.7, 1.0], [0.5, 1.2, 1.3]]
OLD = [[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]]
ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
W = [[2.0, 0.5, 1.0], [3.0, 1.0, 1.0]]
SEQ_PG = (-2.98, 4.0)  # per-sequence sums of pg (unweighted)


def _x() -> dict[str, torch.Tensor]:
    old = torch.tensor(OLD, dtype=torch.float64)
    logp = old + torch.tensor(RATIOS, dtype=torch.float64).log()
    return {
        "logp": logp.requires_grad_(True),
        "old": old,
        "adv": torch.tensor(ADV, dtype=torch.float64),
        "mask": torch.tensor(MASK),
        "rollout": old - torch.tensor(W, dtype=torch.float64).log(),
    }


def _loss(
    cfg: LossConfig, **kw: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    x = _x()
    loss, m = policy_loss(
        x["logp"], x["old"], x["adv"], x["mask"], cfg, rollout_logp_BT=x["rollout"], **kw
    )
    return loss, m, x


@pytest.mark.parametrize(
    ("mismatch", "weights", "want_loss", "clip_frac", "weight_mean"),
    [
        # MIS, sequence level, truncate at 2: weights 1 and 2
        (MismatchConfig(level="sequence", upper=2.0), (1.0, 2.0), (-2.98 + 8.0) / 5, 0.4, 1.4),
        # MIS, sequence level, mask outside [0.5, 2]: seq1 (rho 3) dropped
        (MismatchConfig(level="sequence", mode="mask", upper=2.0), (1.0, 0.0), -0.596, 0.4, 0.6),
        # MIS, geometric, truncate at 2: rho1 = sqrt(3) kept
        (
            MismatchConfig(level="geometric", upper=2.0),
            (1.0, math.sqrt(3)),
            (-2.98 + 4.0 * math.sqrt(3)) / 5,
            0.0,
            (3 + 2 * math.sqrt(3)) / 5,
        ),
        # MIS, geometric, mask outside [1/1.5, 1.5]: seq1 dropped
        (MismatchConfig(level="geometric", mode="mask", upper=1.5), (1.0, 0.0), -0.596, 0.4, 0.6),
    ],
)
def test_sequence_level_mismatch_by_hand(
    mismatch: MismatchConfig,
    weights: tuple[float, float],
    want_loss: float,
    clip_frac: float,
    weight_mean: float,
) -> None:
    loss, m, x = _loss(LossConfig(mismatch=mismatch))
    assert loss.item() == pytest.approx(want_loss, abs=1e-9)
    assert want_loss == pytest.approx(
        (SEQ_PG[0] * weights[0] + SEQ_PG[1] * weights[1]) / 5, abs=1e-9
    )
    assert m["is_clip_frac"].item() == pytest.approx(clip_frac)
    assert m["is_weight_mean"].item() == pytest.approx(weight_mean)
    # the raw weights are reported whatever was applied
    raw = (1.0, 3.0) if mismatch.level == "sequence" else (1.0, math.sqrt(3))
    assert m["is_weight_min"].item() == pytest.approx(raw[0])
    assert m["is_weight_max"].item() == pytest.approx(raw[1])
    # the weights are constants: the gradient is the weighted pg gradient (-A r / 5, unclipped)
    loss.backward()
    assert x["logp"].grad is not None
    want = [[0.0, -0.7 / 5 * weights[0], -1.0 / 5 * weights[0]], [0.0, 2.4 / 5 * weights[1], 0.0]]
    assert x["logp"].grad.tolist()[0] == pytest.approx(want[0], abs=1e-12)
    assert x["logp"].grad.tolist()[1] == pytest.approx(want[1], abs=1e-12)


def test_icepop_masks_tokens_outside_the_band_by_hand() -> None:
    """Token level, mask outside [0.4, 2.5]: w = [2, .5, 1; 0 (3 is out), 1].

    pg * w = [-2.56, -0.35, -1.0; 0, 2.4] -> (-3.91 + 2.4) / 5 = -0.302.
    """
    cfg = LossConfig(mismatch=MismatchConfig(level="token", mode="mask", lower=0.4, upper=2.5))
    loss, m, _ = _loss(cfg)
    assert loss.item() == pytest.approx(-0.302, abs=1e-9)
    assert m["is_clip_frac"].item() == pytest.approx(0.2)
    assert m["is_weight_mean"].item() == pytest.approx(4.5 / 5)


def test_gspo_sequence_ratio_by_hand() -> None:
    """s0 = (1.5 * 0.7 * 1.0)^(1/3) = 1.0163964 (inside the clip), s1 = (0.5 * 1.2)^(1/2) =
    0.7745967 < 0.8 (clipped, A < 0): per token pg -1.0163964 and max(2 * .7746, 2 * .8) = 1.6.

    seq-mean-token-mean: (-1.0163964 + 1.6) / 2 = 0.2918018. Gradient: seq0 tokens
    -s0 / 3 / 2 each (the sequence ratio's value reaches every token), seq1 0 (clipped).
    """
    s0 = 1.05 ** (1 / 3)
    cfg = LossConfig(name="gspo", loss_agg="seq-mean-token-mean")
    loss, m, x = _loss(cfg)
    assert loss.item() == pytest.approx((-s0 + 1.6) / 2, abs=1e-9)
    assert m["clip_frac"].item() == pytest.approx(0.4)  # both seq1 tokens
    assert m["ratio_mean"].item() == pytest.approx((3 * s0 + 2 * math.sqrt(0.6)) / 5)
    loss.backward()
    assert x["logp"].grad is not None
    assert x["logp"].grad.tolist()[0] == pytest.approx([-s0 / 6] * 3, abs=1e-12)
    assert x["logp"].grad.tolist()[1] == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)


def test_gspo_small_clip_clips_both_sequences() -> None:
    """GSPO's own clip range (3e-4, 4e-4): both sequence ratios are outside it."""
    cfg = LossConfig(name="gspo", clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean")
    loss, m, _ = _loss(cfg)
    # seq0: A=+1, s0 > 1.0004 -> -1.0004; seq1: A=-2, s1 < 0.9997 -> max(2 s1, 2 * .9997)
    assert loss.item() == pytest.approx((-1.0004 + 2 * 0.9997) / 2, abs=1e-9)
    assert m["clip_frac"].item() == pytest.approx(1.0)


def test_dual_clip_caps_negative_advantages_by_hand() -> None:
    """ratios [4, 2], A = -1: PPO pg = max(r, 1.28) = [4, 2]; dual clip 3 caps 4 -> 3."""
    logp = torch.tensor([[math.log(4.0), math.log(2.0)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = -torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2)
    plain, _ = policy_loss(logp, old, adv, mask, LossConfig())
    assert plain.item() == pytest.approx(3.0)
    capped, m = policy_loss(logp, old, adv, mask, LossConfig(dual_clip=3.0))
    assert capped.item() == pytest.approx(2.5)
    assert m["clip_frac"].item() == pytest.approx(0.5)
    capped.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([0.0, 1.0])  # d(r / 2)/dlogp = r / 2 = 1


def test_low_var_kl_clamps_by_hand() -> None:
    d = torch.tensor([0.1, -25.0, 30.0], dtype=torch.float64)
    got = kl_estimate(d, torch.zeros_like(d), "low_var_kl").tolist()
    # k3(0.1); d=-25 -> clamp -20: e^20 - 21 -> clamp 10; d=30 -> clamp 20: ~19 -> clamp 10
    assert got == pytest.approx([0.004837418, 10.0, 10.0], abs=1e-9)


def test_dr_grpo_token_sum_norm_by_hand() -> None:
    """seq-mean-token-sum-norm: (-2.98 + 4.0) / (2 sequences * L)."""
    loss, _, _ = _loss(LossConfig(loss_agg="seq-mean-token-sum-norm", norm_length=4))
    assert loss.item() == pytest.approx(1.02 / 8, abs=1e-12)
    loss, _, _ = _loss(LossConfig(loss_agg="seq-mean-token-sum-norm"))  # L = T = 3
    assert loss.item() == pytest.approx(1.02 / 6, abs=1e-12)
    loss, _, _ = _loss(LossConfig(loss_agg="seq-mean-token-sum-norm"), norm_length=10)
    assert loss.item() == pytest.approx(1.02 / 20, abs=1e-12)


def test_approx_kl_by_hand() -> None:
    """r - 1 - ln r per loss token: 0.0945349, 0.0566749, 0, 0.1931472, 0.0176784."""
    _, m, _ = _loss(LossConfig())
    assert m["approx_kl"].item() == pytest.approx(0.3620354 / 5, abs=1e-7)


def test_user_loss_by_dotted_path() -> None:
    """`-scale * A * logp` (REINFORCE) from a user function; token-mean over 5 tokens."""
    cfg = LossConfig(name="_trainer_hooks:reinforce_loss", params={"scale": 0.5})
    loss, m, x = _loss(cfg)
    logp = x["logp"].detach()
    want = -0.5 * (logp[0].sum() * 1.0 + (logp[1, 0] + logp[1, 1]) * -2.0) / 5
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    assert m["neg_adv"].item() == pytest.approx(2 / 5)  # its own metric, token mean
    assert m["clip_frac"].item() == 0.0
    loss.backward()
    assert x["logp"].grad is not None
    assert x["logp"].grad[0].tolist() == pytest.approx([-0.1] * 3, abs=1e-12)
    assert x["logp"].grad[1].tolist() == pytest.approx([0.2, 0.2, 0.0], abs=1e-12)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("_trainer_hooks:missing", "has no 'missing'"),
        ("_trainer_hooks:NOT_CALLABLE", "is not callable"),
        ("no_such_module_xyz:fn", "cannot import module"),
        ("no_colon_here.fn:", "is written"),
    ],
)
def test_bad_user_loss_is_a_clear_error(name: str, match: str) -> None:
    cfg = LossConfig(name=name)
    with pytest.raises(ValueError, match=f"trainer.loss.name = .*{match}"):
        cfg.build()  # the trainer builds it at construction: fails before any step


def test_user_loss_of_the_wrong_shape_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"must return a \[B, T\] tensor"):
        _loss(LossConfig(name="_trainer_hooks:wrong_shape_loss"))


def test_value_loss_by_hand() -> None:
    """V, V_old, R per token; value_clip 0.2:

    (0,0) V=1   old .8  R=1: plain 0,     clipped V 1.0 -> 0           -> 0
    (0,1) V=.5  old .5  R=1: plain .125,  clipped .125                 -> .125
    (1,0) V=0   old .5  R=0: plain 0,     clipped V .3 -> .045         -> .045 (clipped)
    (1,1) V=2   old 1   R=0: plain 2,     clipped V 1.2 -> .72         -> 2
    token-mean 2.17 / 4 = 0.5425; clip fraction 1/4.
    """
    v = torch.tensor([[1.0, 0.5], [0.0, 2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.8, 0.5], [0.5, 1.0]], dtype=torch.float64)
    ret = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    loss, m = value_loss(v, old, ret, torch.ones(2, 2), value_clip=0.2)
    assert loss.item() == pytest.approx(0.5425, abs=1e-12)
    assert m["value_clip_frac"].item() == pytest.approx(0.25)
    assert m["values_mean"].item() == pytest.approx(0.875)
    assert m["returns_mean"].item() == pytest.approx(0.5)
    loss.backward()
    assert v.grad is not None
    assert v.grad[1, 0].item() == 0.0  # the clipped term is flat in V
    assert v.grad[1, 1].item() == pytest.approx(0.5)  # (V - R) / 4
    unclipped, _ = value_loss(v, old, ret, torch.ones(2, 2), value_clip=None)
    assert unclipped.item() == pytest.approx((0 + 0.125 + 0 + 2) / 4, abs=1e-12)


def test_aggregate_modes_on_one_row() -> None:
    x = torch.tensor([[1.0, 2.0, 4.0]])
    mask = torch.tensor([[1, 0, 1]])
    assert aggregate(x, mask, "token-mean").item() == 2.5
    assert aggregate(x, mask, "seq-mean-token-sum").item() == 5.0
    assert aggregate(x, mask, "seq-mean-token-mean").item() == 2.5
    assert aggregate(x, mask, "seq-mean-token-sum-norm", norm_length=10).item() == 0.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"level": "batch"}, "level must be one of"),
        ({"mode": "clip"}, "mode must be one of"),
        ({"upper": 0.0}, "upper must be finite and > 0"),
        ({"lower": 0.5}, "applies to mode 'mask' only"),
        ({"mode": "mask", "lower": 3.0}, r"lower must be in \(0, upper"),
    ],
)
def test_mismatch_config_rejects(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MismatchConfig(**kwargs)  # type: ignore[arg-type]
