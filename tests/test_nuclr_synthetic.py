"""NUCLR's synthetic experiment (seed 004, Appendix B; plugins/experiments/nuclr_synthetic.py).

References are independent of the module's closed forms: scipy quadrature of the density,
Monte Carlo, autograd of problem (5), the fixed point of Theorem 1 (eq. 6) written with
logsumexp, and Remark 2's identity between the uniform-q̃ risk and the global contrastive loss.
"""

from __future__ import annotations

import importlib
import json
import math

import numpy as np
import pytest
import torch

from clipkit.plugins.experiments import nuclr_synthetic as ns

F64 = torch.float64
TAU = ns.TAU


class Imported:
    """A module imported at its first use: scipy takes ~1.5 CPU-s to import, which every xdist
    worker would pay at collection although one of them runs these tests."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attribute: str):
        return getattr(importlib.import_module(self.name), attribute)


integrate, stats = Imported("scipy.integrate"), Imported("scipy.stats")


def unnormalised(o: tuple[float, float]):
    """exp(o·a/τ) as a scipy integrand f(a₂, a₁) (dblquad integrates the first argument innermost)."""
    return lambda y, x: math.exp((o[0] * x + o[1] * y) / TAU)


def quad_partition(o: tuple[float, float]) -> float:
    return integrate.dblquad(unnormalised(o), 0, 1, 0, 1, epsabs=0, epsrel=1e-13)[0]


@pytest.mark.parametrize(
    "o",
    [(0.3, 0.8), (-1.0, 0.0), (0.0, 0.5), (1e-7, 3e-7), (-3e-7, 0.2), (-0.6, 0.7), (0.70710678, 0.70710678)],
)
def test_log_partition_matches_numerical_integration(o):
    """Closed form Π_k (e^{λ_k} − 1)/λ_k against 2-D quadrature, including λ ≈ 0 on both sides
    of the Taylor branch (|λ| < 1e-6) and λ = 0 exactly."""
    closed = float(ns.log_partition(torch.tensor(o, dtype=F64)))
    assert closed == pytest.approx(math.log(quad_partition(o)), rel=1e-11, abs=1e-12)


BRANCH = 1e-4  # conditional_mean_1d switches to its series below |λ| = 1e-4


@pytest.mark.parametrize(
    "rate", [-7.0, -BRANCH * (1 + 1e-9), -BRANCH * (1 - 1e-9), 0.0, 3e-5, BRANCH * 1.001, 5.0]
)
def test_conditional_mean_matches_quadrature(rate):
    """E[x] of the truncated exponential on [0, 1], on both sides of the series branch at |λ| = 1e-4."""
    numerator = integrate.quad(lambda x: x * math.exp(rate * x), 0, 1, epsabs=0, epsrel=1e-13)[0]
    denominator = integrate.quad(lambda x: math.exp(rate * x), 0, 1, epsabs=0, epsrel=1e-13)[0]
    closed = float(ns.conditional_mean_1d(torch.tensor(rate, dtype=F64)))
    assert closed == pytest.approx(numerator / denominator, abs=1e-12)


def test_anchors_are_uniform_on_the_half_disk():
    """Inside O, centroid (0, 4/(3π)) and E‖o‖² = 1/2 of the uniform half disk, within 5 SE."""
    o = ns.sample_anchors(100_000, torch.Generator().manual_seed(0))
    assert bool((o.norm(dim=1) <= 1).all()) and bool((o[:, 1] >= 0).all())
    expected = torch.tensor([0.0, 4 / (3 * math.pi), 0.5], dtype=F64)
    values = torch.stack([o[:, 0], o[:, 1], o.square().sum(1)], dim=1)
    standard_error = values.std(dim=0) / math.sqrt(len(o))
    assert bool(((values.mean(0) - expected).abs() < 5 * standard_error).all())


def coordinate_cdf(rate: float):
    """CDF of density ∝ exp(λx) on [0, 1] by cumulative trapezoid quadrature, interpolated."""
    grid = np.linspace(0.0, 1.0, 20_001)
    cumulative = integrate.cumulative_trapezoid(np.exp(rate * grid), grid, initial=0.0)
    return lambda x: np.interp(x, grid, cumulative / cumulative[-1])


@pytest.mark.parametrize("o", [(-0.6, 0.7), (0.0, 0.95)])
def test_sampler_matches_the_density(o):
    """a | o by inverse CDF: its mean is ∫ a p(a|o) da (2-D quadrature) within 5 SE, each coordinate
    passes a KS test against the quadrature CDF, and the coordinates are uncorrelated."""
    count = 100_000
    anchors = torch.tensor([o], dtype=F64).expand(count, 2)
    a = ns.sample_contrast(anchors, torch.Generator().manual_seed(1))
    assert bool(((a >= 0) & (a <= 1)).all())
    partition = quad_partition(o)
    for k in range(2):
        moment = integrate.dblquad(lambda y, x, k=k: (x, y)[k] * unnormalised(o)(y, x), 0, 1, 0, 1)[0]
        standard_error = float(a[:, k].std()) / math.sqrt(count)
        assert abs(float(a[:, k].mean()) - moment / partition) < 5 * standard_error
        assert stats.kstest(a[:, k].numpy(), coordinate_cdf(o[k] / TAU)).pvalue > 1e-3
    assert abs(float(torch.corrcoef(a.T)[0, 1])) < 5 / math.sqrt(count)


def test_true_risk_quadrature_matches_monte_carlo_and_conditional_entropy():
    """L by polar quadrature against −τ log p averaged over 100k sampled pairs (within 4 SE), and the
    closed-form E_{a|o}[−τ log p(a|o)] against 2-D quadrature at one anchor."""
    generator = torch.Generator().manual_seed(2)
    o = ns.sample_anchors(100_000, generator)
    a = ns.sample_contrast(o, generator)
    losses = -(o * a).sum(1) + TAU * ns.log_partition(o)
    standard_error = float(losses.std()) / math.sqrt(len(losses))
    assert abs(ns.true_risk(grid=200) - float(losses.mean())) < 4 * standard_error
    assert ns.true_risk(grid=100) == pytest.approx(ns.true_risk(grid=200), abs=5e-6)  # O(grid⁻²) error

    anchor = (0.4, 0.5)
    log_z = math.log(quad_partition(anchor))
    density = unnormalised(anchor)

    def integrand(y, x):
        return -TAU * ((anchor[0] * x + anchor[1] * y) / TAU - log_z) * density(y, x) / math.exp(log_z)

    expected = integrate.dblquad(integrand, 0, 1, 0, 1, epsabs=0, epsrel=1e-12)[0]
    assert float(ns.conditional_risk(torch.tensor(anchor, dtype=F64))) == pytest.approx(expected, abs=1e-11)


def small_problem(n: int, seed: int):
    o, a = ns.sample_pairs(n, seed)
    return o, a, ns.ExpKernel.build(o @ a.T)


def test_popularity_is_the_sum_of_conditional_densities():
    """q from the kernel's column sums equals Σ_{j'} p(a_j | o_{j'}) with p from its definition."""
    o, a, kernel = small_problem(70, 3)
    partitions = {i: quad_partition(tuple(o[i].tolist())) for i in range(0, 70, 7)}
    direct = torch.tensor(
        [sum(math.exp(float(o[i] @ a[j]) / TAU) / z for i, z in partitions.items()) for j in range(5)],
        dtype=F64,
    )
    subset = ns.ExpKernel.build(o[::7] @ a[:5].T)
    assert torch.allclose(ns.true_popularity(subset, o[::7]), direct, rtol=1e-10)
    assert torch.allclose(ns.true_popularity(kernel, o), ns.pair_log_density(o, a).exp().sum(0), rtol=1e-12)


def test_gradient_of_problem_5_matches_autograd():
    o, a, kernel = small_problem(60, 4)
    zeta = (torch.rand(60, generator=torch.Generator().manual_seed(5), dtype=F64) - 0.5).requires_grad_()
    (expected,) = torch.autograd.grad(ns.popularity_objective(zeta, o @ a.T), zeta)
    assert torch.allclose(ns.popularity_gradient(kernel, zeta.detach()), expected, rtol=1e-10, atol=1e-15)


def test_solution_is_stationary_and_a_fixed_point_of_theorem_1():
    """At ζ* of (5): autograd's ∇F ≈ 0, and eq. (6) holds,
    ζ_j/τ = log Σ_{j'} exp(e_{j'j}/τ) / Σ_{i'} exp((e_{j'i'} − ζ_{i'})/τ)."""
    o, a, kernel = small_problem(200, 6)
    solution = ns.solve_popularity(kernel)
    assert solution.converged and solution.grad_norm <= 1e-15 and solution.steps < 100
    zeta = solution.zeta.clone().requires_grad_()
    (gradient,) = torch.autograd.grad(ns.popularity_objective(zeta, o @ a.T), zeta)
    assert float(gradient.norm()) < 1e-13
    e = o @ a.T / TAU
    denominators = torch.logsumexp(e - solution.zeta / TAU, dim=1)  # [j'] over i'
    right = torch.logsumexp(e - denominators.unsqueeze(1), dim=0)  # [j] over j'
    assert torch.allclose(solution.zeta / TAU, right, atol=1e-10)
    assert abs(float(solution.zeta.mean())) < 1e-12  # descent from 0 keeps the mean (gradient sums to 0)


def test_q_tilde_recovers_q_up_to_a_constant():
    """Appendix B / Theorem 1 at n = 100: Pearson correlation of log q̃ = ζ*/τ with log q, and of
    q̃ = exp(ζ*/τ) with q, both > 0.99 (Pearson ignores the constant Z in either form)."""
    o, a, kernel = small_problem(100, 0)
    q = ns.true_popularity(kernel, o)
    zeta = ns.solve_popularity(kernel).zeta
    assert ns.pearson(zeta / TAU, q.log()) > 0.99
    assert ns.pearson((zeta / TAU).exp(), q) > 0.99
    assert float(q.log().max() - q.log().min()) > 1.5  # q varies: a uniform q̃ (GCL) is far from it


def test_uniform_q_tilde_is_the_global_contrastive_loss():
    """Remark 2: with q̃ = n (μ(A) = 1), eq. (3) is τ·(InfoNCE over all n candidates − log n)."""
    o, a, kernel = small_problem(50, 7)
    infonce = -torch.log_softmax(o @ a.T / TAU, dim=1).diagonal().mean()
    risk = ns.empirical_risk(kernel, torch.full((50,), math.log(50), dtype=F64))
    assert risk == pytest.approx(float(TAU * (infonce - math.log(50))), abs=1e-12)


def test_nuclr_generalises_better_than_gcl():
    """Figure 2 right at n = 400 (3 seeds): NUCLR's |L̂ − L| is far below GCL's, which does not shrink."""
    study = ns.run_study(ns=(50, 400), seeds=(0, 1, 2), risk_grid=100)
    small, large = (row["generalization_error"] for row in study["per_n"])
    assert large["nuclr"]["mean"] < 0.5 * large["gcl"]["mean"]
    assert large["gcl"]["mean"] > 0.03 and large["gcl"]["mean"] > 0.5 * small["gcl"]["mean"]
    assert all(t["solver_converged"] for t in study["trials"])


def test_command_writes_report_files(tmp_path):
    report = ns.run_nuclr_experiment(tmp_path / "out", ns=(30, 60), seeds=(0, 1), plot_n=40, risk_grid=50)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "nuclr_synthetic.json",
        "nuclr_synthetic.md",
        "nuclr_synthetic.png",
    ]  # no temporary files left behind
    assert json.loads((out / "nuclr_synthetic.json").read_text()) == json.loads(json.dumps(report))
    assert [row["n"] for row in report["per_n"]] == [30, 60] and len(report["trials"]) == 4
    assert report["recovery"]["n"] == 40 and len(report["recovery"]["q"]) == 40
    table = (out / "nuclr_synthetic.md").read_text()
    assert "| 60 |" in table and "GCL" in table
    assert (out / "nuclr_synthetic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="tau"):
        ns.run_study(ns=(10,), seeds=(0,), tau=0.001)
    with pytest.raises(ValueError, match="ns"):
        ns.run_study(ns=(), seeds=(0,))
    with pytest.raises(ValueError, match="seeds"):
        ns.run_study(ns=(10,), seeds=())
