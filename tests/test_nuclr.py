"""`nuclr` / `sogclr` (METHODS §6, §11): hand-derived step, naive loop reference (state, objective
and gradients), the eq. 7 identities, state locality, freezing, ξ, checkpoints, schedules, contracts."""

from __future__ import annotations

import math

import pytest
import torch

from clipkit.plugins.losses.nuclr import NUCLRLoss, SogCLRLoss, cosine_stepdown
from clipkit.testing import check_loss
from clipkit.types import Logits, LossContext

F64 = torch.float64


def make64(cls, *args, **kwargs):
    """Build a loss whose state buffers are float64 from the start (``.double()`` would cast
    float32 initial values such as ζ0 = −0.1, losing precision the references keep)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        return cls(*args, **kwargs)
    finally:
        torch.set_default_dtype(previous)


def ctx(index, epoch: float = 10.0, step: int = 0) -> LossContext:
    return LossContext(index=torch.as_tensor(index), epoch=epoch, step=step)


def leaf_logits(i2t: torch.Tensor, t2i: torch.Tensor) -> Logits:
    """Two independent leaves, so each direction's gradient can be checked on its own."""
    return Logits(i2t=i2t.clone().requires_grad_(), t2i=t2i.clone().requires_grad_())


def run(loss, logits: Logits, index, **kwargs):
    out = loss(logits, torch.arange(logits.i2t.shape[0]), ctx(index, **kwargs))
    out.loss.backward()
    return out


