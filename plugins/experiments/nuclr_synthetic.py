"""NUCLR's synthetic experiment (seed 004, Appendix B, Figure 2; METHODS.md §6, last bullet).

The question: if we knew the true similarity e(o, a), how close would each *empirical* risk of
discriminative probabilistic modelling get to the *true* risk as the sample grows?

Setup (Appendix B): anchors o uniform on the upper half of the unit disk O, contrast data a in
the unit square A = [0, 1]², and p(a | o) ∝ exp(o·a/τ) on A with τ = 0.2 and e(o, a) = o·a.
Because o·a = o₁a₁ + o₂a₂ the density factorises into two truncated exponentials on [0, 1], so

    ∫_A exp(o·a/τ) da = Π_k (exp(λ_k) − 1)/λ_k,   λ_k = o_k/τ      (→ 1 as λ_k → 0),

a | o is sampled exactly by the inverse CDF of each coordinate (the paper used rejection
sampling; both draw from the same distribution), and the true risk has a closed form per o.

Empirical risks compared, each with the *true* e (nothing is learned except ζ):
  • MLE:    eq. (2), −(1/n) Σ_i τ log p(a_i|o_i) with the exact partition function;
  • NUCLR:  eq. (3) with q̃ = exp(ζ*/τ)/Z, ζ* the solution of problem (5) found by full-batch
            gradient descent, and Z = max_j exp(ζ*_j/τ) / max_j q^{(j)} (Appendix B's estimate);
  • GCL:    eq. (3) with the uniform q̃^{(j)} = n/μ(A) = n (Remark 2: the global contrastive loss);
  • also, for reference, NUCLR with Z from the mean of log ratios ("log-mean Z"), and eq. (3)
    with the true q (multiple importance sampling with the balance heuristic, the target NUCLR's
    q̃ approximates).
q is the paper's finite-sample popularity q^{(j)} = Σ_{j'} p(a_j | o_{j'}) (§2.1, eq. 4, Appendix
B), not its population version ∫ p(a_j | o) dP(o); Theorem 1 relates ζ* to the finite sum.
The generalisation error of a method is |L̂(Ô, Â) − L| (Figure 2 right), L = E[−τ log p(a|o)]
the true risk (eq. 8 at the true w), which here is computed by quadrature over O of the closed
form, not estimated on 50,000 sampled pairs as in the paper (the tests check both agree).

Entry point: :func:`run_nuclr_experiment` (CLI: ``clipkit experiment nuclr-synthetic``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: Appendix B's temperature.
TAU = 0.2
#: Bound c on |e(o, a)| = |o·a| over O × A (‖o‖ ≤ 1, ‖a‖ ≤ √2; attained at o = (1, 1)/√2, a = (1, 1)),
#: the c of Assumption 2 used by Theorem 2's error term.
SIMILARITY_BOUND = math.sqrt(2.0)
#: Methods in the order the table lists them; the first three are Figure 2's curves.
METHODS = ("mle", "nuclr", "gcl", "nuclr_logmean_z", "mis_true_q")
LABELS = {
    "mle": "MLE (exact partition function)",
    "nuclr": "NUCLR (ζ from (5), paper's Z)",
    "gcl": "GCL (uniform q̃)",
    "nuclr_logmean_z": "NUCLR (ζ from (5), log-mean Z)",
    "mis_true_q": "MIS with the true q",
}
DEFAULT_NS = (50, 100, 200, 400, 800, 1600, 3200)
DEFAULT_SEEDS = (0, 1, 2, 3, 4)
F64 = torch.float64


# --------------------------------------------------------------------------------------------
# The distribution: anchors, the conditional density p(a | o) and its closed forms
# --------------------------------------------------------------------------------------------


def sample_anchors(n: int, generator: torch.Generator) -> Tensor:
    """[n, 2] float64 points uniform on O = {‖o‖ ≤ 1, o₂ ≥ 0}: radius √U (area element r dr dθ)."""
    radius = torch.rand(n, generator=generator, dtype=F64).sqrt()
    angle = torch.rand(n, generator=generator, dtype=F64) * math.pi
    return torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)


def log_partition_1d(rate: Tensor) -> Tensor:
    """log ∫_0^1 exp(λx) dx = log((e^λ − 1)/λ), elementwise for λ = ``rate``.

    Written as max(λ, 0) + log(1 − e^{−|λ|}) − log|λ| so no exponential overflows for any λ;
    near λ = 0 (0/0) the Taylor series λ/2 + λ²/24 is used (error O(λ⁴)).
    """
    magnitude = rate.abs().clamp_min(1e-300)
    exact = rate.clamp_min(0.0) + torch.log(-torch.expm1(-magnitude)) - magnitude.log()
    return torch.where(rate.abs() < 1e-6, rate / 2 + rate.square() / 24, exact)


def log_partition(o: Tensor, tau: float = TAU) -> Tensor:
    """[...] log ∫_A exp(o·a/τ) da for anchors o [..., 2]: the sum over the two coordinates."""
    return log_partition_1d(o / tau).sum(-1)


def conditional_mean_1d(rate: Tensor) -> Tensor:
    """E[x] for the density λe^{λx}/(e^λ − 1) on [0, 1]: 1/(1 − e^{−λ}) − 1/λ (→ ½ + λ/12 at 0)."""
    safe = torch.where(rate.abs() < 1e-4, torch.ones_like(rate), rate)
    exact = 1.0 / (-torch.expm1(-safe)) - 1.0 / safe
    return torch.where(rate.abs() < 1e-4, 0.5 + rate / 12, exact)


def conditional_mean(o: Tensor, tau: float = TAU) -> Tensor:
    """[..., 2] E[a | o] (the coordinates of a | o are independent)."""
    return conditional_mean_1d(o / tau)


def sample_contrast(o: Tensor, generator: torch.Generator, tau: float = TAU) -> Tensor:
    """[n, 2] one a_i ~ p(· | o_i) per anchor o_i [n, 2], exactly, by the inverse CDF per coordinate.

    Coordinate CDF F(x) = (e^{λx} − 1)/(e^λ − 1), so x = log(1 + u(e^λ − 1))/λ for u ~ U(0, 1).
    For λ > 0 the same x is 1 + log(1 + (1 − u)(e^{−λ} − 1))/λ, which never overflows; expm1 and
    log1p keep small |λ| accurate, and λ = 0 (uniform coordinate) gives x = u.
    """
    rate = o / tau
    uniform = torch.rand(o.shape, generator=generator, dtype=F64)
    safe = torch.where(rate == 0, torch.ones_like(rate), rate)
    negative = torch.log1p(uniform * torch.expm1(safe)) / safe
    positive = 1.0 + torch.log1p((1.0 - uniform) * torch.expm1(-safe)) / safe
    x = torch.where(safe > 0, positive, negative)
    return torch.where(rate == 0, uniform, x).clamp(0.0, 1.0)


def pair_log_density(o: Tensor, a: Tensor, tau: float = TAU) -> Tensor:
    """[n_o, n_a] log p(a_j | o_i) = o_i·a_j/τ − log ∫_A exp(o_i·a/τ) da."""
    return (o @ a.T) / tau - log_partition(o, tau).unsqueeze(1)


def conditional_risk(o: Tensor, tau: float = TAU) -> Tensor:
    """[...] E_{a|o}[−τ log p(a|o)] = −o·E[a|o] + τ log ∫_A exp(o·a/τ) da (τ × differential entropy)."""
    return -(o * conditional_mean(o, tau)).sum(-1) + tau * log_partition(o, tau)


def true_risk(tau: float = TAU, grid: int = 400) -> float:
    """L = E_{o,a}[−τ log p(a|o)] (eq. 8 at the true similarity), by quadrature over O.

    Midpoint rule in polar coordinates, ``grid`` radii × 2·``grid`` angles, weight ∝ r (the
    uniform density on O is r dr dθ/(π/2)). The integrand is smooth, so the error is O(grid⁻²):
    about 1e-7 at grid = 400 for τ = 0.2.
    """
    radius = (torch.arange(grid, dtype=F64) + 0.5) / grid
    angle = (torch.arange(2 * grid, dtype=F64) + 0.5) / (2 * grid) * math.pi
    r, theta = torch.meshgrid(radius, angle, indexing="ij")
    o = torch.stack([r * theta.cos(), r * theta.sin()], dim=-1)
    return float((conditional_risk(o, tau) * r).sum() / r.sum())


# --------------------------------------------------------------------------------------------
# exp(e/τ) on the sample: every n² computation is a matrix-vector product with one kernel
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpKernel:
    """exp(e_ij/τ) of an [n, n] similarity, stored row-stabilised as exp(e_ij/τ − row_max_i).

    Every entry is in (0, 1], and the sums below shift their weights by the maximum before
    exponentiating, so nothing overflows; nothing underflows while the range of a row of e/τ stays
    under ~700 (here ≤ √2/τ, so τ ≥ 0.01 is safe). One exp over n² entries is computed per
    sample; q, the gradient of (5) and each empirical risk are then matrix-vector products.
    """

    similarity: Tensor  # [n, n] e(o_i, a_j): row i = anchor i, positives on the diagonal
    tau: float
    row_max: Tensor  # [n] max_j e_ij/τ
    scaled: Tensor  # [n, n] exp(e_ij/τ − row_max_i)

    @classmethod
    def build(cls, similarity: Tensor, tau: float = TAU) -> ExpKernel:
        row_max = similarity.amax(dim=1) / tau
        return cls(similarity, tau, row_max, torch.exp(similarity / tau - row_max.unsqueeze(1)))

    def log_row_sums(self, log_weights: Tensor) -> Tensor:
        """[n] log Σ_j exp(e_ij/τ + log_weights_j) for [n] log_weights over candidates j."""
        shift = log_weights.max()
        return self.row_max + shift + torch.log(self.scaled @ torch.exp(log_weights - shift))

    def log_column_sums(self, log_weights: Tensor) -> Tensor:
        """[n] log Σ_i exp(e_ij/τ + log_weights_i) for [n] log_weights over anchors i."""
        shifted = log_weights + self.row_max
        shift = shifted.max()
        return shift + torch.log(self.scaled.T @ torch.exp(shifted - shift))


def true_popularity(kernel: ExpKernel, o: Tensor) -> Tensor:
    """[n] q^{(j)} = Σ_{j'} p(a_j | o_{j'}) (eq. 4): column sums of exp(e/τ) weighted by 1/∫_A exp(e/τ)."""
    return kernel.log_column_sums(-log_partition(o, kernel.tau)).exp()


# --------------------------------------------------------------------------------------------
# Problem (5): the popularity ζ
# --------------------------------------------------------------------------------------------


def popularity_objective(zeta: Tensor, similarity: Tensor, tau: float = TAU) -> Tensor:
    """The objective of problem (5), differentiable in ``zeta`` (the reference the tests use).

    zeta: [n]; similarity: [n, n] e(o_i, a_j), row i = anchor i, positives on the diagonal.
    F(ζ) = −(1/n) Σ_i τ log( exp(e_ii/τ) / Σ_j exp((e_ij − ζ_j)/τ) ) + (1/n) Σ_j ζ_j.
    """
    log_denominator = torch.logsumexp((similarity - zeta.unsqueeze(0)) / tau, dim=1)
    return tau * (log_denominator - similarity.diagonal() / tau).mean() + zeta.mean()


def popularity_gradient(kernel: ExpKernel, zeta: Tensor) -> Tensor:
    """[n] ∇F(ζ) = (1 − Σ_i P_ij)/n with P_ij = exp((e_ij − ζ_j)/τ) / Σ_k exp((e_ik − ζ_k)/τ).

    P is row-stochastic, so the gradient sums to 0 and gradient descent keeps mean ζ fixed.
    Σ_i P_ij = exp(−ζ_j/τ) Σ_i exp(e_ij/τ)/D_i with D_i the row's denominator: two products.
    """
    log_weights = -zeta / kernel.tau
    log_denominators = kernel.log_row_sums(log_weights)
    column_sums = torch.exp(log_weights + kernel.log_column_sums(-log_denominators))
    return (1.0 - column_sums) / zeta.numel()


@dataclass(frozen=True)
class PopularitySolution:
    """ζ from problem (5) and how the descent ended (grad_norm: ‖∇F(ζ)‖₂ at the returned ζ)."""

    zeta: Tensor
    steps: int
    grad_norm: float
    converged: bool


def solve_popularity(
    kernel: ExpKernel, *, steps: int = 500, lr: float = 1.0, tol: float = 1e-15
) -> PopularitySolution:
    """Minimise problem (5) over ζ by full-batch gradient descent from ζ₀ = 0 (Appendix B).

    kernel: exp(e/τ) of the [n, n] similarity (float64: the stopping rule is the paper's
            ‖∇F‖₂ < 1e-15).
    lr:     step size in units of n·τ, i.e. ζ ← ζ − lr·nτ·∇F(ζ). The Hessian of (5) is
            ⪯ diag(column sums of P)/(nτ) and the column sums are 1 at the optimum, so nτ is
            1/Lipschitz there; lr = 1 then reads ζ_j ← ζ_j + τ(Σ_i P_ij − 1), a first-order
            Sinkhorn step, and reaches 1e-15 in a few dozen steps for τ = 0.2.
    Stops at ‖∇F‖₂ ≤ ``tol`` or after ``steps`` updates. The optimum is unique up to ζ + z·1
    (Theorem 1); descent from 0 keeps mean ζ = 0.
    """
    n = kernel.similarity.shape[0]
    zeta = torch.zeros(n, dtype=kernel.scaled.dtype)
    step = 0
    while True:
        gradient = popularity_gradient(kernel, zeta)
        grad_norm = float(gradient.norm())
        if grad_norm <= tol or step == steps or not math.isfinite(grad_norm):
            return PopularitySolution(zeta, step, grad_norm, grad_norm <= tol)
        zeta = zeta - lr * n * kernel.tau * gradient
        step += 1


# --------------------------------------------------------------------------------------------
# Empirical risks and the error term of Theorem 2
# --------------------------------------------------------------------------------------------


def empirical_risk(kernel: ExpKernel, log_q_tilde: Tensor) -> float:
    """L̂(Ô, Â) of eq. (3): −(1/n) Σ_i τ log( exp(e_ii/τ) / Σ_j exp(e_ij/τ)/q̃_j ), [n] log q̃."""
    log_g = kernel.log_row_sums(-log_q_tilde)
    return float(kernel.tau * (log_g - kernel.similarity.diagonal() / kernel.tau).mean())


def mle_empirical_risk(o: Tensor, a: Tensor, tau: float = TAU) -> float:
    """Eq. (2) at the true similarity: −(1/n) Σ_i τ log p(a_i | o_i), exact partition function."""
    return float((-(o * a).sum(1) + tau * log_partition(o, tau)).mean())


def paper_log_z(zeta: Tensor, q: Tensor, tau: float = TAU) -> Tensor:
    """log Z with Z = max_j exp(ζ_j/τ) / max_j q^{(j)} (Appendix B), so q̃ = exp(ζ/τ)/Z."""
    return (zeta / tau).max() - q.log().max()


def log_mean_log_z(zeta: Tensor, q: Tensor, tau: float = TAU) -> Tensor:
    """log Z = mean_j (ζ_j/τ − log q^{(j)}): the least-squares constant between log q̃' and log q."""
    return (zeta / tau - q.log()).mean()


