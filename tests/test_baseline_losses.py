"""SigLIP, CyCLIP, decoupled (DCL/DCLW) and debiased contrastive losses (METHODS.md §7, §11):
hand-derived cases, naive loop references (forward and backward, float64), identities, bad
arguments and the clipkit contract check."""

import math

import pytest
import torch

from clipkit.contract.testing import check_loss
from clipkit.contract.types import Logits, LossContext, PointSet
from clipkit.plugins.losses.baseline_losses import (
    CyCLIPLoss,
    DebiasedContrastiveLoss,
    DecoupledContrastiveLoss,
    SigLIPLoss,
)
from clipkit.plugins.losses.infonce import InfoNCE
from clipkit.plugins.similarities.dot import DotSimilarity


def softplus(v: float) -> float:
    return math.log1p(math.exp(v))


def random_logits(n: int, seed: int, *, columns: int | None = None, spread: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, columns or n, generator=generator, dtype=torch.float64) * spread


def unit_rows(n: int, d: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=generator, dtype=torch.float64), dim=-1)


def compare_forward_backward(fast_fn, naive_fn, *inputs: torch.Tensor) -> None:
    """Run both functions on independent leaf copies of ``inputs``; compare values and gradients."""
    fast_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    naive_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    fast, naive = fast_fn(*fast_inputs), naive_fn(*naive_inputs)
    torch.testing.assert_close(fast, naive)
    fast.backward()
    naive.backward()
    for fast_input, naive_input in zip(fast_inputs, naive_inputs, strict=True):
        torch.testing.assert_close(fast_input.grad, naive_input.grad)


# ---------------------------------------------------------------------------------------------- SigLIP


