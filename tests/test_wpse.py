"""`wpse` and `cosine_mean` (METHODS.md §2): hand cases, naive loop reference, RFF identity,
embed factorisation, feature seeding, masks/weights, prompt ensembling, contract, bad arguments."""

import math

import pytest
import torch

from clipkit.contract.testing import check_similarity, random_points
from clipkit.contract.types import PointSet
from clipkit.plugins.similarities.wpse import CosineMeanSimilarity, WPSESimilarity


def unit(*rows, dtype=torch.float64):
    return PointSet(torch.tensor(rows, dtype=dtype).unsqueeze(1))


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def exact_kernel(kernel, u, v, sigma=0.3, c=0.5):
    """k̃(u, v) of METHODS §2, computed directly."""
    squared = float(((u - v) ** 2).sum())
    return math.exp(-squared / (2 * sigma**2)) if kernel == "gaussian" else c / math.sqrt(c**2 + squared)


# ---------------------------------------------------------------- hand-derived cases


def test_linear_term_alone_is_scaled_dot_product():
    """α = (1, 0): L = s·u·v = 10·(1·0.6 + 0·0.8) = 6 (and 0 against (0, 1))."""
    similarity = WPSESimilarity(embed_dim=2, alpha=[1.0, 0.0], init_scale=10.0)
    logits = similarity(unit([1.0, 0.0]), unit([0.6, 0.8], [0.0, 1.0]))
    torch.testing.assert_close(logits.i2t, torch.tensor([[6.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(logits.t2i, logits.i2t.t())


def test_feature_term_with_fixed_features(monkeypatch):
    """D = 2, ω_1 = (π/3, 0), ω_2 = (0, π/3), β = (0, π), sqrt(2/D) = 1:
    z(1, 0) = (cos π/3, cos π) = (½, −1); z(0, 1) = (cos 0, cos(π/3 + π)) = (1, −½); z·z = ½ + ½ = 1.
    α = (0, 1), s = 2 -> 2. α = (½, ½): u·v = 0, so s·(½·0 + ½·1) = 1."""
    omega = torch.tensor([[math.pi / 3, 0.0], [0.0, math.pi / 3]], dtype=torch.float64)
    beta = torch.tensor([0.0, math.pi], dtype=torch.float64)
    u, v = unit([1.0, 0.0]), unit([0.0, 1.0])
    for alpha, expected in (([0.0, 1.0], 2.0), ([0.5, 0.5], 1.0)):
        similarity = WPSESimilarity(embed_dim=2, alpha=alpha, num_features=2, init_scale=2.0)
        monkeypatch.setattr(similarity, "sample_features", lambda generator=None: (omega, beta))
        assert similarity(u, v).i2t.item() == pytest.approx(expected, abs=1e-12)


def test_cosine_mean_hand_case():
    """X = {(1, 0), (0, 1)} with weights (3, 1): ū = (¾, ¼), ‖ū‖ = √10/4; v = (1, 0):
    cos = (¾)/(√10/4) = 3/√10; s = 2 -> 6/√10."""
    a = PointSet(torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]), weights=torch.tensor([[3.0, 1.0]]))
    b = unit([1.0, 0.0], dtype=torch.float32)
    similarity = CosineMeanSimilarity(init_scale=2.0)
    assert similarity(a, b).i2t.item() == pytest.approx(6 / math.sqrt(10), rel=1e-6)


# ---------------------------------------------------------------- naive loop reference


def naive_logits(similarity, a, b, omega, beta):
    """s·Σ_ij w̃_i w̃'_j [α1 u_i·v_j + α2 z(u_i)·z(v_j)] by explicit loops (masked points skipped)."""
    alpha1, alpha2 = similarity.alpha
    count = omega.shape[1]

    def z(point):
        return math.sqrt(2 / count) * torch.cos(point @ omega + beta)

    def weights(x, row):
        raw = x.weights[row] if x.weights is not None else torch.ones(x.num_points, dtype=x.points.dtype)
        keep = x.mask[row] if x.mask is not None else torch.ones(x.num_points, dtype=torch.bool)
        raw = torch.where(keep, raw, torch.zeros_like(raw))
        return raw / raw.sum()

    rows = []
    for row_a in range(a.batch_size):
        wa = weights(a, row_a)
        row = []
        for row_b in range(b.batch_size):
            wb = weights(b, row_b)
            total = a.points.new_zeros(())
            for i in range(a.num_points):
                for j in range(b.num_points):
                    u, v = a.points[row_a, i], b.points[row_b, j]
                    kernel = alpha1 * (u @ v) + alpha2 * (z(u) @ z(v))
                    total = total + wa[i] * wb[j] * kernel
            row.append(total)
        rows.append(torch.stack(row))
    return similarity.scale() * torch.stack(rows)


def leaf_points(batch, points, dim, seed, masked=False):
    generator = seeded(seed)
    values = torch.nn.functional.normalize(
        torch.randn(batch, points, dim, generator=generator, dtype=torch.float64), dim=-1
    )
    weights = torch.rand(batch, points, generator=generator, dtype=torch.float64) + 0.1
    mask = None
    if masked:
        mask = torch.ones(batch, points, dtype=torch.bool)
        mask[0, -1] = False
    return PointSet(values.requires_grad_(), weights.requires_grad_(), mask)


@pytest.mark.parametrize("kernel", ["gaussian", "imq"])
def test_matches_naive_loops_forward_and_backward(kernel):
    similarity = WPSESimilarity(embed_dim=4, kernel=kernel, alpha=[0.7, 0.3], num_features=8, init_scale=3.0)
    inputs = [leaf_points(3, 3, 4, seed=1, masked=True), leaf_points(2, 3, 4, seed=2)]
    omega, beta = (f.double() for f in similarity.sample_features(seeded(5)))
    fast = similarity(*inputs, generator=seeded(5)).i2t
    slow = naive_logits(similarity, *inputs, omega, beta)
    torch.testing.assert_close(fast, slow)
    leaves = [t for x in inputs for t in (x.points, x.weights)] + [similarity.logit_scale.log_scale]
    cotangent = torch.randn(fast.shape, generator=seeded(9), dtype=torch.float64)
    fast_grads = torch.autograd.grad((fast * cotangent).sum(), leaves)
    slow_grads = torch.autograd.grad((slow * cotangent).sum(), leaves)
    for fast_grad, slow_grad in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(fast_grad, slow_grad)
    # The masked point (and its weight) gets no gradient: it is not part of the set.
    assert fast_grads[0][0, -1].abs().max() == 0 and fast_grads[1][0, -1] == 0
    assert fast_grads[0][0, 0].abs().max() > 0


# ---------------------------------------------------------------- random Fourier feature identity


@pytest.mark.parametrize("kernel", ["gaussian", "imq"])
def test_rff_inner_product_is_unbiased_for_the_kernel(kernel):
    """E[z(u)·z(v)] = k̃(u, v) (METHODS §2) with the sqrt(2/D) scaling: the mean over independent
    draws is within 4 standard errors of k̃ for pairs at several distances, while the seed's printed
    sqrt(1/(2D)) scaling (a factor 4 smaller inner product) is not."""
    draws, count = 24, 4096
    angles = torch.tensor([0.0, 0.15, 0.45, 0.9, 1.6, 2.6], dtype=torch.float64)
    u = torch.zeros(len(angles), 3, dtype=torch.float64)
    u[:, 0] = 1.0
    v = torch.stack([angles.cos(), angles.sin(), torch.zeros_like(angles)], dim=1)
    similarity = WPSESimilarity(
        embed_dim=3, kernel=kernel, alpha=[0.0, 1.0], num_features=count, init_scale=1.0, learn_scale=False
    )
    with torch.no_grad():
        samples = torch.stack(
            [
                similarity(
                    PointSet(u[:, None]), PointSet(v[:, None]), generator=seeded(100 + s)
                ).i2t.diagonal()
                for s in range(draws)
            ]
        )  # [draws, pairs], each an independent D-feature estimate of k̃
    estimate = samples.mean(dim=0)
    standard_error = samples.std(dim=0) / math.sqrt(draws)
    exact = torch.tensor([exact_kernel(kernel, u[p], v[p]) for p in range(len(angles))], dtype=torch.float64)
    assert exact.min() < 0.3 and exact.max() == pytest.approx(1.0), "pairs should span the kernel's range"
    assert (estimate - exact).abs().le(4 * standard_error + 1e-12).all(), (estimate, exact, standard_error)
    # sqrt(1/(2D)) would give estimate / 4 with standard error / 4: it fails wherever k̃ is not tiny.
    wrong = estimate / 4
    informative = exact > 0.2
    assert informative.sum() >= 3
    assert ((wrong - exact).abs() > 4 * standard_error / 4)[informative].all()


# ---------------------------------------------------------------- embed, seeding, masks, weights


@pytest.mark.parametrize("kernel", ["gaussian", "imq"])
def test_embed_factorises_the_logits_exactly(kernel):
    similarity = WPSESimilarity(
        embed_dim=6, kernel=kernel, alpha=[0.25, 0.75], num_features=32, init_scale=5.0
    )
    a, b = random_points(4, 3, 6, weighted=True, seed=1), random_points(3, 5, 6, seed=2)
    with torch.no_grad():
        ea, eb = similarity.embed(a, generator=seeded(7)), similarity.embed(b, generator=seeded(7))
        assert ea.shape == (4, 6 + 32)
        torch.testing.assert_close(
            similarity.scale() * ea @ eb.t(), similarity(a, b, generator=seeded(7)).i2t
        )
        # embed = concat(√α1·ū, √α2·z̄)
        torch.testing.assert_close(ea[:, :6], math.sqrt(0.25) * a.mean())


def test_features_follow_the_generator():
    similarity = WPSESimilarity(embed_dim=8, num_features=16)
    a, b = random_points(3, 2, 8, seed=1), random_points(3, 2, 8, seed=2)
    with torch.no_grad():
        first = similarity(a, b, generator=seeded(1)).i2t
        torch.testing.assert_close(first, similarity(a, b, generator=seeded(1)).i2t, rtol=0, atol=0)
        assert not torch.allclose(first, similarity(a, b, generator=seeded(2)).i2t)
        # No generator: the fixed seed 0, so evaluation is deterministic.
        default = similarity(a, b).i2t
        torch.testing.assert_close(default, similarity(a, b).i2t, rtol=0, atol=0)
        torch.testing.assert_close(default, similarity(a, b, generator=seeded(0)).i2t, rtol=0, atol=0)
    omega, beta = similarity.sample_features(seeded(3))
    assert omega.shape == (8, 16) and beta.shape == (16,)
    assert beta.min() >= 0 and beta.max() < 2 * math.pi


def test_gaussian_and_imq_frequencies_have_the_right_scale():
    """Gaussian ω ~ N(0, σ⁻²): E ω² = 1/σ². IMQ ω ~ N(0, 2λ), λ ~ Gamma(½, rate c²): E ω² = 2·E λ
    = 2·(½)/c² = 1/c². Checked to 5 standard errors of the sample mean of ω² (and of β's mean)."""
    for kernel, expected in (("gaussian", 1 / 0.3**2), ("imq", 1 / 0.5**2)):
        similarity = WPSESimilarity(embed_dim=4, kernel=kernel, num_features=20000)
        squares = similarity.sample_features(seeded(11))[0].double().square().flatten()
        error = squares.std() / math.sqrt(squares.numel())
        assert abs(float(squares.mean()) - expected) < 5 * float(error), (kernel, float(squares.mean()))
    # β ~ U[0, 2π): mean π, standard deviation 2π/√12.
    beta = similarity.sample_features(seeded(12))[1].double()
    assert abs(float(beta.mean()) - math.pi) < 5 * (2 * math.pi / math.sqrt(12)) / math.sqrt(beta.numel())


def test_mask_excludes_padded_points():
    similarity = WPSESimilarity(embed_dim=4, num_features=16)
    full = random_points(2, 3, 4, seed=3)
    garbage = torch.cat([full.points.detach(), torch.full((2, 1, 4), 5.0)], dim=1)
    mask = torch.tensor([[True, True, True, False]] * 2)
    b = random_points(3, 2, 4, seed=4)
    with torch.no_grad():
        padded = similarity(PointSet(garbage, mask=mask), b, generator=seeded(1)).i2t
        unpadded = similarity(PointSet(full.points.detach()), b, generator=seeded(1)).i2t
    torch.testing.assert_close(padded, unpadded)


def test_weights_change_the_result_and_only_their_ratios_matter():
    similarity = WPSESimilarity(embed_dim=4, num_features=16)
    a, b = random_points(2, 3, 4, seed=3), random_points(3, 2, 4, seed=4)
    weights = torch.tensor([[1.0, 2.0, 5.0], [3.0, 1.0, 1.0]])
    with torch.no_grad():
        uniform = similarity(a, b, generator=seeded(1)).i2t
        weighted = similarity(PointSet(a.points, weights), b, generator=seeded(1)).i2t
        rescaled = similarity(PointSet(a.points, 7 * weights), b, generator=seeded(1)).i2t
    assert not torch.allclose(uniform, weighted)
    torch.testing.assert_close(weighted, rescaled)


def test_scale_is_clamped_and_logged():
    similarity = WPSESimilarity(embed_dim=2, init_scale=100.0)  # at max_scale; above it is refused
    assert similarity.scale().item() == pytest.approx(100.0)
    assert similarity.metrics() == {"logit_scale": pytest.approx(100.0)}
    assert not any(p.requires_grad for p in WPSESimilarity(embed_dim=2, learn_scale=False).parameters())


# ---------------------------------------------------------------- prompt ensembling


@pytest.mark.parametrize("kernel", ["gaussian", "imq"])
def test_ensemble_logits_are_the_mean_of_prompt_logits(kernel):
    """WPSE logits are linear in (ū, z̄): logits(image, union of a group's prompts with weights / count)
    = mean over the group's prompts of logits(image, prompt), for the same features."""
    similarity = WPSESimilarity(embed_dim=5, kernel=kernel, num_features=24)
    images = random_points(3, 4, 5, seed=1)
    prompts = random_points(6, 3, 5, weighted=True, seed=2)
    mask = torch.ones(6, 3, dtype=torch.bool)
    mask[1, 2] = False
    prompts = PointSet(prompts.points.detach(), prompts.weights, mask)
    groups = torch.tensor([1, 0, 1, 2, 1, 0])
    with torch.no_grad():
        ensembled = similarity.ensemble(prompts, groups)
        assert ensembled.points.shape == (3, 3 * 3, 5)  # K = 3 prompts in group 1
        per_prompt = similarity(images, prompts, generator=seeded(4)).i2t  # [3 images, 6 prompts]
        expected = torch.stack([per_prompt[:, groups == g].mean(dim=1) for g in range(3)], dim=1)
        torch.testing.assert_close(similarity(images, ensembled, generator=seeded(4)).i2t, expected)
    # Each group's weights sum to 1; padding slots and masked points are masked out with weight 0.
    torch.testing.assert_close(ensembled.weights.sum(dim=1), torch.ones(3))
    assert (ensembled.weights[~ensembled.mask] == 0).all()
    assert int(ensembled.mask.sum()) == 6 * 3 - 1


def test_ensemble_of_signed_count_weights_is_the_mean_of_prompt_logits():
    """The WPSE code's signed weights ("count": w / M_real) ensemble to the same mixture: the
    union keeps each prompt's mixture weights instead of re-dividing by their (maybe ~0) sum."""
    similarity = WPSESimilarity(embed_dim=5, num_features=24)
    images = random_points(3, 4, 5, seed=1)
    prompts = random_points(4, 3, 5, seed=2)
    signed = torch.tensor([[0.9, -0.5, 0.1], [0.2, 0.3, -0.4], [-0.7, 0.6, 0.05], [0.5, -0.5, 0.2]])
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[2, 2] = False
    prompts = PointSet(prompts.points.detach(), signed, mask, "count")
    groups = torch.tensor([0, 1, 0, 0])
    with torch.no_grad():
        ensembled = similarity.ensemble(prompts, groups)
        assert ensembled.weight_normalization == "count"
        per_prompt = similarity(images, prompts, generator=seeded(4)).i2t
        expected = torch.stack([per_prompt[:, groups == g].mean(dim=1) for g in range(2)], dim=1)
        torch.testing.assert_close(similarity(images, ensembled, generator=seeded(4)).i2t, expected)


def test_ensemble_rejects_empty_groups():
    with pytest.raises(ValueError, match="missing"):
        WPSESimilarity(embed_dim=8).ensemble(random_points(2, 1, 8), torch.tensor([0, 2]))


def test_cosine_mean_matches_loops_and_ensembles_like_clip():
    similarity = CosineMeanSimilarity(init_scale=4.0)
    a, b = leaf_points(3, 2, 4, seed=1, masked=True), leaf_points(2, 3, 4, seed=2)
    fast = similarity(a, b).i2t
    scale = similarity.scale()

    def mean(x, row):
        keep = x.mask[row] if x.mask is not None else torch.ones(x.num_points, dtype=torch.bool)
        weights = torch.where(keep, x.weights[row], torch.zeros_like(x.weights[row]))
        return sum(weights[i] * x.points[row, i] for i in range(x.num_points)) / weights.sum()

    slow = torch.stack(
        [
            torch.stack(
                [
                    scale * (mean(a, i) @ mean(b, j)) / (mean(a, i).norm() * mean(b, j).norm())
                    for j in range(b.batch_size)
                ]
            )
            for i in range(a.batch_size)
        ]
    )
    torch.testing.assert_close(fast, slow)
    leaves = [a.points, a.weights, b.points, b.weights]
    for g_fast, g_slow in zip(
        torch.autograd.grad(fast.sum(), leaves), torch.autograd.grad(slow.sum(), leaves), strict=True
    ):
        torch.testing.assert_close(g_fast, g_slow)
    prompts = PointSet(
        torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]], [[0.6, 0.8], [0.6, 0.8]]])
    )
    ensembled = similarity.ensemble(prompts, torch.tensor([0, 0, 1]))
    expected = torch.tensor([[1 / math.sqrt(2), 1 / math.sqrt(2)], [0.6, 0.8]])
    assert ensembled.points.shape == (2, 1, 2)
    torch.testing.assert_close(ensembled.points[:, 0], expected)