def error_term(kernel: ExpKernel, log_q_tilde: Tensor, q: Tensor) -> float:
    """Theorem 2's E(q̃, q; Ô, Â) = (1/n) Σ_i Σ_j |1/q̃_j − 1/q_j| exp((e_ii − c)/τ), c = √2."""
    anchors = torch.exp((kernel.similarity.diagonal() - SIMILARITY_BOUND) / kernel.tau).sum()
    return float(anchors * (torch.exp(-log_q_tilde) - 1.0 / q).abs().sum() / q.numel())


def pearson(x: Tensor, y: Tensor) -> float:
    """Pearson correlation of two [n] tensors."""
    return float(torch.corrcoef(torch.stack([x, y]))[0, 1])


# --------------------------------------------------------------------------------------------
# One trial and the study
# --------------------------------------------------------------------------------------------


def trial_generator(n: int, seed: int) -> torch.Generator:
    """The generator of trial (n, seed): every (n, seed) draws its own independent sample."""
    return torch.Generator().manual_seed(1_000_003 * int(seed) + int(n))


def sample_pairs(n: int, seed: int, tau: float = TAU) -> tuple[Tensor, Tensor]:
    """([n, 2] anchors o, [n, 2] contrast data a) of trial (n, seed)."""
    generator = trial_generator(n, seed)
    o = sample_anchors(n, generator)
    return o, sample_contrast(o, generator, tau)


