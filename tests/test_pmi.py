"""PMI-fidelity benchmark (plugins/experiments/pmi.py, METHODS.md §8).

The closed-form PMI against a brute-force joint density (scipy) and against the identities
E_{p(x)p(y)}[exp PMI] = 1 (quadrature: exact; Monte Carlo: within standard errors); the true
PMI as the population minimiser of InfoNCE (stationary, and strictly better than perturbations,
with a negative control); the fidelity metrics on hand-made cases; a tiny benchmark run.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.testing import check_encoder
from clipkit.contract.types import Logits, LossContext
from clipkit.plugins.experiments.pmi import (
    LatentPairDistribution,
    PointSetMLP,
    infonce,
    infonce_gap,
    parse_entries,
    pmi_fidelity,
    run_pmi_benchmark,
)
from clipkit.plugins.losses.infonce import InfoNCE


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: on a busy machine, torch's thread synchronisation costs more than it saves."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def small_distribution(**overrides) -> LatentPairDistribution:
    """K = 3, unequal dimensions, priors and noise levels: nothing symmetric to hide a bug."""
    options = {"prior": [0.5, 0.3, 0.2], "separation": 1.5, "noise_x": 0.7, "noise_y": 1.1, "seed": 5}
    options.update(overrides)
    return LatentPairDistribution(3, 2, 3, **options)


# ---------------------------------------------------------------------------------------------
# The distribution and its closed-form PMI
# ---------------------------------------------------------------------------------------------


def test_closed_form_pmi_equals_brute_force_joint_density():
    """PMI = log p(x, y) − log p(x) − log p(y) from the full mixture densities (scipy's Gaussian
    log-pdfs, normalising constants included) equals the posterior formula."""
    stats = pytest.importorskip("scipy.stats")
    numpy = pytest.importorskip("numpy")
    distribution = small_distribution()
    generator = torch.Generator().manual_seed(0)
    x, y, _ = distribution.sample_pairs(7, generator)
    x2, y2 = distribution.sample_independent(5, generator)
    x, y = torch.cat([x, x2]), torch.cat([y, y2])  # both joint and independent pairs in the grid
    prior = distribution.prior.numpy()

    def log_components(points, means, noise):  # [N, K] log π_z + log N(point; μ_z, noise² I)
        dim = means.shape[1]
        return torch.stack(
            [
                torch.from_numpy(
                    stats.multivariate_normal(means[k].numpy(), noise**2 * numpy.eye(dim)).logpdf(
                        points.double().numpy()
                    )
                )
                + math.log(prior[k])
                for k in range(len(prior))
            ],
            dim=1,
        )

    log_x = log_components(x, distribution.means_x, distribution.noise_x)
    log_y = log_components(y, distribution.means_y, distribution.noise_y)
    # p(x, y) = Σ_z π_z p(x|z) p(y|z): add the components' log-densities, subtract the doubled log π_z.
    log_joint = torch.logsumexp(log_x[:, None, :] + log_y[None, :, :] - torch.from_numpy(prior).log(), dim=-1)
    expected = log_joint - torch.logsumexp(log_x, 1)[:, None] - torch.logsumexp(log_y, 1)[None, :]

    actual = distribution.pmi(x, y, block_size=4)  # several row blocks
    assert actual.shape == (12, 12) and actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(distribution.pmi_paired(x, y), expected.diagonal(), rtol=0, atol=1e-10)


def test_exp_pmi_integrates_to_one_by_quadrature():
    """E_{p(x)p(y)}[exp PMI] = ∫∫ p(x, y) = 1 and E_{p(x)}[p(z|x)] = π_z, exactly (1-D quadrature
    on a fine grid: the integrands are smooth Gaussians, so the Riemann sum is accurate to 1e-9)."""
    distribution = LatentPairDistribution(
        3, 1, 1, prior=[0.6, 0.3, 0.1], separation=2.0, noise_x=0.8, noise_y=1.3, seed=2
    )
    grid = torch.linspace(-14, 14, 1401, dtype=torch.float64)[:, None]
    step = float(grid[1] - grid[0])

    def marginal_density(means, noise):  # [G] p(v) of the 1-D mixture on the grid
        normal = torch.exp(-((grid - means.t()) ** 2) / (2 * noise**2)) / math.sqrt(2 * math.pi * noise**2)
        return normal @ distribution.prior

    p_x = marginal_density(distribution.means_x, distribution.noise_x)
    p_y = marginal_density(distribution.means_y, distribution.noise_y)
    assert abs(float(p_x.sum() * step) - 1) < 1e-9  # the grid covers the mass
    integral = p_x @ distribution.pmi(grid, grid).exp() @ p_y * step**2
    assert abs(float(integral) - 1) < 1e-8
    torch.testing.assert_close(
        (p_x[:, None] * distribution.log_posterior_x(grid).exp()).sum(0) * step,
        distribution.prior,
        rtol=0,
        atol=1e-9,
    )


def test_exp_pmi_averages_to_one_over_independent_pairs_monte_carlo():
    """Sample mean of exp PMI over n independent pairs is 1 within 4 standard errors; the same
    statistic over joint pairs (E = 1 + χ²(p(x,y) ‖ p(x)p(y)) > 1) is far from 1, so the check
    can tell the two samplers (and a wrong PMI) apart."""
    distribution = small_distribution()
    generator = torch.Generator().manual_seed(1)
    n = 100_000
    values = distribution.pmi_paired(*distribution.sample_independent(n, generator)).exp()
    standard_error = float(values.std()) / math.sqrt(n)
    assert standard_error < 0.01  # the tolerance below is tight enough to mean something
    assert abs(float(values.mean()) - 1) < 4 * standard_error

    x, y, _ = distribution.sample_pairs(n, generator)
    joint_values = distribution.pmi_paired(x, y).exp()
    assert float(joint_values.mean()) > 1 + 20 * float(joint_values.std()) / math.sqrt(n)
    # exp PMI ≤ max_z 1/π_z, since the posteriors sum to 1: finite variance, the SE is meaningful.
    assert float(joint_values.max()) <= float(1 / distribution.prior.min()) + 1e-9


def test_mutual_information_is_between_zero_and_latent_entropy():
    distribution = small_distribution()
    information = distribution.mutual_information(20_000, torch.Generator().manual_seed(0))
    entropy = float(-(distribution.prior * distribution.prior.log()).sum())
    assert 0.1 < information < entropy  # I(X;Y) ≤ I(Z;Y) ≤ H(Z) (data processing)


def test_distribution_is_deterministic_given_seed_and_validates():
    a, b = small_distribution(), small_distribution()
    assert torch.equal(a.means_x, b.means_x) and torch.equal(a.means_y, b.means_y)
    first = a.sample_pairs(4, torch.Generator().manual_seed(3))
    second = b.sample_pairs(4, torch.Generator().manual_seed(3))
    assert all(torch.equal(u, v) for u, v in zip(first, second, strict=True))
    assert not torch.equal(small_distribution(seed=6).means_x, a.means_x)
    default = LatentPairDistribution(4)
    torch.testing.assert_close(default.prior, torch.tensor([12, 6, 4, 3], dtype=torch.float64) / 25)
    with pytest.raises(ValueError, match="prior"):
        LatentPairDistribution(3, prior=[0.5, 0.5])
    with pytest.raises(ValueError, match="prior"):
        LatentPairDistribution(2, prior=[1.0, 0.0])


# ---------------------------------------------------------------------------------------------
# The true PMI minimises InfoNCE in expectation
# ---------------------------------------------------------------------------------------------


def _batched_infonce_and_slope(logits, direction):
    """logits, direction [R, N, N] -> (InfoNCE [R], d/dt InfoNCE(logits + t·direction) at t = 0 [R]).

    Per row, d/dt CE(L + tD, i) = Σ_j softmax(L)_j D_j − D_i (the same for the columns)."""
    diagonal = torch.arange(logits.shape[1])
    losses, slopes = [], []
    for rows, towards in ((logits, direction), (logits.transpose(1, 2), direction.transpose(1, 2))):
        log_softmax = torch.log_softmax(rows, dim=-1)
        losses.append(-log_softmax[:, diagonal, diagonal].mean(dim=1))
        expected = (log_softmax.exp() * towards).sum(dim=-1)  # [R, N]
        slopes.append((expected - towards[:, diagonal, diagonal]).mean(dim=1))
    return (losses[0] + losses[1]) / 2, (slopes[0] + slopes[1]) / 2


def _line_statistics(distribution, start, end, *, batches=300, batch_size=32, seed=0):
    """Along critic(t) = start + t·(end − start), both functions of (x, y, true PMI), on fresh joint
    batches: per batch (d/dt loss at t = 0, d/dt loss at t = 1, loss(1) − loss(0))
    -> (means [3], standard errors [3]). Paired: every critic sees the same batches."""
    generator = torch.Generator().manual_seed(seed)
    bases, ends = [], []
    for _ in range(batches):
        x, y, _ = distribution.sample_pairs(batch_size, generator)
        truth = distribution.pmi(x, y)
        bases.append(start(x, y, truth))
        ends.append(end(x, y, truth))
    base, target = torch.stack(bases), torch.stack(ends)
    loss_start, slope_start = _batched_infonce_and_slope(base, target - base)
    loss_end, slope_end = _batched_infonce_and_slope(target, target - base)
    rows = torch.stack([slope_start, slope_end, loss_end - loss_start], dim=1)
    return rows.mean(0), rows.std(0) / math.sqrt(batches)


def test_batched_infonce_and_slope_match_autograd():
    generator = torch.Generator().manual_seed(8)
    logits, direction = torch.randn(2, 3, 5, 5, generator=generator, dtype=torch.float64)
    losses, slopes = _batched_infonce_and_slope(logits, direction)
    for r in range(3):
        t = torch.zeros((), dtype=torch.float64, requires_grad=True)
        loss = infonce(logits[r] + t * direction[r])
        torch.testing.assert_close(losses[r], loss.detach())
        torch.testing.assert_close(slopes[r], torch.autograd.grad(loss, t)[0])


def test_true_pmi_minimises_infonce_in_expectation():
    """With finite batches the positive's posterior among the candidates is softmax_j PMI(x, y_j),
    and cross-entropy is a proper scoring rule, so PMI + const minimises the *expected* InfoNCE
    at every batch size (a single batch may prefer another critic). Paired Monte Carlo over 300
    batches: along the line from PMI to each perturbed critic the slope at PMI is 0 within 4 SE,
    while the perturbed critic's loss is higher and its slope positive, each by > 4 SE. The
    negative control runs the same stationarity check from a wrong "PMI" and sees it fail."""
    distribution = LatentPairDistribution(
        4, 2, 2, prior=[0.4, 0.3, 0.2, 0.1], separation=1.5, noise_x=0.8, noise_y=0.8, seed=3
    )
    uniform_prior = LatentPairDistribution(
        4, 2, 2, prior=[0.25] * 4, separation=1.5, noise_x=0.8, noise_y=0.8, seed=3
    )
    frequency = torch.tensor([1.0, -2.0], dtype=torch.float64)

    def true_pmi(x, y, truth):
        return truth

    def wrong_prior(x, y, truth):  # the PMI formula with a uniform prior: a plausible bug
        return uniform_prior.pmi(x, y)

    alternatives = {
        "colder": lambda x, y, truth: 1.25 * truth,
        "warmer": lambda x, y, truth: 0.8 * truth,
        "wrong prior": wrong_prior,
        "smooth bump": lambda x, y, truth: (
            truth + torch.cos((x.double() @ frequency)[:, None] - 2 * y.double()[None, :, 0])
        ),
    }
    for name, alternative in alternatives.items():
        mean, error = _line_statistics(distribution, true_pmi, alternative)
        slope_at_pmi, slope_at_alternative, loss_increase = mean.tolist()
        assert abs(slope_at_pmi) < 4 * float(error[0]), (name, mean, error)
        assert slope_at_alternative > 4 * float(error[1]), (name, mean, error)
        assert loss_increase > 4 * float(error[2]), (name, mean, error)

    mean, error = _line_statistics(distribution, wrong_prior, true_pmi, seed=1)
    assert mean[0] < -4 * error[0]  # from the wrong PMI, moving toward the true one lowers the loss

    # A constant shift changes nothing (the similarity is defined up to a constant), exactly.
    x, y, _ = distribution.sample_pairs(16, torch.Generator().manual_seed(9))
    truth = distribution.pmi(x, y)
    torch.testing.assert_close(infonce(truth + 3.0), infonce(truth), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def test_fidelity_of_constant_shift_is_perfect():
    true = torch.randn(6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    result = pmi_fidelity(true - 3.7, true)
    assert result["rmse"] < 1e-12 and abs(result["pearson"] - 1) < 1e-12
    assert abs(result["shift"] - 3.7) < 1e-12
    assert abs(pmi_fidelity(-true, true)["pearson"] + 1) < 1e-12


def test_fidelity_hand_case():
    """true = [0, 1, 2, 3], learned = [0, 1, 2, 5]: best shift c = mean(true − learned) = −0.5,
    residuals (−0.5, −0.5, −0.5, 1.5) -> RMSE = sqrt(3/4); centred (−2, −1, 0, 3)·(−1.5, −0.5,
    0.5, 1.5) = 8, norms sqrt(14), sqrt(5) -> r = 8/sqrt(70)."""
    result = pmi_fidelity(torch.tensor([0.0, 1, 2, 5]), torch.tensor([0.0, 1, 2, 3]))
    assert result["shift"] == pytest.approx(-0.5, abs=1e-12)
    assert result["rmse"] == pytest.approx(math.sqrt(0.75), abs=1e-12)
    assert result["pearson"] == pytest.approx(8 / math.sqrt(70), abs=1e-12)
    assert result["true_std"] == pytest.approx(math.sqrt(1.25), abs=1e-12)


def test_fidelity_matches_scipy_pearson_and_rejects_bad_input():
    stats = pytest.importorskip("scipy.stats")
    generator = torch.Generator().manual_seed(4)
    true = torch.randn(50, generator=generator, dtype=torch.float64)
    learned = 0.5 * true + torch.randn(50, generator=generator, dtype=torch.float64)
    assert pmi_fidelity(learned, true)["pearson"] == pytest.approx(
        stats.pearsonr(learned.numpy(), true.numpy())[0], abs=1e-12
    )
    with pytest.raises(ValueError, match="shape"):
        pmi_fidelity(true[:3], true[:4])
    with pytest.raises(ValueError, match="finite"):
        pmi_fidelity(torch.tensor([0.0, float("-inf")]), torch.tensor([0.0, 1.0]))


def test_infonce_hand_case_and_plugin_agreement():
    """[[2, 0], [0, 2]]: every row's CE is log(1 + e⁻²) ≈ 0.126928 (the plugin's hand case)."""
    assert float(infonce(torch.tensor([[2.0, 0.0], [0.0, 2.0]]))) == pytest.approx(0.126928, abs=1e-6)
    i2t = torch.randn(5, 5, generator=torch.Generator().manual_seed(2))
    t2i = torch.randn(5, 5, generator=torch.Generator().manual_seed(3))
    plugin = InfoNCE()(Logits(i2t, t2i), torch.arange(5), LossContext()).loss
    torch.testing.assert_close(infonce(i2t, t2i), plugin)
    assert infonce_gap(i2t + 2.0, i2t.double()) == pytest.approx(0.0, abs=1e-6)
    assert infonce_gap(Logits(i2t, t2i), i2t.double()) == pytest.approx(
        float(plugin) - float(infonce(i2t)), abs=1e-6
    )


# ---------------------------------------------------------------------------------------------
# Encoders and the benchmark
# ---------------------------------------------------------------------------------------------


def test_point_set_mlp_contract():
    torch.manual_seed(0)
    out = check_encoder(PointSetMLP(3, 4, 5, weighted=True, hidden=8), torch.randn(6, 3))
    assert out.points.shape == (6, 5, 4) and out.weights.shape == (6, 5)
    assert check_encoder(PointSetMLP(3, 4, 1, weighted=False, hidden=8), torch.randn(6, 3)).weights is None


def test_parse_entries_labels_and_defaults():
    entries = parse_entries(["dot", {"name": "wpse", "kernel": "imq", "points": 2}], points=7)
    assert [e.label for e in entries] == ["dot", "wpse (kernel=imq)"]
    assert entries[1].config == {"name": "wpse", "kernel": "imq"} and entries[1].points == 2
    assert entries[0].points == 7 and entries[0].weighted
    assert [e.label for e in parse_entries(None, 8)][:2] == ["dot (CLIP)", "cosine_mean"]
    with pytest.raises(ValueError, match="unique"):
        parse_entries(["dot", "dot"], points=1)


class NegativeSquaredDistance(nn.Module):
    """A third-party similarity: −s‖ū − v̄‖² of the point means (only here to join by name)."""

    def __init__(self, scale: float = 5.0):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(scale))

    def forward(self, a, b, *, generator=None):
        return Logits.symmetric(-self.scale * torch.cdist(a.mean(), b.mean()).square())


class ThirdPartyPlugin:
    @hookimpl
    def register_similarities(self, register):
        register("neg_sq_distance", NegativeSquaredDistance)


def test_tiny_benchmark_writes_ranked_report(tmp_path):
    from clipkit.contract.manager import make_plugin_manager
    from clipkit.contract.registry import Registry

    registry = Registry(make_plugin_manager(autoload=False, extra_plugins=[ThirdPartyPlugin()]))
    options = {"embed_dim": 3, "points": 2, "steps": 3, "batch_size": 16, "eval_batches": 2, "seed": 1}
    entries = ["dot", {"name": "kme", "label": "kme M=2"}, {"name": "neg_sq_distance", "points": 1}]
    report = run_pmi_benchmark(entries, out_dir=tmp_path, registry=registry, **options)

    labels = [r["label"] for r in report["results"]]
    assert sorted(labels) == ["dot", "kme M=2", "neg_sq_distance"] and report["ranking"] == labels
    assert [r["rank"] for r in report["results"]] == [1, 2, 3]
    pearsons = [r["pearson"] for r in report["results"]]
    assert pearsons == sorted(pearsons, reverse=True)
    by_gap = sorted(report["results"], key=lambda r: r["infonce_gap"])
    assert report["ranking_by_infonce_gap"] == [r["label"] for r in by_gap]
    assert [r["rank_infonce_gap"] for r in by_gap] == [1, 2, 3]
    for result in report["results"]:
        assert all(math.isfinite(result[k]) for k in ("pearson", "rmse", "infonce", "infonce_gap"))
        assert result["infonce"] - result["infonce_gap"] == pytest.approx(
            report["reference"]["infonce_true_pmi"], abs=1e-5
        )

    saved = json.loads((tmp_path / "pmi_fidelity.json").read_text())
    assert saved["ranking"] == labels and saved["config"]["steps"] == 3
    table = (tmp_path / "pmi_fidelity.md").read_text()
    assert all(f"| {rank} | {label} |" in table for rank, label in enumerate(labels, start=1))
    assert (tmp_path / "pmi_fidelity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

    again = run_pmi_benchmark(entries, registry=registry, **options)  # deterministic given seed
    assert [(r["label"], r["pearson"], r["rmse"]) for r in again["results"]] == [
        (r["label"], r["pearson"], r["rmse"]) for r in report["results"]
    ]