def naive_siglip(i2t: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """−(1/N) Σ_a Σ_b log σ(z_ab L_ab), z_ab = +1 iff b == targets[a], as loops."""
    rows, columns = i2t.shape
    total = 0
    for a in range(rows):
        for b in range(columns):
            z = 1.0 if b == targets[a] else -1.0
            total = total - torch.log(1 / (1 + torch.exp(-z * i2t[a, b])))
    return total / rows


def test_siglip_hand_derived():
    # Positives 2 and 3 give softplus(-2) + softplus(-3); negatives -1 and 0 give softplus(-1) + softplus(0).
    i2t = torch.tensor([[2.0, -1.0], [0.0, 3.0]])
    out = SigLIPLoss()(Logits.symmetric(i2t), torch.arange(2), LossContext())
    expected = (softplus(-2) + softplus(-3) + softplus(-1) + softplus(0)) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.590962, abs=1e-6)
    assert float(out.metrics["loss_pos"]) == pytest.approx((softplus(-2) + softplus(-3)) / 2, abs=1e-6)
    assert float(out.metrics["loss_neg"]) == pytest.approx((softplus(-1) + softplus(0)) / 2, abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_siglip_matches_naive_reference(seed):
    targets = [0, 1, 2, 3, 4]
    compare_forward_backward(
        lambda x: SigLIPLoss()(Logits.symmetric(x), torch.tensor(targets), LossContext()).loss,
        lambda x: naive_siglip(x, targets),
        random_logits(5, seed),
    )


def test_siglip_local_slice_targets():
    # Two local rows against six global columns, positives at columns 4 and 5.
    targets = [4, 5]
    compare_forward_backward(
        lambda x: SigLIPLoss()(Logits.symmetric(x), torch.tensor(targets), LossContext()).loss,
        lambda x: naive_siglip(x, targets),
        random_logits(2, 3, columns=6),
    )


def test_siglip_confident_logits_give_zero_loss():
    n = 6
    i2t = torch.full((n, n), -30.0) + torch.eye(n) * 60.0
    out = SigLIPLoss()(Logits.symmetric(i2t), torch.arange(n), LossContext())
    assert 0 <= out.loss.item() < 1e-10
    wrong = SigLIPLoss()(Logits.symmetric(-i2t), torch.arange(n), LossContext())
    assert wrong.loss.item() == pytest.approx(30.0 * n, rel=1e-6)  # finite even at |L| = 30 (logsigmoid)


def test_siglip_equals_definition_with_dot_bias():
    similarity = DotSimilarity(init_scale=10.0, bias=-10.0).double()
    x, y = unit_rows(5, 4, seed=1), unit_rows(5, 4, seed=2)
    logits = similarity(PointSet(x.unsqueeze(1)), PointSet(y.unsqueeze(1)))
    loss = SigLIPLoss()(logits, torch.arange(5), LossContext()).loss
    signs = 2 * torch.eye(5, dtype=torch.float64) - 1
    definition = -torch.log(torch.sigmoid(signs * (10.0 * x @ y.t() - 10.0))).sum() / 5
    torch.testing.assert_close(loss, definition)
    loss.backward()
    # Both the scale and the bias are learnable and live in the similarity.
    assert similarity.bias.grad is not None and similarity.bias.grad != 0
    assert similarity.log_scale.grad is not None and similarity.log_scale.grad != 0


def test_siglip_uses_only_i2t():
    i2t = random_logits(4, 5)
    a = SigLIPLoss()(
        Logits(i2t=i2t, t2i=torch.zeros(4, 4, dtype=torch.float64)), torch.arange(4), LossContext()
    )
    b = SigLIPLoss()(Logits.symmetric(i2t), torch.arange(4), LossContext())
    torch.testing.assert_close(a.loss, b.loss)


# ---------------------------------------------------------------------------------------------- CyCLIP


def naive_cyclic(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """((1/N) Σ_ab (x_a·y_b − x_b·y_a)², (1/N) Σ_ab (x_a·x_b − y_a·y_b)²), as loops."""
    n = x.shape[0]
    cross = 0
    in_modal = 0
    for a in range(n):
        for b in range(n):
            cross = cross + (torch.dot(x[a], y[b]) - torch.dot(x[b], y[a])) ** 2
            in_modal = in_modal + (torch.dot(x[a], x[b]) - torch.dot(y[a], y[b])) ** 2
    return cross / n, in_modal / n


def pointset(rows: torch.Tensor) -> PointSet:
    return PointSet(rows.unsqueeze(1))


def cyclip_call(loss: CyCLIPLoss, x: torch.Tensor, y: torch.Tensor, scale: float = 10.0):
    """CyCLIP on M = 1 point sets x [N, d], y [N, d] with dot logits scale·x·y."""
    logits = Logits.symmetric(scale * x @ y.t())
    ctx = LossContext(features=(pointset(x), pointset(y)))
    return loss(logits, torch.arange(x.shape[0]), ctx)


def test_cyclip_hand_derived():
    # x = (e1, e2), y = (e1, (e1 + e2)/√2): cross term 1/2, in-modal term 1/2 (module docstring).
    c = 1 / math.sqrt(2)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([[1.0, 0.0], [c, c]])
    out = cyclip_call(CyCLIPLoss(lambda_cross=1.0, lambda_in=1.0), x, y)
    assert float(out.metrics["cyclic_cross"]) == pytest.approx(0.5, abs=1e-6)
    assert float(out.metrics["cyclic_in_modal"]) == pytest.approx(0.5, abs=1e-6)
    assert out.loss.item() == pytest.approx(float(out.metrics["infonce"]) + 1.0, abs=1e-6)
    weighted = cyclip_call(CyCLIPLoss(lambda_cross=0.25, lambda_in=0.5), x, y)
    assert weighted.loss.item() == pytest.approx(float(out.metrics["infonce"]) + 0.125 + 0.25, abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_cyclip_matches_naive_reference(seed):
    """Weighted point sets (M = 3): the loss pools, renormalises, then applies the loops."""
    generator = torch.Generator().manual_seed(seed)
    points_x = torch.nn.functional.normalize(
        torch.randn(5, 3, 4, generator=generator, dtype=torch.float64), dim=-1
    )
    points_y = torch.nn.functional.normalize(
        torch.randn(5, 3, 4, generator=generator, dtype=torch.float64), dim=-1
    )
    weights = torch.rand(5, 3, generator=generator, dtype=torch.float64) + 0.1
    logits = random_logits(5, seed + 10)
    loss = CyCLIPLoss(lambda_cross=0.3, lambda_in=0.7)

    def fast(px, py, lg):
        ctx = LossContext(features=(PointSet(px, weights), PointSet(py, weights)))
        return loss(Logits.symmetric(lg), torch.arange(5), ctx).loss

    def naive(px, py, lg):
        pooled = [
            torch.nn.functional.normalize(
                (p * (weights / weights.sum(1, keepdim=True)).unsqueeze(-1)).sum(1), dim=-1
            )
            for p in (px, py)
        ]
        cross, in_modal = naive_cyclic(*pooled)
        return (
            InfoNCE()(Logits.symmetric(lg), torch.arange(5), LossContext()).loss
            + 0.3 * cross
            + 0.7 * in_modal
        )

    compare_forward_backward(fast, naive, points_x, points_y, logits)


def test_cyclip_with_zero_lambdas_is_infonce():
    x, y = unit_rows(6, 5, seed=3), unit_rows(6, 5, seed=4)
    out = cyclip_call(CyCLIPLoss(lambda_cross=0.0, lambda_in=0.0), x, y)
    reference = InfoNCE()(Logits.symmetric(10.0 * x @ y.t()), torch.arange(6), LossContext())
    torch.testing.assert_close(out.loss, reference.loss)
    assert float(out.metrics["cyclic_cross"]) > 0.01  # the terms are there, just weighted by 0


def test_cyclip_cross_term_vanishes_for_identical_modalities():
    x = unit_rows(6, 5, seed=5)
    out = cyclip_call(CyCLIPLoss(), x, x.clone())
    assert float(out.metrics["cyclic_cross"]) == pytest.approx(0.0, abs=1e-12)
    assert float(out.metrics["cyclic_in_modal"]) == pytest.approx(0.0, abs=1e-12)


def test_cyclip_in_modal_term_vanishes_when_gram_matrices_agree():
    # y = x·R with R orthogonal: x xᵀ = y yᵀ, but x·yᵀ = x R xᵀ is not symmetric.
    x = unit_rows(6, 4, seed=6)
    rotation, _ = torch.linalg.qr(
        torch.randn(4, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    )
    out = cyclip_call(CyCLIPLoss(), x, x @ rotation)
    assert float(out.metrics["cyclic_in_modal"]) == pytest.approx(0.0, abs=1e-12)
    assert float(out.metrics["cyclic_cross"]) > 1e-3


def test_cyclip_regularisers_ignore_the_logit_scale():
    x, y = unit_rows(5, 4, seed=8), unit_rows(5, 4, seed=9)
    low, high = cyclip_call(CyCLIPLoss(), x, y, scale=1.0), cyclip_call(CyCLIPLoss(), x, y, scale=50.0)
    for key in ("cyclic_cross", "cyclic_in_modal"):
        assert float(low.metrics[key]) == pytest.approx(float(high.metrics[key]), abs=1e-12)


# --------------------------------------------------------------------------------- decoupled (DCL / DCLW)


def naive_decoupled_direction(scores: torch.Tensor, targets: list[int], sigma: float | None) -> torch.Tensor:
    """mean_i [ −w_i L[i, t_i] + log Σ_{j≠t_i} exp L_ij ],
    w_i = 2 − exp(P_i/σ) / mean_k exp(P_k/σ), a constant (detached) weight."""
    rows, columns = scores.shape
    positives = [scores[i, targets[i]] for i in range(rows)]
    mean_exp = sum(math.exp(p.item() / sigma) for p in positives) / rows if sigma is not None else None
    total = 0
    for i in range(rows):
        weight = 1.0 if sigma is None else 2 - math.exp(positives[i].item() / sigma) / mean_exp
        denominator = sum(torch.exp(scores[i, j]) for j in range(columns) if j != targets[i])
        total = total + (-weight * positives[i] + torch.log(denominator))
    return total / rows


def test_decoupled_hand_derived():
    # Each row: −2 + log(e⁰) = −2.
    out = DecoupledContrastiveLoss()(
        Logits.symmetric(torch.tensor([[2.0, 0.0], [0.0, 2.0]])), torch.arange(2), LossContext()
    )
    assert out.loss.item() == pytest.approx(-2.0, abs=1e-6)


def test_decoupled_weighted_hand_derived():
    # σ = 1, positives (2, 1): w = 2 − 2·softmax(2, 1) = (0.537883, 1.462117); loss = −(2w₀ + w₁)/2.
    out = DecoupledContrastiveLoss(weighting_sigma=1.0)(
        Logits.symmetric(torch.tensor([[2.0, 0.0], [0.0, 1.0]])), torch.arange(2), LossContext()
    )
    p0 = math.exp(2) / (math.exp(2) + math.exp(1))
    w0, w1 = 2 - 2 * p0, 2 - 2 * (1 - p0)
    assert w0 == pytest.approx(0.537883, abs=1e-6)
    assert out.loss.item() == pytest.approx(-(2 * w0 + w1) / 2, abs=1e-6)
    assert out.loss.item() == pytest.approx(-1.268941, abs=1e-6)


@pytest.mark.parametrize("sigma", [None, 0.7])
@pytest.mark.parametrize("seed", [0, 1])
def test_decoupled_matches_naive_reference(seed, sigma):
    """Asymmetric i2t/t2i so that both directions are checked separately."""
    targets = list(range(5))
    loss = DecoupledContrastiveLoss(weighting_sigma=sigma)
    compare_forward_backward(
        lambda a, b: loss(Logits(i2t=a, t2i=b), torch.tensor(targets), LossContext()).loss,
        lambda a, b: (
            (naive_decoupled_direction(a, targets, sigma) + naive_decoupled_direction(b, targets, sigma)) / 2
        ),
        random_logits(5, seed),
        random_logits(5, seed + 100),
    )


def test_decoupled_local_slice_targets():
    targets = [3, 4, 5]
    loss = DecoupledContrastiveLoss(weighting_sigma=2.0)
    compare_forward_backward(
        lambda a: loss(Logits(i2t=a, t2i=a), torch.tensor(targets), LossContext()).loss,
        lambda a: naive_decoupled_direction(a, targets, 2.0),
        random_logits(3, 4, columns=6),
    )


def test_decoupled_identity_with_infonce():
    """lse_{j≠i} L_ij = lse_j L_ij + log(1 − p_ii): DCL = InfoNCE + ½ Σ_directions mean_i log(1 − p_ii)."""
    i2t = random_logits(6, 11)
    logits = Logits.symmetric(i2t)
    dcl = DecoupledContrastiveLoss()(logits, torch.arange(6), LossContext()).loss
    infonce = InfoNCE()(logits, torch.arange(6), LossContext()).loss
    correction = (
        sum(torch.log1p(-torch.softmax(m, dim=1).diagonal()).mean() for m in (logits.i2t, logits.t2i)) / 2
    )
    torch.testing.assert_close(dcl, infonce + correction)
    assert dcl < infonce - 1e-3  # removing the positive from the denominator changes the loss


def test_decoupled_weights_average_to_one_and_vanish_for_large_sigma():
    i2t = random_logits(6, 12)
    loss = DecoupledContrastiveLoss(weighting_sigma=0.5)
    weights = loss.positive_weights(i2t.diagonal())
    assert weights.mean().item() == pytest.approx(1.0, abs=1e-12)
    assert weights.std() > 0.01
    huge_sigma = DecoupledContrastiveLoss(weighting_sigma=1e12)(
        Logits.symmetric(i2t), torch.arange(6), LossContext()
    )
    plain = DecoupledContrastiveLoss()(Logits.symmetric(i2t), torch.arange(6), LossContext())
    torch.testing.assert_close(huge_sigma.loss, plain.loss)


# ---------------------------------------------------------------------------------- debiased (Chuang et al.)


def naive_debiased_direction(
    scores: torch.Tensor, targets: list[int], tau_plus: float, t: float
) -> torch.Tensor:
    """mean_i −log(e^pos / (e^pos + N_g)), written in exp space,
    N_g = max((−τ⁺K e^pos + Σ e^neg)/(1 − τ⁺), K e^{−1/t})."""
    rows, columns = scores.shape
    negatives_count = columns - 1
    total = 0
    for i in range(rows):
        pos = torch.exp(scores[i, targets[i]])
        neg = sum(torch.exp(scores[i, j]) for j in range(columns) if j != targets[i])
        estimate = (-tau_plus * negatives_count * pos + neg) / (1 - tau_plus)
        estimate = torch.clamp(estimate, min=negatives_count * math.exp(-1 / t))
        total = total - torch.log(pos / (pos + estimate))
    return total / rows


def test_debiased_hand_derived_without_clamp():
    # τ⁺ = 0, N_g = e⁰ = 1 > e⁻²: each row is log(1 + e⁻²), InfoNCE's value.
    loss = DebiasedContrastiveLoss(tau_plus=0.0, temperature=0.5)
    out = loss(Logits.symmetric(torch.tensor([[2.0, 0.0], [0.0, 2.0]])), torch.arange(2), LossContext())
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-2)), abs=1e-6)
    assert out.loss.item() == pytest.approx(0.126928, abs=1e-6)
    assert float(out.metrics["clamp_fraction"]) == 0.0


def test_debiased_hand_derived_with_clamp():
    # τ⁺ = 0, Σ e^neg = e⁻³ < K e^{−1/t} = e⁻²: N_g = e⁻², each row is log(1 + e⁻⁴).
    loss = DebiasedContrastiveLoss(tau_plus=0.0, temperature=0.5)
    out = loss(Logits.symmetric(torch.tensor([[2.0, -3.0], [-3.0, 2.0]])), torch.arange(2), LossContext())
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-4)), abs=1e-6)
    assert float(out.metrics["clamp_fraction"]) == 1.0