@dataclass(frozen=True)
class Trial:
    """One dataset of n pairs: the empirical risk of every method and the recovered popularity."""

    n: int
    seed: int
    risks: dict[str, float]
    error_terms: dict[str, float]
    solution: PopularitySolution
    a: Tensor
    q: Tensor
    log_q_tilde: Tensor  # NUCLR's log q̃ = ζ/τ − log Z (paper's Z)

    def record(self, risk: float) -> dict[str, Any]:
        """JSON-ready summary: |L̂ − L| per method given the true risk."""
        return {
            "n": self.n,
            "seed": self.seed,
            "empirical_risk": self.risks,
            "generalization_error": {m: abs(v - risk) for m, v in self.risks.items()},
            "error_term": self.error_terms,
            "pearson_log_q": pearson(self.log_q_tilde, self.q.log()),
            "pearson_q": pearson(self.log_q_tilde.exp(), self.q),
            "solver_steps": self.solution.steps,
            "solver_grad_norm": self.solution.grad_norm,
            "solver_converged": self.solution.converged,
        }


def run_trial(
    n: int, seed: int, tau: float = TAU, *, steps: int = 500, lr: float = 1.0, tol: float = 1e-15
) -> Trial:
    """Sample n pairs, compute q, solve (5) and every method's empirical risk (eqs. 2, 3)."""
    o, a = sample_pairs(n, seed, tau)
    kernel = ExpKernel.build(o @ a.T, tau)  # e(o_i, a_j) = o_i·a_j, the true similarity
    q = true_popularity(kernel, o)
    solution = solve_popularity(kernel, steps=steps, lr=lr, tol=tol)
    log_q = {
        "nuclr": solution.zeta / tau - paper_log_z(solution.zeta, q, tau),
        "gcl": torch.full((n,), math.log(n), dtype=F64),  # q̃ = n/μ(A), μ(A) = 1
        "nuclr_logmean_z": solution.zeta / tau - log_mean_log_z(solution.zeta, q, tau),
        "mis_true_q": q.log(),
    }
    risks = {"mle": mle_empirical_risk(o, a, tau)}
    risks.update({name: empirical_risk(kernel, value) for name, value in log_q.items()})
    terms = {name: error_term(kernel, log_q[name], q) for name in ("nuclr", "gcl")}
    return Trial(n, seed, risks, terms, solution, a, q, log_q["nuclr"])