def random_logits(size: int, tau: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine-like similarities in [−1, 1] divided by τ, one matrix per direction."""
    generator = torch.Generator().manual_seed(seed)
    i2t = torch.rand(size, size, generator=generator, dtype=F64) * 2 - 1
    t2i = torch.rand(size, size, generator=generator, dtype=F64) * 2 - 1
    return i2t / tau, t2i / tau


class Reference:
    """Algorithm 1 of seed 004 with explicit Python loops over i, j and float state per sample.

    popularity=False is SogCLR: ζ ≡ 0 and no ξ term in the model weights.
    """

    def __init__(
        self, n, tau, gamma, zeta0=0.0, xi0=0.0, lr=0.0, image_scale=1.0, popularity=True, first="ema"
    ):
        self.n, self.tau, self.gamma, self.xi0, self.popularity, self.first = (
            n,
            tau,
            gamma,
            xi0,
            popularity,
            first,
        )
        self.lrs = (lr * image_scale, lr)
        self.u = [[0.0] * n for _ in range(2)]
        self.visited = [[False] * n for _ in range(2)]
        self.zeta = [[zeta0 if popularity else 0.0] * n for _ in range(2)]
        self.xi = [max(xi0, zeta0)] * 2

    def step(self, logits: list[list[list[float]]], idx: list[int], update_zeta: bool):
        """logits[d][i][j] -> (d loss/d logits[d] as nested lists, objective summed over d)."""
        grads, objective = [], 0.0
        for d in range(2):
            grad, obj = self._direction(d, logits[d], idx, update_zeta)
            grads.append(grad)
            objective += obj
        return grads, objective

    def _direction(self, d, rows, idx, update_zeta):
        tau, n, size = self.tau, self.n, len(idx)
        sigma = [[tau * (rows[i][j] - rows[i][i]) for j in range(size)] for i in range(size)]
        zeta = [self.zeta[d][k] for k in idx]
        g = [
            sum(math.exp((sigma[i][j] - zeta[j]) / tau) for j in range(size) if j != i) / (size - 1)
            for i in range(size)
        ]
        for i, k in enumerate(idx):
            if self.first == "set" and not self.visited[d][k]:
                self.u[d][k] = g[i]
            else:
                self.u[d][k] = (1 - self.gamma) * self.u[d][k] + self.gamma * g[i]
        u = [self.u[d][k] for k in idx]
        positive = math.exp(-self.xi[d] / tau) / (n - 1) if self.popularity else 0.0
        grad = [[0.0] * size for _ in range(size)]
        for i in range(size):
            for j in range(size):
                if j != i:
                    coef = math.exp((sigma[i][j] - zeta[j]) / tau) / (u[i] + positive) / (size * (size - 1))
                    grad[i][j] += tau * coef  # Σ_ij = τ(L_ij − L_ii)
                    grad[i][i] -= tau * coef
        objective = sum(tau * math.log(math.exp(-zeta[i] / tau) + (n - 1) * g[i]) for i in range(size)) / size
        objective += sum(self.zeta[d]) / n
        if self.popularity and update_zeta:
            for j, k in enumerate(idx):
                total = sum(
                    math.exp((sigma[i][j] - zeta[j]) / tau) / (u[i] + math.exp(-zeta[i] / tau) / (n - 1))
                    for i in range(size)
                )
                self.zeta[d][k] = zeta[j] - self.lrs[d] * (-total / ((n - 1) * size) + 1 / n)
        self.xi[d] = max(self.xi0, max(self.zeta[d])) if self.popularity else self.xi[d]
        for k in idx:
            self.visited[d][k] = True
        return grad, objective


# ----------------------------------------------------------------------------------------- hand case


def test_hand_computed_three_sample_step():
    """B = 3, n = 5, τ = 0.5, γ = 0.8, ζ0 = −0.1, ξ0 = 0, η = 1 (image side 0.1), index (4, 0, 2).

    e = [[.9, .1, .3], [.2, .8, .4], [0, .5, .7]], L = e/τ, so Σ = [[0, −.8, −.6], [−.6, 0, −.4],
    [−.7, −.2, 0]] and a_ij = (Σ_ij − ζ_j)/τ = 2Σ_ij + 0.2. From u = 0: u_i = γ g_i.
    Model coefficient c_ij = exp(a_ij) / (B(B−1)(u_i + e^{−ξ/τ}/(n−1))) = exp(a_ij) / (6(u_i + 1/4)).
    ζ gradient Ĝ(ζ_j) = −(1/4)(1/3) Σ_i exp(a_ij)/(u_i + e^{0.2}/4) + 1/5 (the i = j term included).
    Objective (eq. 7 estimate) = (1/3) Σ_i ½ log(e^{0.2} + 4 g_i) + mean ζ (= −0.1).
    """
    e = torch.tensor([[0.9, 0.1, 0.3], [0.2, 0.8, 0.4], [0.0, 0.5, 0.7]], dtype=F64)
    loss = make64(NUCLRLoss, 5, tau=0.5, gamma=0.8, zeta_init=-0.1, xi_init=0.0, zeta_lr=1.0, freeze_epochs=0)
    logits = leaf_logits(e / 0.5, e.t() / 0.5)
    out = run(loss, logits, [4, 0, 2], epoch=0.0)

    exp = math.exp
    a = [[0.2, -1.4, -1.0], [-1.0, 0.2, -0.6], [-1.2, -0.2, 0.2]]
    g = [(exp(-1.4) + exp(-1.0)) / 2, (exp(-1.0) + exp(-0.6)) / 2, (exp(-1.2) + exp(-0.2)) / 2]
    assert g[0] == pytest.approx(0.307238, abs=1e-6)
    u = [0.8 * value for value in g]
    torch.testing.assert_close(loss.u[0, [4, 0, 2]], torch.tensor(u, dtype=F64))

    coef = [[exp(a[i][j]) / (6 * (u[i] + 0.25)) if i != j else 0.0 for j in range(3)] for i in range(3)]
    expected_grad = [[0.5 * coef[i][j] for j in range(3)] for i in range(3)]
    for i in range(3):
        expected_grad[i][i] = -0.5 * sum(coef[i])
    torch.testing.assert_close(logits.i2t.grad, torch.tensor(expected_grad, dtype=F64))

    zeta_grad = [-sum(exp(a[i][j]) / (u[i] + exp(0.2) / 4) for i in range(3)) / 12 + 0.2 for j in range(3)]
    new_zeta = [-0.1 - 0.1 * value for value in zeta_grad]  # direction 0 is the image side: η × 0.1
    torch.testing.assert_close(loss.zeta[0, [4, 0, 2]], torch.tensor(new_zeta, dtype=F64))
    assert loss.zeta[0, [1, 3]].tolist() == [-0.1, -0.1]
    assert max(new_zeta) < 0 and float(loss.xi[0]) == 0.0  # ξ = max(ξ0, max ζ) = ξ0 here

    objective_i2t = sum(0.5 * math.log(exp(0.2) + 4 * value) for value in g) / 3 - 0.1
    assert float(out.metrics["objective_i2t"]) == pytest.approx(objective_i2t, abs=1e-12)
    assert float(out.loss.detach()) == pytest.approx(float(out.metrics["objective"]), abs=1e-12)


# ---------------------------------------------------------------------------------- naive reference


@pytest.mark.parametrize("first_visit", ["ema", "set"])
def test_nuclr_matches_naive_loop_over_steps(first_visit):
    n, tau, size = 9, 0.2, 4
    loss = make64(
        NUCLRLoss,
        n,
        tau=tau,
        gamma=0.7,
        zeta_init=-0.05,
        xi_init=0.0,
        zeta_lr=0.5,
        freeze_epochs=1,
        first_visit=first_visit,
    )
    reference = Reference(n, tau, 0.7, zeta0=-0.05, xi0=0.0, lr=0.5, image_scale=0.1, first=first_visit)
    batches = [[0, 3, 5, 8], [3, 1, 8, 2], [5, 3, 6, 0], [7, 4, 1, 3]]
    for step, index in enumerate(batches):
        i2t, t2i = random_logits(size, tau, seed=step)
        logits = leaf_logits(i2t, t2i)
        epoch = 0.5 * step  # frozen for the first two steps, then learning
        out = run(loss, logits, index, epoch=epoch, step=step)
        grads, objective = reference.step([i2t.tolist(), t2i.tolist()], index, update_zeta=epoch >= 1)
        torch.testing.assert_close(logits.i2t.grad, torch.tensor(grads[0], dtype=F64))
        torch.testing.assert_close(logits.t2i.grad, torch.tensor(grads[1], dtype=F64))
        assert float(out.loss.detach()) == pytest.approx(objective, rel=1e-10)
        torch.testing.assert_close(loss.u, torch.tensor(reference.u, dtype=F64))
        torch.testing.assert_close(loss.zeta, torch.tensor(reference.zeta, dtype=F64))
        torch.testing.assert_close(loss.xi, torch.tensor(reference.xi, dtype=F64))


def test_sogclr_matches_naive_loop_over_steps():
    n, tau, size = 7, 0.1, 3
    loss = make64(SogCLRLoss, n, tau=tau, gamma=0.9)
    reference = Reference(n, tau, 0.9, popularity=False)
    for step, index in enumerate([[0, 4, 6], [4, 2, 0], [1, 6, 4]]):
        i2t, t2i = random_logits(size, tau, seed=10 + step)
        logits = leaf_logits(i2t, t2i)
        out = run(loss, logits, index, step=step)
        grads, objective = reference.step([i2t.tolist(), t2i.tolist()], index, update_zeta=False)
        torch.testing.assert_close(logits.i2t.grad, torch.tensor(grads[0], dtype=F64))
        torch.testing.assert_close(logits.t2i.grad, torch.tensor(grads[1], dtype=F64))
        assert float(out.loss.detach()) == pytest.approx(objective, rel=1e-10)
        torch.testing.assert_close(loss.u, torch.tensor(reference.u, dtype=F64))


def test_sogclr_weights_are_exp_sigma_over_u():
    """SogCLR's Ĝ coefficient is exp(Σ_ij/τ)/u_i /(B(B−1)): from u = 0 with γ = 0.9, u_i = 0.9 g_i."""
    tau, size = 0.1, 4
    i2t, t2i = random_logits(size, tau, seed=3)
    logits = leaf_logits(i2t, t2i)
    run(make64(SogCLRLoss, 10, tau=tau, gamma=0.9), logits, [9, 1, 2, 5])
    sigma = [[tau * (i2t[i, j] - i2t[i, i]).item() for j in range(size)] for i in range(size)]
    for i in range(size):
        g = sum(math.exp(sigma[i][j] / tau) for j in range(size) if j != i) / (size - 1)
        for j in range(size):
            if j != i:
                weight = math.exp(sigma[i][j] / tau) / (0.9 * g)
                assert logits.i2t.grad[i, j].item() == pytest.approx(
                    tau * weight / (size * (size - 1)), rel=1e-12
                )


def test_sogclr_is_nuclr_with_zero_zeta_and_no_xi_term():
    """One implementation: NUCLR with ζ ≡ 0 (ζ0 = 0, frozen) and ξ0 = ∞ (e^{−ξ/τ} = 0) is SogCLR."""
    tau, size, n = 0.1, 5, 12
    sogclr = make64(SogCLRLoss, n, tau=tau, gamma=0.9)
    nuclr = make64(NUCLRLoss, n, tau=tau, gamma=0.9, zeta_init=0.0, xi_init=math.inf, freeze_epochs=1e9)
    for step, index in enumerate([[0, 2, 4, 6, 8], [1, 2, 3, 4, 11]]):
        i2t, t2i = random_logits(size, tau, seed=20 + step)
        a, b = leaf_logits(i2t, t2i), leaf_logits(i2t, t2i)
        out_s, out_n = run(sogclr, a, index, step=step), run(nuclr, b, index, step=step)
        torch.testing.assert_close(a.i2t.grad, b.i2t.grad, rtol=1e-13, atol=0)
        torch.testing.assert_close(a.t2i.grad, b.t2i.grad, rtol=1e-13, atol=0)
        torch.testing.assert_close(out_s.loss, out_n.loss, rtol=1e-13, atol=0)
        torch.testing.assert_close(sogclr.log_u, nuclr.log_u, rtol=1e-13, atol=0)
    assert (nuclr.zeta == 0).all() and "zeta" not in sogclr.state_dict()


# ------------------------------------------------------------------------------- eq. 7 identities


def full_batch_infonce(i2t: torch.Tensor, t2i: torch.Tensor) -> torch.Tensor:
    targets = torch.arange(i2t.shape[0])
    return torch.nn.functional.cross_entropy(i2t, targets) + torch.nn.functional.cross_entropy(t2i, targets)


def test_full_dataset_batch_with_exact_u_gives_the_gradient_of_eq7():
    """B = n and γ = 1 make u_i = g_i exact; with uniform ζ = c and ξ → c, eq. 7 is τ·InfoNCE
    (ζ cancels) and Ĝ(w) is its exact gradient; Ĝ(ζ) is the exact ∂(eq. 7)/∂ζ_j."""
    n, tau, c = 6, 0.2, -0.05
    i2t, t2i = random_logits(n, tau, seed=4)
    loss = make64(
        NUCLRLoss, n, tau=tau, gamma=1.0, zeta_init=c, xi_init=c + 1e-12, zeta_lr=1.0, freeze_epochs=0
    )
    logits = leaf_logits(i2t, t2i)
    index = [3, 0, 5, 1, 4, 2]
    out = run(loss, logits, index, epoch=0.0)

    reference = leaf_logits(i2t, t2i)
    objective = tau * full_batch_infonce(reference.i2t, reference.t2i)
    objective.backward()
    assert float(out.loss.detach()) == pytest.approx(float(objective.detach()), rel=1e-12)
    torch.testing.assert_close(logits.i2t.grad, reference.i2t.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(logits.t2i.grad, reference.t2i.grad, rtol=1e-9, atol=1e-12)

    # ζ step: Δζ = −η ∂F/∂ζ with F(ζ) = mean_i τ log Σ_j exp((e_ij − ζ_j)/τ) − e_ii + mean ζ.
    for d, (rows, lr) in enumerate([(i2t, 0.1), (t2i, 1.0)]):
        zeta = torch.full((n,), c, dtype=F64, requires_grad=True)
        e = tau * rows
        value = (tau * torch.logsumexp((e - zeta) / tau, dim=1) - e.diagonal()).mean() + zeta.mean()
        (gradient,) = torch.autograd.grad(value, zeta)
        torch.testing.assert_close(loss.zeta[d, index], c - lr * gradient)


def test_sogclr_full_dataset_objective_is_tau_infonce_and_gradient_is_gcl():
    """B = n, γ = 1: the logged objective is τ·InfoNCE and the gradient is that of
    τ·mean_i log((1/(B−1)) Σ_{j≠i} exp(Σ_ij/τ)) (the positive left out of the denominator)."""
    n, tau = 5, 0.1
    i2t, t2i = random_logits(n, tau, seed=5)
    logits = leaf_logits(i2t, t2i)
    out = run(make64(SogCLRLoss, n, tau=tau, gamma=1.0), logits, [4, 3, 2, 1, 0])
    assert float(out.loss.detach()) == pytest.approx(float(tau * full_batch_infonce(i2t, t2i)), rel=1e-12)

    reference = leaf_logits(i2t, t2i)
    eye = torch.eye(n, dtype=torch.bool)
    total = 0
    for rows in (reference.i2t, reference.t2i):
        margins = (rows - rows.diagonal().unsqueeze(1)).masked_fill(eye, -math.inf)
        total = total + tau * torch.logsumexp(margins, dim=1).mean()
    total.backward()
    torch.testing.assert_close(logits.i2t.grad, reference.i2t.grad)
    torch.testing.assert_close(logits.t2i.grad, reference.t2i.grad)


# ------------------------------------------------------------------------------------------ state


def test_one_step_changes_only_the_batch_coordinates():
    n, tau = 16, 0.1
    loss = NUCLRLoss(n, tau=tau, zeta_init=-0.05, zeta_lr=0.5, freeze_epochs=0)
    run(loss, leaf_logits(*random_logits(4, tau, seed=6)), [1, 9, 12, 15])  # non-trivial state first
    before = {k: v.clone() for k, v in loss.state_dict().items()}
    index = [2, 9, 14]
    run(loss, leaf_logits(*random_logits(3, tau, seed=7)), index)
    others = [k for k in range(n) if k not in index]
    for name in ("log_u", "zeta", "visited"):
        assert torch.equal(loss.state_dict()[name][:, others], before[name][:, others]), name
    assert (loss.log_u[:, index] != before["log_u"][:, index]).all()
    assert (loss.zeta[:, index] != before["zeta"][:, index]).all()
    assert loss.visited[:, index].all()


def test_zeta_frozen_before_freeze_epochs_then_updated():
    tau = 0.1
    loss = NUCLRLoss(8, tau=tau, zeta_init=-0.05, zeta_lr=0.5, freeze_epochs=5)
    for step, epoch in enumerate([0.0, 4.99]):
        out = run(loss, leaf_logits(*random_logits(3, tau, seed=step)), [0, 1, 2], epoch=epoch, step=step)
        assert (loss.zeta == -0.05).all() and float(out.metrics["zeta_lr"]) == 0.0
    assert torch.isfinite(loss.log_u[:, :3]).all()  # u is updated while ζ is frozen
    out = run(loss, leaf_logits(*random_logits(3, tau, seed=8)), [0, 1, 2], epoch=5.0, step=2)
    assert (loss.zeta[:, :3] != -0.05).all() and (loss.zeta[:, 3:] == -0.05).all()
    assert float(out.metrics["zeta_lr"]) == 0.5


def test_xi_is_max_of_xi0_and_zeta():
    """Well-separated positives (L_ij − L_ii = −15) leave only the i = j term of Ĝ(ζ_j), ≈ −1/B + 1/n
    = −1/6 with u ≈ 0: ζ rises by η/6. A large η lifts ζ above ξ0, so ξ = max ζ over all n; a
    small η keeps ζ below ξ0, so ξ = ξ0."""
    tau, n = 0.1, 6
    i2t = torch.full((3, 3), -5.0) + torch.eye(3) * 15.0
    kwargs = dict(tau=tau, zeta_init=0.0, xi_init=0.1, zeta_lr_image_scale=1.0, freeze_epochs=0)
    small = NUCLRLoss(n, zeta_lr=0.01, **kwargs)
    run(small, leaf_logits(i2t, i2t), [0, 2, 4])
    assert (small.zeta[:, [0, 2, 4]] > 0).all() and (small.zeta < 0.1).all()
    assert small.xi.tolist() == pytest.approx([0.1, 0.1])

    large = NUCLRLoss(n, zeta_lr=5.0, **kwargs)
    run(large, leaf_logits(i2t, i2t), [0, 2, 4])
    assert large.zeta[:, [0, 2, 4]].flatten().tolist() == pytest.approx([5 / 6] * 6, rel=1e-5)
    peak = large.zeta.max(dim=1).values.clone()
    large.zeta_lr = 1.0  # the next batch's ζ stay below the first batch's: ξ still sees them
    run(large, leaf_logits(i2t, i2t), [1, 3, 5])
    assert (large.zeta[:, [1, 3, 5]] < peak.unsqueeze(1)).all()
    torch.testing.assert_close(large.xi, peak)
    torch.testing.assert_close(large.xi, large.zeta.max(dim=1).values.clamp_min(0.1))


def test_state_dict_round_trip_continues_identically():
    tau, n = 0.1, 10
    kwargs = dict(tau=tau, zeta_init=-0.05, zeta_lr=0.5, freeze_epochs=0, first_visit="set")
    first = NUCLRLoss(n, **kwargs)
    run(first, leaf_logits(*random_logits(4, tau, seed=9)), [0, 3, 6, 9])
    second = NUCLRLoss(n, **kwargs)
    second.load_state_dict(first.state_dict())
    assert set(first.state_dict()) == {"log_u", "visited", "zeta", "xi"}
    logits = random_logits(4, tau, seed=10)
    a, b = leaf_logits(*logits), leaf_logits(*logits)
    out_a, out_b = run(first, a, [3, 1, 9, 7], step=1), run(second, b, [3, 1, 9, 7], step=1)
    assert torch.equal(out_a.loss, out_b.loss) and torch.equal(a.i2t.grad, b.i2t.grad)
    assert torch.equal(a.t2i.grad, b.t2i.grad)
    for key, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[key]), key


def test_first_visit_set_puts_g_into_u_then_averages():
    n, tau, size = 8, 0.2, 3
    i2t, t2i = random_logits(size, tau, seed=11)
    sets, ema = (
        make64(NUCLRLoss, n, tau=tau, gamma=0.8, freeze_epochs=1e9, first_visit=v) for v in ("set", "ema")
    )
    run(sets, leaf_logits(i2t, t2i), [0, 1, 2])
    run(ema, leaf_logits(i2t, t2i), [0, 1, 2])
    torch.testing.assert_close(sets.u[:, :3], ema.u[:, :3] / 0.8)  # u = g versus u = γ g
    g = sets.u[0, :3].clone()
    run(sets, leaf_logits(i2t, t2i), [0, 1, 2])  # same logits and ζ: g is the same, u ← 0.2 g + 0.8 g
    torch.testing.assert_close(sets.u[0, :3], g)
    run(sets, leaf_logits(i2t * 0.5, t2i * 0.5), [0, 1, 2])
    margins = 0.5 * (i2t - i2t.diagonal().unsqueeze(1))
    g_new = torch.stack([(margins[i].exp().sum() - 1) / 2 for i in range(size)]) * math.exp(0.05 / tau)  # ζ0
    torch.testing.assert_close(sets.u[0, :3], 0.2 * g + 0.8 * g_new)


def test_overflow_guard_at_tau_001_in_fp32():
    """τ = 0.01 and margins up to 1.9 put exponents near 190: exp overflows fp32 (max ≈ 88) yet
    the log-space loss stays finite and matches a float64 naive reference."""
    tau, n = 0.01, 10
    e = torch.tensor(
        [[0.1, 0.95, -0.9, 0.8], [-0.9, 0.0, 0.9, 0.5], [0.3, 0.2, 0.1, 0.9], [0.9, -0.5, 0.6, -0.95]]
    )
    assert math.isinf(torch.tensor(1.9 / tau, dtype=torch.float32).exp().item())
    loss = NUCLRLoss(n, tau=tau, zeta_init=-0.05, zeta_lr=5e-6, freeze_epochs=0)
    logits = leaf_logits(e / tau, e.t() / tau)
    out = run(loss, logits, [0, 2, 4, 6])
    assert torch.isfinite(out.loss) and torch.isfinite(logits.i2t.grad).all()
    reference = Reference(n, tau, 0.8, zeta0=-0.05, lr=5e-6, image_scale=0.1)
    grads, objective = reference.step(
        [(e / tau).double().tolist(), (e.t() / tau).double().tolist()], [0, 2, 4, 6], True
    )
    torch.testing.assert_close(
        logits.i2t.grad, torch.tensor(grads[0], dtype=torch.float32), rtol=1e-4, atol=1e-6
    )
    assert float(out.loss.detach()) == pytest.approx(objective, rel=1e-5)
    torch.testing.assert_close(loss.zeta.double(), torch.tensor(reference.zeta, dtype=F64), rtol=0, atol=1e-7)


# ------------------------------------------------------------------------------ schedules, contract


def test_zeta_lr_schedule_values():
    loss = NUCLRLoss(4, zeta_lr=5e-6, total_steps=1000, zeta_lr_schedule="cosine_stepdown")
    assert loss.zeta_lr_at(0) == pytest.approx(5e-6)
    assert loss.zeta_lr_at(499) == pytest.approx(5e-6 * 0.5 * (1 + math.cos(math.pi * 0.499)))
    assert loss.zeta_lr_at(500) == pytest.approx(5e-6 * 0.5 / 10)  # cos(π/2) = 0, then ÷10
    assert loss.zeta_lr_at(750) == pytest.approx(5e-6 * 0.5 * (1 - math.sqrt(0.5)) / 100)
    assert loss.zeta_lr_at(1000) == 0.0 and cosine_stepdown(2000, 1000) == 0.0
    assert NUCLRLoss(4, zeta_lr=5e-6).zeta_lr_at(750) == 5e-6


def test_schedule_drives_the_zeta_step():
    tau = 0.1
    logits = random_logits(3, tau, seed=12)
    steps = {}
    for step in (0, 500):
        loss = make64(
            NUCLRLoss,
            8,
            tau=tau,
            zeta_lr=1.0,
            freeze_epochs=0,
            total_steps=1000,
            zeta_lr_schedule="cosine_stepdown",
        )
        run(loss, leaf_logits(*logits), [0, 1, 2], step=step)
        steps[step] = loss.zeta[1, :3] + 0.05  # Δζ = ζ − ζ0
    assert (steps[0].abs() > 1e-3).all()
    torch.testing.assert_close(steps[500], steps[0] * 0.05)  # Δζ ∝ η_t and η_500 = 0.05 η_0


def test_contract_checks():
    out = check_loss(NUCLRLoss(num_samples=64))
    assert {"objective", "objective_i2t", "xi_t2i", "zeta_mean_i2t", "u_mean_t2i"} <= set(out.metrics)
    check_loss(SogCLRLoss(num_samples=64))
    assert NUCLRLoss.requires == frozenset({"index", "epoch", "step"}) == SogCLRLoss.requires


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tau": 0.0}, "tau"),
        ({"tau": -0.1}, "tau"),
        ({"gamma": 0.0}, "gamma"),
        ({"gamma": 1.5}, "gamma"),
        ({"num_samples": 1}, "num_samples"),
        ({"xi_init": -0.05, "zeta_init": -0.05}, "xi_init"),
        ({"xi_init": -0.1, "zeta_init": 0.0}, "xi_init"),
        ({"zeta_lr_schedule": "linear"}, "zeta_lr_schedule"),
        ({"zeta_lr_schedule": "cosine_stepdown"}, "total_steps"),
        ({"first_visit": "never"}, "first_visit"),
        ({"zeta_lr": -1.0}, "zeta_lr"),
        ({"freeze_epochs": -1.0}, "freeze_epochs"),
    ],
)
def test_bad_arguments(kwargs, message):
    kwargs = {"num_samples": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        NUCLRLoss(**kwargs)


def test_sogclr_bad_arguments():
    for kwargs in ({"tau": 0.0}, {"gamma": 0.0}, {"num_samples": 1}):
        with pytest.raises(ValueError):
            SogCLRLoss(**{"num_samples": 8, **kwargs})


@pytest.mark.parametrize(
    "logits, targets, index, message",
    [
        (Logits.symmetric(torch.zeros(3, 4)), torch.arange(3), [0, 1, 2], "square"),
        (Logits.symmetric(torch.zeros(1, 1)), torch.arange(1), [0], "at least 2"),
        (Logits.symmetric(torch.zeros(3, 3)), torch.arange(3), [0, 1], r"\[N\]"),
        (Logits.symmetric(torch.zeros(3, 3)), torch.tensor([1, 0, 2]), [0, 1, 2], "diagonal"),
        (Logits.symmetric(torch.zeros(3, 3)), torch.arange(3), [0, 1, 8], r"\[0, 8\)"),
        (Logits.symmetric(torch.zeros(3, 3)), torch.arange(3), [0, 1, 1], "twice"),
    ],
)
def test_bad_batches(logits, targets, index, message):
    with pytest.raises(ValueError, match=message):
        NUCLRLoss(8)(logits, targets, ctx(index))