def test_debiased_hand_derived_with_tau_plus():
    # N = 3, τ⁺ = 0.25, row logits (1, 0, 0): K = 2, N_g = (−0.5e + 2)/0.75 > 2e⁻² (t = 0.5).
    scores = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    out = DebiasedContrastiveLoss(tau_plus=0.25, temperature=0.5)(
        Logits.symmetric(scores), torch.arange(3), LossContext()
    )
    estimate = (-0.5 * math.e + 2) / 0.75
    assert out.loss.item() == pytest.approx(-math.log(math.e / (math.e + estimate)), abs=1e-6)


@pytest.mark.parametrize("tau_plus", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_debiased_matches_naive_reference(seed, tau_plus):
    """Logits cos/t with t = 0.5 as the loss assumes; τ⁺ = 0.5 makes some rows hit the clamp."""
    t = 0.5
    targets = list(range(6))
    loss = DebiasedContrastiveLoss(tau_plus=tau_plus, temperature=t)
    x, y = unit_rows(6, 3, seed), unit_rows(6, 3, seed + 50)
    compare_forward_backward(
        lambda a, b: (
            loss(Logits(i2t=a @ b.t() / t, t2i=b @ a.t() / t), torch.tensor(targets), LossContext()).loss
        ),
        lambda a, b: (
            (
                naive_debiased_direction(a @ b.t() / t, targets, tau_plus, t)
                + naive_debiased_direction(b @ a.t() / t, targets, tau_plus, t)
            )
            / 2
        ),
        x,
        y,
    )


def test_debiased_mixed_clamp_rows_match_naive_reference():
    # Row 0: bracket positive (no clamp); row 1: −τ⁺K e^pos + Σ e^neg < 0 (clamp); row 2: small but positive.
    scores = torch.tensor([[0.0, 0.5, -0.5], [3.0, -1.0, -1.0], [-0.5, -0.5, 0.5]], dtype=torch.float64)
    targets = [0, 0, 2]
    loss = DebiasedContrastiveLoss(tau_plus=0.3, temperature=0.5)
    out = loss(Logits(i2t=scores, t2i=scores), torch.tensor(targets), LossContext())
    assert 0 < float(out.metrics["clamp_fraction"]) < 1
    compare_forward_backward(
        lambda a: loss(Logits(i2t=a, t2i=a), torch.tensor(targets), LossContext()).loss,
        lambda a: naive_debiased_direction(a, targets, 0.3, 0.5),
        scores,
    )


def test_debiased_without_prior_or_clamp_is_infonce():
    """τ⁺ = 0 and no clamp: −log(e^pos/(e^pos + Σ_{j≠i} e^neg)) is exactly InfoNCE's row loss."""
    i2t = random_logits(6, 21, spread=1.0)
    loss = DebiasedContrastiveLoss(tau_plus=0.0, temperature=0.05)  # clamp 5·e⁻²⁰ never active here
    out = loss(Logits.symmetric(i2t), torch.arange(6), LossContext())
    assert float(out.metrics["clamp_fraction"]) == 0.0
    torch.testing.assert_close(
        out.loss, InfoNCE()(Logits.symmetric(i2t), torch.arange(6), LossContext()).loss
    )


def test_debiased_is_stable_for_large_logits():
    i2t = torch.tensor(
        [[200.0, -200.0, 150.0], [-200.0, 200.0, 0.0], [150.0, 0.0, -300.0]], requires_grad=True
    )
    out = DebiasedContrastiveLoss(tau_plus=0.1, temperature=0.01)(
        Logits.symmetric(i2t), torch.arange(3), LossContext()
    )
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(i2t.grad).all()


# ------------------------------------------------------------------------------------ contracts, arguments


@pytest.mark.parametrize(
    "loss",
    [
        SigLIPLoss(),
        CyCLIPLoss(),
        DecoupledContrastiveLoss(),
        DecoupledContrastiveLoss(weighting_sigma=5.0),
        DebiasedContrastiveLoss(),
    ],
    ids=["siglip", "cyclip", "dcl", "dclw", "debiased"],
)
def test_contract(loss):
    check_loss(loss)


def test_requires():
    assert SigLIPLoss.requires == frozenset()
    assert CyCLIPLoss.requires == frozenset({"features"})
    assert DecoupledContrastiveLoss.requires == frozenset()
    assert DebiasedContrastiveLoss.requires == frozenset()


def test_bad_arguments():
    with pytest.raises(ValueError, match="lambda_cross"):
        CyCLIPLoss(lambda_cross=-0.1)
    with pytest.raises(ValueError, match="lambda_in"):
        CyCLIPLoss(lambda_in=-1.0)
    with pytest.raises(ValueError, match="lambda_in"):
        CyCLIPLoss(lambda_in=float("nan"))
    with pytest.raises(ValueError, match="weighting_sigma"):
        DecoupledContrastiveLoss(weighting_sigma=0.0)
    for tau_plus in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="tau_plus"):
            DebiasedContrastiveLoss(tau_plus=tau_plus)
    for temperature in (0.0, -0.5):
        with pytest.raises(ValueError, match="temperature"):
            DebiasedContrastiveLoss(temperature=temperature)


def test_single_candidate_is_rejected():
    one = Logits.symmetric(torch.tensor([[1.0]]))
    for loss in (DecoupledContrastiveLoss(), DebiasedContrastiveLoss()):
        with pytest.raises(ValueError, match="at least 2 candidates"):
            loss(one, torch.arange(1), LossContext())
