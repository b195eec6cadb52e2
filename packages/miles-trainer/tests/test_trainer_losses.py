"""policy_loss against numbers worked out by hand from the formulas in the README.

The example: 2 sequences x 3 tokens, clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28].

    ratios      seq0 [1.5, 0.7, 1.0]   A = +1   mask [1, 1, 1]
                seq1 [0.5, 1.2, 1.3]   A = -2   mask [1, 1, 0]

pg = max(-A r, -A clip(r)):
    seq0: r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped); r=0.7 -> max(-0.7, -0.8) = -0.7;
          r=1.0 -> -1.0
    seq1: r=0.5 -> max(1.0, 1.6) = 1.6 (clipped); r=1.2 -> max(2.4, 2.4) = 2.4; (masked)
    sums: seq0 -2.98 (3 tokens), seq1 4.0 (2 tokens); 5 loss tokens, 2 sequences
    token-mean          (-2.98 + 4.0) / 5          = 0.204
    seq-mean-token-sum  (-2.98 + 4.0) / 2          = 0.51
    seq-mean-token-mean (-2.98 / 3 + 4.0 / 2) / 2  = 0.5033333...
    clip_frac = 2 / 5 = 0.4;  ratio_mean = (1.5 + 0.7 + 1.0 + 0.5 + 1.2) / 5 = 0.98

KL with d = logp - ref_logp:  seq0 [0.1, -0.2, 0.0], seq1 [0.3, 0.5, (masked)]
    k1 = d:           seq0 sum -0.1,  seq1 sum 0.8
    k2 = d^2 / 2:     [0.005, 0.02, 0] sum 0.025;  [0.045, 0.125] sum 0.17
    k3 = e^-d - 1 + d: e^-0.1 = 0.904837418 -> 0.004837418; e^0.2 = 1.221402758 -> 0.021402758;
                       0 -> 0; e^-0.3 = 0.740818221 -> 0.040818221;
                       e^-0.5 = 0.606530660 -> 0.106530660
                       seq0 sum 0.026240176, seq1 sum 0.147348881

Entropy: seq0 [2.0, 1.0, 3.0] sum 6.0, seq1 [0.5, 1.5, (masked)] sum 2.0
"""

from __future__ import annotations

import math

import pytest
import torch

from miles_trainer import LossConfig, MismatchConfig, kl_estimate, policy_loss