def summarize(records: Sequence[dict[str, Any]], key: str) -> dict[str, dict[str, float]]:
    """{method: {mean, std}} of records[·][key][method] (std with Bessel's correction; 0 for one)."""
    out = {}
    for method in records[0][key]:
        values = torch.tensor([r[key][method] for r in records], dtype=F64)
        std = float(values.std()) if values.numel() > 1 else 0.0
        out[method] = {"mean": float(values.mean()), "std": std}
    return out


def run_study(
    ns: Sequence[int] = DEFAULT_NS,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    tau: float = TAU,
    *,
    steps: int = 500,
    lr: float = 1.0,
    tol: float = 1e-15,
    risk_grid: int = 400,
) -> dict[str, Any]:
    """Every (n, seed) trial, and per n the mean ± std over seeds of |L̂ − L| for each method."""
    _validate(ns, seeds, tau, steps, lr)
    risk = true_risk(tau, risk_grid)
    trials = [run_trial(n, s, tau, steps=steps, lr=lr, tol=tol).record(risk) for n in ns for s in seeds]
    per_n = []
    for n in ns:
        rows = [t for t in trials if t["n"] == n]
        per_n.append(
            {
                "n": int(n),
                "generalization_error": summarize(rows, "generalization_error"),
                "error_term": summarize(rows, "error_term"),
                "pearson_log_q_min": min(r["pearson_log_q"] for r in rows),
                "pearson_q_min": min(r["pearson_q"] for r in rows),
            }
        )
    return {"true_risk": risk, "per_n": per_n, "trials": trials}