# ---------------------------------------------------------------- contract and bad arguments


@pytest.mark.parametrize("kernel", ["gaussian", "imq"])
@pytest.mark.parametrize("weighted", [False, True])
def test_contract(kernel, weighted):
    check_similarity(WPSESimilarity(embed_dim=8, kernel=kernel, num_features=64), weighted=weighted)
    check_similarity(CosineMeanSimilarity(), weighted=weighted)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kernel": "laplace"}, "kernel"),
        ({"alpha": [-0.1, 1.0]}, "alpha"),
        ({"alpha": [0.0, 0.0]}, "alpha"),
        ({"alpha": [1.0]}, "alpha"),
        ({"sigma": 0.0}, "sigma"),
        ({"sigma": -1.0}, "sigma"),
        ({"c": 0.0}, "c must"),
        ({"num_features": 0}, "num_features"),
        ({"embed_dim": 0}, "embed_dim"),
        ({"init_scale": 0.0}, "init_scale"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WPSESimilarity(**{"embed_dim": 4, **kwargs})


def test_wrong_point_dimension_is_reported():
    with pytest.raises(ValueError, match="dimension 4"):
        WPSESimilarity(embed_dim=4)(random_points(2, 1, 8), random_points(2, 1, 8))
    with pytest.raises(ValueError, match="init_scale"):
        CosineMeanSimilarity(init_scale=-1.0)