RATIOS = [[1.5, 0.7, 1.0], [0.5, 1.2, 1.3]]
OLD = [[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]]
ADV = [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
KL_D = [[0.1, -0.2, 0.0], [0.3, 0.5, 7.0]]
ENTROPY = [[2.0, 1.0, 3.0], [0.5, 1.5, 9.0]]

# (seq0 sum, seq0 tokens, seq1 sum, seq1 tokens) -> aggregated, written out per mode.
PG = {"token-mean": 0.204, "seq-mean-token-sum": 0.51, "seq-mean-token-mean": 0.50333333}
KL = {
    "k1": {"token-mean": 0.7 / 5, "seq-mean-token-sum": 0.35, "seq-mean-token-mean": 0.18333333},
    "k2": {"token-mean": 0.039, "seq-mean-token-sum": 0.0975, "seq-mean-token-mean": 0.04666667},
    "k3": {
        "token-mean": 0.034717811,  # 0.173589057 / 5
        "seq-mean-token-sum": 0.086794529,  # 0.173589057 / 2
        "seq-mean-token-mean": 0.041210583,  # (0.026240176 / 3 + 0.147348881 / 2) / 2
    },
}
ENT = {"token-mean": 1.6, "seq-mean-token-sum": 4.0, "seq-mean-token-mean": 1.5}
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def _inputs() -> dict[str, torch.Tensor]:
    old = torch.tensor(OLD, dtype=torch.float64)
    logp = old + torch.tensor(RATIOS, dtype=torch.float64).log()
    return {
        "logp": logp.requires_grad_(True),
        "old": old,
        "adv": torch.tensor(ADV, dtype=torch.float64),
        "mask": torch.tensor(MASK),
        "ref": logp.detach() - torch.tensor(KL_D, dtype=torch.float64),
        "entropy": torch.tensor(ENTROPY, dtype=torch.float64),
    }


@pytest.mark.parametrize("loss_agg", MODES)
def test_pg_loss_by_hand(loss_agg: str) -> None:
    x = _inputs()
    cfg = LossConfig(loss_agg=loss_agg)
    loss, m = policy_loss(x["logp"], x["old"], x["adv"], x["mask"], cfg)
    assert loss.item() == pytest.approx(PG[loss_agg], abs=1e-7)
    assert m["pg_loss"].item() == pytest.approx(PG[loss_agg], abs=1e-7)
    assert m["clip_frac"].item() == pytest.approx(0.4)
    assert m["ratio_mean"].item() == pytest.approx(0.98)
    assert m["kl"].item() == 0.0
    assert m["entropy"].item() == 0.0


@pytest.mark.parametrize("loss_agg", MODES)
@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_full_loss_by_hand(loss_agg: str, kl_type: str) -> None:
    x = _inputs()
    cfg = LossConfig(loss_agg=loss_agg, kl_coef=0.5, kl_type=kl_type, entropy_coef=0.1)
    loss, m = policy_loss(
        x["logp"], x["old"], x["adv"], x["mask"], cfg, ref_logp_BT=x["ref"], entropy_BT=x["entropy"]
    )
    want = PG[loss_agg] + 0.5 * KL[kl_type][loss_agg] - 0.1 * ENT[loss_agg]
    assert loss.item() == pytest.approx(want, abs=1e-7)
    assert m["kl"].item() == pytest.approx(KL[kl_type][loss_agg], abs=1e-8)
    assert m["entropy"].item() == pytest.approx(ENT[loss_agg], abs=1e-8)


def test_kl_estimators_per_token() -> None:
    d = torch.tensor([0.1, -0.2, 0.0, 0.3, 0.5], dtype=torch.float64)
    ref = torch.zeros_like(d)
    assert kl_estimate(d, ref, "k1").tolist() == pytest.approx([0.1, -0.2, 0.0, 0.3, 0.5])
    assert kl_estimate(d, ref, "k2").tolist() == pytest.approx([0.005, 0.02, 0.0, 0.045, 0.125])
    k3 = [0.004837418, 0.021402758, 0.0, 0.040818221, 0.106530660]
    assert kl_estimate(d, ref, "k3").tolist() == pytest.approx(k3, abs=1e-9)


def test_gradient_is_zero_on_clipped_tokens() -> None:
    """token-mean: d loss / d logp = -A r / 5 on unclipped tokens, 0 on clipped or masked."""
    x = _inputs()
    loss, _ = policy_loss(x["logp"], x["old"], x["adv"], x["mask"], LossConfig())
    loss.backward()
    want = [[0.0, -0.7 / 5, -1.0 / 5], [0.0, 2.4 / 5, 0.0]]
    assert x["logp"].grad is not None
    assert x["logp"].grad.tolist()[0] == pytest.approx(want[0], abs=1e-12)
    assert x["logp"].grad.tolist()[1] == pytest.approx(want[1], abs=1e-12)


def test_truncated_importance_sampling_by_hand() -> None:
    """exp(old - rollout) = [2, .5, 1; 3, 1, -]; cap 1.5 -> w = [1.5, .5, 1; 1.5, 1].

    pg * w = [-1.92, -0.35, -1.0; 2.4, 2.4] -> token-mean (-3.27 + 4.8) / 5 = 0.306.
    """
    x = _inputs()
    w = torch.tensor([[2.0, 0.5, 1.0], [3.0, 1.0, 1.0]], dtype=torch.float64)
    rollout = x["old"] - w.log()
    cfg = LossConfig(mismatch=MismatchConfig(level="token", mode="truncate", upper=1.5))
    loss, m = policy_loss(x["logp"], x["old"], x["adv"], x["mask"], cfg, rollout_logp_BT=rollout)
    assert loss.item() == pytest.approx(0.306, abs=1e-9)
    # applied weights [1.5, .5, 1; 1.5, 1] -> mean 5.5 / 5; raw 3 and 0.5; 2 of 5 truncated
    assert m["is_weight_mean"].item() == pytest.approx(1.1)
    assert (m["is_weight_max"].item(), m["is_weight_min"].item()) == pytest.approx((3.0, 0.5))
    assert m["is_clip_frac"].item() == pytest.approx(0.4)


@pytest.mark.parametrize("loss_agg", MODES)
def test_global_counts_make_partial_sums_add_up(loss_agg: str) -> None:
    """One row per 'rank', normalised by the global counts, sums to the whole-batch loss."""
    x = _inputs()
    cfg = LossConfig(loss_agg=loss_agg, kl_coef=0.3, kl_type="k3", entropy_coef=0.01)
    args = ("logp", "old", "adv", "mask")
    whole, _ = policy_loss(
        *(x[a] for a in args), cfg, ref_logp_BT=x["ref"], entropy_BT=x["entropy"]
    )
    parts = []
    for row in range(2):
        part, _ = policy_loss(
            *(x[a][row : row + 1] for a in args),
            cfg,
            ref_logp_BT=x["ref"][row : row + 1],
            entropy_BT=x["entropy"][row : row + 1],
            num_global_tokens=5,
            num_global_seqs=2,
        )
        parts.append(part.item())
    assert sum(parts) == pytest.approx(whole.item(), abs=1e-12)


def test_garbage_in_masked_positions_reaches_neither_loss_nor_grad() -> None:
    x = _inputs()
    logp = x["logp"].detach().clone()
    logp[1, 2] = math.inf
    old = x["old"].clone()
    old[1, 2] = math.nan
    logp.requires_grad_(True)
    loss, m = policy_loss(logp, old, x["adv"], x["mask"], LossConfig())
    loss.backward()
    assert loss.item() == pytest.approx(0.204, abs=1e-7)
    assert logp.grad is not None
    assert torch.isfinite(logp.grad).all()
    assert m["ratio_mean"].item() == pytest.approx(0.98)


def test_missing_inputs_and_bad_shapes_raise() -> None:
    x = _inputs()
    base = (x["logp"], x["old"], x["adv"], x["mask"])
    with pytest.raises(ValueError, match="ref_logp_BT"):
        policy_loss(*base, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_BT"):
        policy_loss(*base, LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="rollout_logp_BT"):
        policy_loss(*base, LossConfig(mismatch=MismatchConfig()))
    with pytest.raises(ValueError, match="advantages_BT has shape"):
        policy_loss(x["logp"], x["old"], x["adv"][:, :2], x["mask"], LossConfig())