def _validate(ns: Sequence[int], seeds: Sequence[int], tau: float, steps: int, lr: float) -> None:
    if not ns or any(int(n) != n or n < 2 for n in ns):
        raise ValueError(f"ns must be integers ≥ 2, got {list(ns)}")
    if not seeds:
        raise ValueError("seeds must not be empty")
    if not tau >= 0.01:  # ExpKernel: a row of e/τ spans up to √2/τ, which must stay inside float64
        raise ValueError(f"tau must be ≥ 0.01, got {tau}")
    if steps < 0 or not lr > 0:
        raise ValueError(f"steps must be ≥ 0 and lr > 0, got steps={steps}, lr={lr}")


# --------------------------------------------------------------------------------------------
# The command: JSON, Markdown table and figure
# --------------------------------------------------------------------------------------------


def run_nuclr_experiment(
    out_dir: Path | str | None = None,
    *,
    ns: Sequence[int] = DEFAULT_NS,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    tau: float = TAU,
    steps: int = 500,
    lr: float = 1.0,
    tol: float = 1e-15,
    plot_n: int = 100,
    risk_grid: int = 400,
) -> dict[str, Any]:
    """Appendix B of seed 004: recovery of q by problem (5) and generalisation error vs n.

    out_dir:   if given, writes nuclr_synthetic.json, nuclr_synthetic.md and nuclr_synthetic.png
               there (each atomically).
    ns, seeds: dataset sizes and seeds; every (n, seed) is an independent sample.
    tau:       temperature τ of p(a|o) ∝ exp(o·a/τ) (0.2 in the paper).
    steps, lr, tol: gradient descent on (5): at most ``steps`` updates of size lr·nτ·∇F,
               stopping at ‖∇F‖₂ ≤ tol (the paper's 1e-15).
    plot_n:    n of the q-recovery panels (Figure 2 middle uses 100), drawn with seeds[0].
    risk_grid: quadrature resolution of the true risk.
    Returns the report (also the JSON file's content).
    """
    if plot_n < 3:
        raise ValueError(f"plot_n must be ≥ 3 (a correlation needs points), got {plot_n}")
    started = time.perf_counter()
    study = run_study(ns, seeds, tau, steps=steps, lr=lr, tol=tol, risk_grid=risk_grid)
    recovery = run_trial(plot_n, seeds[0], tau, steps=steps, lr=lr, tol=tol)
    report = {
        "experiment": "nuclr_synthetic",
        "paper": "seed 004 (NUCLR), Appendix B / Figure 2",
        "config": {
            "ns": [int(n) for n in ns],
            "seeds": [int(s) for s in seeds],
            "tau": tau,
            "steps": steps,
            "lr": lr,
            "tol": tol,
            "plot_n": plot_n,
            "risk_grid": risk_grid,
        },
        "methods": LABELS,
        **study,
        "recovery": {
            "n": plot_n,
            "seed": int(seeds[0]),
            "pearson_log_q": pearson(recovery.log_q_tilde, recovery.q.log()),
            "pearson_q": pearson(recovery.log_q_tilde.exp(), recovery.q),
            "a": recovery.a.tolist(),
            "q": recovery.q.tolist(),
            "q_tilde": recovery.log_q_tilde.exp().tolist(),
        },
    }
    report["all_converged"] = all(t["solver_converged"] for t in study["trials"])
    report["seconds"] = round(time.perf_counter() - started, 2)
    if out_dir is not None:
        write_report(report, Path(out_dir))
    return report


def markdown_table(report: dict[str, Any]) -> str:
    """Generalisation error |L̂ − L| (mean ± std over seeds) per n and method, with the setup."""
    config, recovery = report["config"], report["recovery"]
    header = "| n | " + " | ".join(LABELS[m] for m in METHODS) + " |"
    lines = [
        "# NUCLR synthetic experiment (seed 004, Appendix B)",
        "",
        f"τ = {config['tau']}, seeds {config['seeds']}; true risk L = {report['true_risk']:.6f} "
        "(quadrature). Generalisation error |L̂(Ô, Â) − L|, mean ± std over seeds:",
        "",
        header,
        "| " + " | ".join(["---"] * (len(METHODS) + 1)) + " |",
    ]
    for row in report["per_n"]:
        cells = [f"{row['generalization_error'][m]['mean']:.4f} ± {row['generalization_error'][m]['std']:.4f}"
                 for m in METHODS]  # fmt: skip
        lines.append(f"| {row['n']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Theorem 2's error term E(q̃, q; Ô, Â) (c = √2), mean ± std over seeds:",
        "",
        "| n | NUCLR | GCL |",
        "| --- | --- | --- |",
    ]
    for row in report["per_n"]:
        terms = row["error_term"]
        lines.append(f"| {row['n']} | " + " | ".join(
            f"{terms[m]['mean']:.2e} ± {terms[m]['std']:.1e}" for m in ("nuclr", "gcl")) + " |")  # fmt: skip
    lines += [
        "",
        f"q̃ = exp(ζ/τ)/Z against the true q at n = {recovery['n']} (seed {recovery['seed']}): Pearson "
        f"r(log q̃, log q) = {recovery['pearson_log_q']:.5f}, r(q̃, q) = {recovery['pearson_q']:.5f}; "
        f"lowest over all trials: {min(r['pearson_log_q_min'] for r in report['per_n']):.5f} (log), "
        f"{min(r['pearson_q_min'] for r in report['per_n']):.5f} (linear).",
        f"Gradient descent on (5) reached ‖∇F‖₂ ≤ {config['tol']:g} in every trial: "
        f"{report['all_converged']} (at most {max(t['solver_steps'] for t in report['trials'])} steps).",
        "",
    ]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    """nuclr_synthetic.json, nuclr_synthetic.md, nuclr_synthetic.png in ``out_dir``, each atomic."""
    from clipkit.artifacts.io import atomic_path, atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "nuclr_synthetic.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(out_dir / "nuclr_synthetic.md", markdown_table(report))
    with atomic_path(out_dir / "nuclr_synthetic.png") as temporary:
        _plot(report, temporary)


def _plot(report: dict[str, Any], path: Path) -> None:
    """Figure 2 middle and right: true q and q̃ at the a_j (shared colour scale), error vs n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recovery = report["recovery"]
    a = torch.tensor(recovery["a"])
    q, q_tilde = torch.tensor(recovery["q"]), torch.tensor(recovery["q_tilde"])
    low, high = float(torch.minimum(q, q_tilde).min()), float(torch.maximum(q, q_tilde).max())
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    titles = (f"true q at the a_j, n = {recovery['n']}",
              f"NUCLR q̃ = exp(ζ/τ)/Z; r(log q̃, log q) = {recovery['pearson_log_q']:.4f}")  # fmt: skip
    for axis, values, title in zip(axes[:2], (q, q_tilde), titles, strict=True):
        points = axis.scatter(a[:, 0], a[:, 1], c=values, s=30, vmin=low, vmax=high, cmap="viridis")
        axis.set(xlim=(0, 1), ylim=(0, 1), aspect="equal", xlabel="a₁", ylabel="a₂")
        axis.set_title(title, fontsize=10)
    figure.colorbar(points, ax=axes[:2].tolist(), shrink=0.85, label="popularity")
    ns = [row["n"] for row in report["per_n"]]
    styles = {"mle": ("black", "o", "-"), "nuclr": ("tab:blue", "s", "-"), "gcl": ("tab:red", "^", "-"),
              "nuclr_logmean_z": ("tab:cyan", "", ":")}  # fmt: skip
    for method, (colour, marker, line) in styles.items():
        stats = [row["generalization_error"][method] for row in report["per_n"]]
        axes[2].errorbar(ns, [s["mean"] for s in stats], yerr=[s["std"] for s in stats], color=colour,
                         marker=marker, linestyle=line, capsize=3, label=LABELS[method])  # fmt: skip
    axes[2].set_xscale("log")
    axes[2].set(xlabel="n", ylabel="|L̂(Ô, Â) − L|", title="generalisation error (mean ± std over seeds)")
    axes[2].legend(fontsize=8)
    figure.savefig(path, format="png", dpi=90, bbox_inches="tight", metadata={"Software": None})
    plt.close(figure)
