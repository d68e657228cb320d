"""`nuclr` / `sogclr` (METHODS §6, §11): hand-derived step, naive loop references — the authors'
`DGCL_Loss` update (ζ, z, s, b, ξ, surrogate loss and gradients over epochs, freeze and step-down
boundaries) and the paper's Algorithm 1 —, the image side of the ×0.1, the eq. 7 identities, state
locality, freezing, ξ, checkpoints, schedules, the ζ spread in a tiny run, contracts."""

from __future__ import annotations

import json
import math

import pytest
import torch

from clipkit.app import api
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.contract.testing import check_loss
from clipkit.contract.types import Logits, LossContext
from clipkit.plugins.losses.nuclr import NUCLRLoss, SogCLRLoss, batch_epoch, cosine_stepdown

F64 = torch.float64
#: The paper's Algorithm 1 as a configuration: ζ ← ζ − η' Ĝ(ζ) is θ = 1 with zeta_lr = η'/n, u
#: averaged from 0, ξ refreshed every step, a constant step size.
PAPER = dict(zeta_momentum=1.0, zeta_lr_schedule="constant", first_visit="ema", xi_update="step")


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
    """Algorithm 1 of seed 004 (the paper: ζ ← ζ − η Ĝ(ζ), ξ every step) with explicit Python
    loops over i, j and float state per sample; ``image_scale`` multiplies η of direction 1 (ζ of
    the images). popularity=False is SogCLR: ζ ≡ 0 and no ξ term in the model weights.
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
        self.lrs = (lr, lr * image_scale)
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
    """B = 3, n = 5, τ = 0.5, γ = 0.8, ζ0 = −0.1, ξ0 = 0, paper step η' = 1 (zeta_lr = η'/n, θ = 1;
    image side ×0.1), index (4, 0, 2).

    e = [[.9, .1, .3], [.2, .8, .4], [0, .5, .7]], L = e/τ, so Σ = [[0, −.8, −.6], [−.6, 0, −.4],
    [−.7, −.2, 0]] and a_ij = (Σ_ij − ζ_j)/τ = 2Σ_ij + 0.2. From u = 0: u_i = γ g_i.
    Model coefficient c_ij = exp(a_ij) / (B(B−1)(u_i + e^{−ξ/τ}/(n−1))) = exp(a_ij) / (6(u_i + 1/4)).
    ζ gradient Ĝ(ζ_j) = −(1/4)(1/3) Σ_i exp(a_ij)/(u_i + e^{0.2}/4) + 1/5 (the i = j term included);
    z = n·Ĝ(ζ), so Δζ = −(η'/n)·n·Ĝ = −Ĝ for the texts (direction 0).
    Objective (eq. 7 estimate) = (1/3) Σ_i ½ log(e^{0.2} + 4 g_i) + mean ζ (= −0.1).
    """
    e = torch.tensor([[0.9, 0.1, 0.3], [0.2, 0.8, 0.4], [0.0, 0.5, 0.7]], dtype=F64)
    loss = make64(
        NUCLRLoss, 5, tau=0.5, gamma=0.8, zeta_init=-0.1, xi_init=0.0, zeta_lr=1 / 5, freeze_epochs=0, **PAPER
    )
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
    torch.testing.assert_close(loss.z[0, [4, 0, 2]], torch.tensor([5 * v for v in zeta_grad], dtype=F64))
    new_zeta = [-0.1 - value for value in zeta_grad]  # direction 0: ζ of the texts, full η
    torch.testing.assert_close(loss.zeta[0, [4, 0, 2]], torch.tensor(new_zeta, dtype=F64))
    assert loss.zeta[0, [1, 3]].tolist() == [-0.1, -0.1]
    assert max(new_zeta) < 0 and float(loss.xi[0]) == 0.0  # ξ = max(ξ0, max ζ) = ξ0 here

    objective_i2t = sum(0.5 * math.log(exp(0.2) + 4 * value) for value in g) / 3 - 0.1
    assert float(out.metrics["objective_i2t"]) == pytest.approx(objective_i2t, abs=1e-12)
    assert float(out.loss.detach()) == pytest.approx(float(out.metrics["objective"]), abs=1e-12)


# ------------------------------------------------------------------- the authors' code, naive loops


class OfficialReference:
    """The update of the authors' ``DGCL_Loss`` (bokun-wang/NUCLR, models/losses.py), restated from
    its semantics with Python loops and float64 state per sample; names as there: I = images,
    T = texts, ``sim[i][j]`` = image i · text j, image and text of a pair share the id.

    Per step: running maxima b of the margins (in similarity units, diagonal 0 included); the
    stored s_I = Σ_{j≠i} exp((d_ij − b_i − ζ^T_j)/τ) averaged with γ (s := g on a first visit,
    detected as s = 0; the old s rescaled by exp(b_old − b_new), the code's omission of 1/τ, or
    by exp((b_old − b_new)/τ) when ``quirk`` is False); the surrogate loss
    mean_i Σ_j w_ij d_ij + mean_j Σ_i w_ij d'_ij with w = exp(..)/(s + (B−1)/(n−1)·exp(−(ξ + b)/τ));
    from ``start`` on, z ← (1−θ) z + θ (1 − n/(n−1)·mean_anchors w̃) (z := target when z = 0)
    and ζ ← ζ − η z, η cosine over epochs with ÷10 / ÷100 step-downs, ×``ratio`` for ζ_I; ξ is
    refreshed by :meth:`end_epoch`.
    """

    def __init__(self, n, *, tau, gamma, zeta0, xi0, theta, start, eta, ratio, epochs, quirk):
        self.n, self.tau, self.gamma, self.xi0, self.theta = n, tau, gamma, xi0, theta
        self.start, self.eta, self.ratio, self.epochs, self.quirk = start, eta, ratio, epochs, quirk
        self.s = {"I": [0.0] * n, "T": [0.0] * n}
        self.b = {"I": [0.0] * n, "T": [0.0] * n}
        self.z = {"I": [0.0] * n, "T": [0.0] * n}
        self.zeta = {"I": [zeta0] * n, "T": [zeta0] * n}
        self.xi = {"I": xi0, "T": xi0}

    def end_epoch(self):
        for side in ("I", "T"):
            self.xi[side] = max(max(self.zeta[side]), self.xi0)

    def eta_at(self, epoch):
        base = (
            0.5 * self.eta * (1 + math.cos(math.pi * (epoch - self.start) / (self.epochs - 1 - self.start)))
        )
        if epoch < int(self.epochs / 2):
            return base
        return base / 10 if epoch < int(self.epochs * 3 / 4) else base / 100

    def step(self, sim, ids, epoch):
        """sim [B][B] -> (surrogate loss, ∂loss/∂sim through the image term, through the text term)."""
        tau, n, size, exp = self.tau, self.n, len(ids), math.exp
        d_img = [[sim[i][j] - sim[i][i] for j in range(size)] for i in range(size)]  # anchor image i
        d_txt = [[sim[i][j] - sim[j][j] for j in range(size)] for i in range(size)]  # anchor text j
        b_old_i = [self.b["I"][k] for k in ids]
        b_old_t = [self.b["T"][k] for k in ids]
        b_i = [max([b_old_i[i]] + d_img[i]) for i in range(size)]
        b_t = [max([b_old_t[j]] + [d_txt[i][j] for i in range(size)]) for j in range(size)]
        zeta_t = [self.zeta["T"][k] for k in ids]
        zeta_i = [self.zeta["I"][k] for k in ids]
        e_img = [[exp((d_img[i][j] - b_i[i] - zeta_t[j]) / tau) for j in range(size)] for i in range(size)]
        e_txt = [[exp((d_txt[i][j] - b_t[j] - zeta_i[i]) / tau) for j in range(size)] for i in range(size)]
        g_i = [sum(e_img[i][j] for j in range(size) if j != i) for i in range(size)]
        g_t = [sum(e_txt[i][j] for i in range(size) if i != j) for j in range(size)]
        s_i = [self._average("I", ids[i], g_i[i], b_old_i[i], b_i[i]) for i in range(size)]
        s_t = [self._average("T", ids[j], g_t[j], b_old_t[j], b_t[j]) for j in range(size)]
        for k, value, bi, bt in zip(ids, range(size), b_i, b_t, strict=True):
            self.s["I"][k], self.s["T"][k], self.b["I"][k], self.b["T"][k] = s_i[value], s_t[value], bi, bt

        scale = (size - 1) / (n - 1)
        w_img = [
            [
                e_img[i][j] / (s_i[i] + scale * exp(-(self.xi["T"] + b_i[i]) / tau)) if j != i else 0.0
                for j in range(size)
            ]
            for i in range(size)
        ]
        w_txt = [
            [
                e_txt[i][j] / (s_t[j] + scale * exp(-(self.xi["I"] + b_t[j]) / tau)) if i != j else 0.0
                for j in range(size)
            ]
            for i in range(size)
        ]
        loss = sum(w_img[i][j] * d_img[i][j] for i in range(size) for j in range(size)) / size
        loss += sum(w_txt[i][j] * d_txt[i][j] for i in range(size) for j in range(size)) / size
        grad_img = [[w_img[p][q] / size for q in range(size)] for p in range(size)]
        grad_txt = [[w_txt[p][q] / size for q in range(size)] for p in range(size)]
        for p in range(size):
            grad_img[p][p] = -sum(w_img[p]) / size
            grad_txt[p][p] = -sum(w_txt[i][p] for i in range(size)) / size

        if epoch >= self.start:
            eta = self.eta_at(epoch)
            tilde_t = [  # text anchors j, image candidates i (diagonal included)
                [
                    e_txt[i][j] / (s_t[j] / (size - 1) + exp(-(zeta_i[j] + b_t[j]) / tau) / (n - 1))
                    for j in range(size)
                ]
                for i in range(size)
            ]
            tilde_i = [  # image anchors i, text candidates j
                [
                    e_img[i][j] / (s_i[i] / (size - 1) + exp(-(zeta_t[i] + b_i[i]) / tau) / (n - 1))
                    for j in range(size)
                ]
                for i in range(size)
            ]
            for i, k in enumerate(ids):
                target = 1 - n / (n - 1) * sum(tilde_t[i]) / size
                self._move("I", k, target, self.ratio * eta)
            for j, k in enumerate(ids):
                target = 1 - n / (n - 1) * sum(tilde_i[i][j] for i in range(size)) / size
                self._move("T", k, target, eta)
        return loss, grad_img, grad_txt

    def _average(self, side, k, g, b_old, b_new):
        if self.s[side][k] == 0.0:
            return g
        shift = (b_old - b_new) if self.quirk else (b_old - b_new) / self.tau
        return (1 - self.gamma) * self.s[side][k] * math.exp(shift) + self.gamma * g

    def _move(self, side, k, target, eta):
        z = target if self.z[side][k] == 0.0 else (1 - self.theta) * self.z[side][k] + self.theta * target
        self.z[side][k] = z
        self.zeta[side][k] -= eta * z


def official_batches(n: int, size: int, epochs: int, per_epoch: int, late: int) -> list[list[int]]:
    """Seeded batches of distinct ids; ids ≥ n − late appear only from epoch 3 on (first visits of
    u and z after the freeze), the others from the start."""
    generator = torch.Generator().manual_seed(30)
    batches = []
    for epoch in range(epochs):
        pool = n if epoch >= 3 else n - late
        for _ in range(per_epoch):
            batches.append(torch.randperm(pool, generator=generator)[:size].tolist())
    return batches


def to_official(loss, size: int):
    """clipkit's state in the code's names: direction 0 = image anchors (s_I, b_I) and ζ of the
    texts (ζ_T, z_T); direction 1 = text anchors (s_T, b_T) and ζ of the images (ζ_I, z_I)."""
    s = (size - 1) * (loss.log_u - loss.b / loss.tau).exp()
    return {
        "s": {"I": s[0], "T": s[1]},
        "b": {"I": loss.b[0], "T": loss.b[1]},
        "z": {"I": loss.z[1], "T": loss.z[0]},
        "zeta": {"I": loss.zeta[1], "T": loss.zeta[0]},
        "xi": {"I": loss.xi[1], "T": loss.xi[0]},
    }


@pytest.mark.parametrize("offset_rescale", ["code", "exact"])
def test_nuclr_matches_the_authors_update_over_epochs(offset_rescale):
    """16 steps, 2 per epoch over 8 epochs: ζ frozen in epochs 0–1 (the freeze boundary at the
    step from epoch 1 to 2), the cosine from epoch 2, ÷10 from epoch 4, ÷100 from epoch 6; first
    visits of u before and after the freeze. ζ, z, s, b, ξ, the surrogate loss and both gradients
    agree with the naive loops to 1e-10 after every step (ctx.epoch is the host's e + k/2, so the
    second batch of each epoch sits exactly on the integer)."""
    n, size, tau, epochs, per_epoch = 10, 4, 0.1, 8, 2
    config = dict(tau=tau, gamma=0.8, zeta0=-0.05, xi0=0.0, theta=0.9, start=2, eta=0.02, ratio=0.1)
    reference = OfficialReference(n, epochs=epochs, quirk=offset_rescale == "code", **config)
    loss = make64(
        NUCLRLoss,
        n,
        tau=tau,
        gamma=0.8,
        zeta_init=-0.05,
        xi_init=0.0,
        zeta_lr=0.02,
        zeta_momentum=0.9,
        zeta_lr_image_scale=0.1,
        freeze_epochs=2,
        epochs=epochs,
        offset_rescale=offset_rescale,
    )
    assert [loss.zeta_lr_at(e) > 0 for e in range(epochs)] == [False, False] + [True] * 5 + [False]
    generator = torch.Generator().manual_seed(31)
    for step, index in enumerate(official_batches(n, size, epochs, per_epoch, late=2)):
        epoch, within = divmod(step, per_epoch)
        if step and within == 0:
            reference.end_epoch()
        sim = torch.rand(size, size, generator=generator, dtype=F64) * 2 - 1
        logits = leaf_logits(sim / tau, sim.t() / tau)
        out = run(loss, logits, index, epoch=epoch + (within + 1) / per_epoch, step=step)
        value, grad_img, grad_txt = reference.step(sim.tolist(), index, epoch)

        close = dict(rtol=1e-10, atol=1e-10)
        assert float(out.metrics["surrogate"]) == pytest.approx(value, rel=1e-10, abs=1e-12)
        torch.testing.assert_close(logits.i2t.grad, tau * torch.tensor(grad_img, dtype=F64), **close)
        torch.testing.assert_close(logits.t2i.grad, tau * torch.tensor(grad_txt, dtype=F64).t(), **close)
        state = to_official(loss, size)
        for name in ("s", "b", "z", "zeta"):
            for side in ("I", "T"):
                expected = torch.tensor(getattr(reference, name)[side], dtype=F64)
                torch.testing.assert_close(
                    state[name][side], expected, **close, msg=f"{name}_{side} step {step}"
                )
        for side in ("I", "T"):
            assert float(state["xi"][side]) == pytest.approx(reference.xi[side], abs=1e-10)
    assert (loss.zeta != -0.05).any(dim=1).all() and reference.z["I"][n - 1] != 0.0  # late ids moved


def test_the_image_scale_goes_to_the_popularity_of_images():
    """The authors' ×0.1 (``eta_I_ratio``) scales ζ_I, the popularity of images = the candidates of
    the text anchors (direction 1): an image similar to every text (one popular column of sim)
    gets the largest rise of ζ among the images, in ``zeta[1]``; with scale 0.1 that rise is 0.1×
    the one with scale 1 while ζ of the texts (``zeta[0]``) moves the same."""
    tau, size, n = 0.1, 5, 20
    generator = torch.Generator().manual_seed(32)
    sim = torch.rand(size, size, generator=generator, dtype=F64) * 0.4 - 0.2
    sim[3, :] = 0.6  # image 3 is close to every text: popular among the text anchors
    sim.fill_diagonal_(0.7)
    moves = {}
    for scale in (0.1, 1.0):
        loss = make64(
            NUCLRLoss, n, tau=tau, zeta_lr=0.01, zeta_lr_image_scale=scale, freeze_epochs=0, epochs=4
        )
        run(loss, leaf_logits(sim / tau, sim.t() / tau), list(range(size)), epoch=0.5)
        moves[scale] = loss.zeta[:, :size] + 0.05
    assert int(moves[1.0][1].argmax()) == 3 and float(moves[1.0][1, 3]) > 0
    torch.testing.assert_close(moves[0.1][1], 0.1 * moves[1.0][1])
    torch.testing.assert_close(moves[0.1][0], moves[1.0][0])


# ------------------------------------------------------------------ the paper's Algorithm 1, naive


@pytest.mark.parametrize("first_visit", ["ema", "set"])
def test_paper_configuration_matches_algorithm_1_loops(first_visit):
    """θ = 1, zeta_lr = η'/n, ξ every step, constant η: Algorithm 1's ζ ← ζ − η' Ĝ(ζ)."""
    n, tau, size = 9, 0.2, 4
    config = {**PAPER, "first_visit": first_visit}
    loss = make64(NUCLRLoss, n, tau=tau, gamma=0.7, zeta_lr=0.5 / n, freeze_epochs=1, **config)
    reference = Reference(n, tau, 0.7, zeta0=-0.05, xi0=0.0, lr=0.5, image_scale=0.1, first=first_visit)
    batches = [[0, 3, 5, 8], [3, 1, 8, 2], [5, 3, 6, 0], [7, 4, 1, 3]]
    for step, index in enumerate(batches):
        i2t, t2i = random_logits(size, tau, seed=step)
        logits = leaf_logits(i2t, t2i)
        epoch = 0.5 * (step + 1)  # batch epochs 0, 0, 1, 1: frozen for two steps, then learning
        out = run(loss, logits, index, epoch=epoch, step=step)
        grads, objective = reference.step([i2t.tolist(), t2i.tolist()], index, update_zeta=step >= 2)
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


def test_sogclr_defaults_are_libauc_code():
    """METHODS §11: LibAUC's code uses γ = 0.9 and τ = 0.01 (the docstring's value, now the default)."""
    loss = SogCLRLoss(8)
    assert (loss.tau, loss.gamma) == (0.01, 0.9)


def test_sogclr_is_nuclr_with_zero_zeta_and_no_xi_term():
    """One implementation: NUCLR with ζ ≡ 0 (ζ0 = 0, frozen) and ξ0 = ∞ (e^{−ξ/τ} = 0) is SogCLR."""
    tau, size, n = 0.1, 5, 12
    sogclr = make64(SogCLRLoss, n, tau=tau, gamma=0.9)
    nuclr = make64(
        NUCLRLoss, n, tau=tau, gamma=0.9, zeta_init=0.0, xi_init=math.inf, freeze_epochs=10**9, **PAPER
    )
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
    (ζ cancels) and Ĝ(w) is its exact gradient; z = n·∂(eq. 7)/∂ζ_j exactly."""
    n, tau, c = 6, 0.2, -0.05
    i2t, t2i = random_logits(n, tau, seed=4)
    loss = make64(
        NUCLRLoss,
        n,
        tau=tau,
        gamma=1.0,
        zeta_init=c,
        xi_init=c + 1e-12,
        zeta_lr=1.0,
        freeze_epochs=0,
        **PAPER,
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

    # z = n ∂F/∂ζ, Δζ = −η z, F(ζ) = mean_i τ log Σ_j exp((e_ij − ζ_j)/τ) − e_ii + mean ζ.
    for d, (rows, lr) in enumerate([(i2t, 1.0), (t2i, 0.1)]):
        zeta = torch.full((n,), c, dtype=F64, requires_grad=True)
        e = tau * rows
        value = (tau * torch.logsumexp((e - zeta) / tau, dim=1) - e.diagonal()).mean() + zeta.mean()
        (gradient,) = torch.autograd.grad(value, zeta)
        torch.testing.assert_close(loss.z[d, index], n * gradient)
        torch.testing.assert_close(loss.zeta[d, index], c - lr * n * gradient)


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
    loss = NUCLRLoss(n, tau=tau, zeta_init=-0.05, zeta_lr=0.01, freeze_epochs=0, epochs=3)
    run(loss, leaf_logits(*random_logits(4, tau, seed=6)), [1, 9, 12, 15], epoch=0.5)
    before = {k: v.clone() for k, v in loss.state_dict().items()}
    index = [2, 9, 14]
    run(loss, leaf_logits(*random_logits(3, tau, seed=7)), index, epoch=0.7)
    others = [k for k in range(n) if k not in index]
    for name in ("log_u", "zeta", "visited", "z", "z_visited", "b"):
        assert torch.equal(loss.state_dict()[name][:, others], before[name][:, others]), name
    assert (loss.log_u[:, index] != before["log_u"][:, index]).all()
    assert (loss.zeta[:, index] != before["zeta"][:, index]).all()
    assert loss.visited[:, index].all() and loss.z_visited[:, index].all()


def test_batch_epoch_reads_the_hosts_fractional_epoch():
    """The host passes epochs done including the batch: (e, e + 1] is epoch e."""
    assert [batch_epoch(x) for x in (0.0, 0.25, 1.0, 1.0 + 1e-9, 4.999, 5.0, 5.5)] == [0, 0, 0, 1, 4, 4, 5]


def test_zeta_and_z_frozen_before_freeze_epochs_then_updated():
    tau = 0.1
    loss = NUCLRLoss(8, tau=tau, zeta_init=-0.05, zeta_lr=0.5, freeze_epochs=5, zeta_lr_schedule="constant")
    for step, epoch in enumerate([0.5, 4.99, 5.0]):  # 5.0: the last batch of epoch 4
        out = run(loss, leaf_logits(*random_logits(3, tau, seed=step)), [0, 1, 2], epoch=epoch, step=step)
        assert (loss.zeta == -0.05).all() and (loss.z == 0).all() and float(out.metrics["zeta_lr"]) == 0.0
        assert float(out.metrics["zeta_std_t2i"]) == 0.0
    assert torch.isfinite(loss.log_u[:, :3]).all()  # u is updated while ζ is frozen
    out = run(loss, leaf_logits(*random_logits(3, tau, seed=8)), [0, 1, 2], epoch=5.1, step=3)
    assert (loss.zeta[:, :3] != -0.05).all() and (loss.zeta[:, 3:] == -0.05).all()
    assert float(out.metrics["zeta_lr"]) == 0.5 and float(out.metrics["zeta_std_t2i"]) > 0


def test_xi_step_is_max_of_xi0_and_zeta():
    """Well-separated positives (L_ij − L_ii = −15) leave only the i = j term of Ĝ(ζ_j), ≈ −1/B + 1/n
    = −1/6 with u ≈ 0: ζ rises by η'/6. A large η' lifts ζ above ξ0, so ξ = max ζ over all n; a
    small η' keeps ζ below ξ0, so ξ = ξ0 (``xi_update="step"``, Algorithm 1)."""
    tau, n = 0.1, 6
    i2t = torch.full((3, 3), -5.0) + torch.eye(3) * 15.0
    kwargs = dict(tau=tau, zeta_init=0.0, xi_init=0.1, zeta_lr_image_scale=1.0, freeze_epochs=0, **PAPER)
    small = NUCLRLoss(n, zeta_lr=0.01 / n, **kwargs)
    run(small, leaf_logits(i2t, i2t), [0, 2, 4])
    assert (small.zeta[:, [0, 2, 4]] > 0).all() and (small.zeta < 0.1).all()
    assert small.xi.tolist() == pytest.approx([0.1, 0.1])

    large = NUCLRLoss(n, zeta_lr=5.0 / n, **kwargs)
    run(large, leaf_logits(i2t, i2t), [0, 2, 4])
    assert large.zeta[:, [0, 2, 4]].flatten().tolist() == pytest.approx([5 / 6] * 6, rel=1e-5)
    peak = large.zeta.max(dim=1).values.clone()
    large.zeta_lr = 1.0 / n  # the next batch's ζ stay below the first batch's: ξ still sees them
    run(large, leaf_logits(i2t, i2t), [1, 3, 5])
    assert (large.zeta[:, [1, 3, 5]] < peak.unsqueeze(1)).all()
    torch.testing.assert_close(large.xi, peak)
    torch.testing.assert_close(large.xi, large.zeta.max(dim=1).values.clamp_min(0.1))


def test_xi_epoch_is_refreshed_once_per_epoch_before_its_first_batch():
    """``xi_update="epoch"`` (the code): ξ stays ξ0 through epoch 0 although ζ rose above it, and
    becomes max ζ at epoch 1's first batch, before that batch's weights use it."""
    tau, n = 0.1, 6
    i2t = torch.full((3, 3), -5.0) + torch.eye(3) * 15.0
    loss = NUCLRLoss(
        n,
        tau=tau,
        zeta_init=0.0,
        xi_init=0.1,
        zeta_lr=1.0,
        zeta_lr_image_scale=1.0,
        freeze_epochs=0,
        zeta_lr_schedule="constant",
    )
    run(loss, leaf_logits(i2t, i2t), [0, 2, 4], epoch=0.5)
    run(loss, leaf_logits(i2t, i2t), [1, 3, 5], epoch=1.0)
    assert (loss.zeta.max(dim=1).values > 0.1).all() and loss.xi.tolist() == pytest.approx([0.1, 0.1])
    peak = loss.zeta.max(dim=1).values.clone()
    out = run(loss, leaf_logits(i2t, i2t), [0, 1, 2], epoch=1.5)
    torch.testing.assert_close(loss.xi, peak)
    assert float(out.metrics["xi_i2t"]) == pytest.approx(float(peak[0])) and int(loss.xi_epoch) == 1


def test_state_dict_round_trip_continues_identically():
    tau, n = 0.1, 10
    kwargs = dict(tau=tau, zeta_init=-0.05, zeta_lr=0.05, freeze_epochs=0, epochs=4, offset_rescale="code")
    first = NUCLRLoss(n, **kwargs)
    run(first, leaf_logits(*random_logits(4, tau, seed=9)), [0, 3, 6, 9], epoch=0.5)
    second = NUCLRLoss(n, **kwargs)
    second.load_state_dict(first.state_dict())
    assert set(first.state_dict()) == {"log_u", "visited", "b", "zeta", "z", "z_visited", "xi", "xi_epoch"}
    logits = random_logits(4, tau, seed=10)
    a, b = leaf_logits(*logits), leaf_logits(*logits)
    out_a, out_b = (
        run(first, a, [3, 1, 9, 7], step=1, epoch=1.5),
        run(second, b, [3, 1, 9, 7], step=1, epoch=1.5),
    )
    assert torch.equal(out_a.loss, out_b.loss) and torch.equal(a.i2t.grad, b.i2t.grad)
    assert torch.equal(a.t2i.grad, b.t2i.grad)
    for key, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[key]), key


def test_first_visit_set_puts_g_into_u_then_averages():
    n, tau, size = 8, 0.2, 3
    i2t, t2i = random_logits(size, tau, seed=11)
    frozen = dict(freeze_epochs=10**9, zeta_lr_schedule="constant")
    sets, ema = (make64(NUCLRLoss, n, tau=tau, gamma=0.8, first_visit=v, **frozen) for v in ("set", "ema"))
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
    loss = NUCLRLoss(n, tau=tau, zeta_init=-0.05, zeta_lr=5e-6 / n, freeze_epochs=0, **PAPER)
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


def test_cosine_stepdown_values_over_epochs():
    """The code's schedule for E = 30, start 5: cosine over epochs 5..29, ÷10 from 15, ÷100 from 22."""
    loss = NUCLRLoss(4, zeta_lr=5e-6, freeze_epochs=5, epochs=30)

    def cosine(e):
        return 0.5 * (1 + math.cos(math.pi * (e - 5) / 24))

    assert [loss.zeta_lr_at(e) for e in range(5)] == [0.0] * 5
    assert loss.zeta_lr_at(5) == pytest.approx(5e-6)
    assert loss.zeta_lr_at(14) == pytest.approx(5e-6 * cosine(14))
    assert loss.zeta_lr_at(15) == pytest.approx(5e-6 * cosine(15) / 10)
    assert loss.zeta_lr_at(21) == pytest.approx(5e-6 * cosine(21) / 10)
    assert loss.zeta_lr_at(22) == pytest.approx(5e-6 * cosine(22) / 100)
    assert loss.zeta_lr_at(29) == 0.0 and cosine_stepdown(40, 5, 30) == 0.0  # held at 0 past the end
    assert NUCLRLoss(4, zeta_lr=5e-6, zeta_lr_schedule="constant").zeta_lr_at(22) == 5e-6


def test_epochs_derive_from_the_host():
    """round(train.steps × batch / n): the CC3M recipe's 159 562 steps × 512 / 2 723 200 → 30."""
    assert NUCLRLoss(2_723_200, total_steps=159_562, batch_size=512).epochs == 30
    assert NUCLRLoss(100, total_steps=100, batch_size=7, epochs=12).epochs == 12  # explicit wins


def test_schedule_drives_the_zeta_step():
    """Δζ ∝ η_e: the same batch in epoch 0 and in epoch 2 (÷10 from ⌊E/2⌋ = 2, cosine (2/3)) of E = 4."""
    tau = 0.1
    logits = random_logits(3, tau, seed=12)
    steps = {}
    for epoch in (0, 2):
        loss = make64(NUCLRLoss, 8, tau=tau, zeta_lr=0.01, freeze_epochs=0, epochs=4)
        run(loss, leaf_logits(*logits), [0, 1, 2], epoch=epoch + 0.5)
        steps[epoch] = loss.zeta[0, :3] + 0.05  # Δζ = ζ − ζ0
    assert (steps[0].abs() > 1e-4).all()
    torch.testing.assert_close(steps[2], steps[0] * 0.5 * (1 + math.cos(math.pi * 2 / 3)) / 10)


def test_zeta_spread_grows_after_the_freeze():
    """``zeta_std_*`` (over all n) is 0 while frozen, then grows as more samples move."""
    tau, n, size = 0.1, 24, 6
    loss = NUCLRLoss(n, tau=tau, zeta_lr=0.01, freeze_epochs=1, epochs=4)
    spreads = []
    for step in range(8):
        index = [(step * size + k) % n for k in range(size)]
        out = run(loss, leaf_logits(*random_logits(size, tau, seed=40 + step)), index, epoch=(step + 1) / 4)
        spreads.append(float(out.metrics["zeta_std_t2i"]))
    assert spreads[:4] == [0.0] * 4 and all(b > a for a, b in zip(spreads[3:], spreads[4:], strict=False))


@pytest.mark.slow
def test_tiny_run_logs_a_zeta_spread_that_grows_after_the_freeze(tmp_path):
    """`nuclr@tiny` end to end (32 pairs, batch 16: 2 steps per epoch, 8 epochs, ζ frozen for 2):
    metrics.jsonl's ``zeta_std_*`` is 0 through epoch 1, positive from epoch 2 and larger at the
    end of the cosine (epoch 6) than at its start; it stays put in epoch 7 (η = 0)."""
    registry = Registry(make_plugin_manager(autoload=False))
    source = "synthetic://shapes?n=32&split=train&image_size=48"
    api.shard(source, tmp_path / "shards", registry=registry)
    overrides = [
        f"data.shards={tmp_path / 'shards'}",
        f"data.source={source}",
        "data.batch_size=16",
        "model.image_encoder=vit_tiny",
        "model.text_encoder=text_transformer_tiny",
        "loss.freeze_epochs=2",
        "train.steps=16",
        "train.log_every=1",
        "train.export=false",
    ]
    api.train("nuclr@tiny", overrides, run_dir=tmp_path / "run", registry=registry)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 16
    for key in ("zeta_std_i2t", "zeta_std_t2i"):
        spread = [row[key] for row in rows]
        assert spread[:4] == [0.0] * 4  # epochs 0 and 1: frozen
        moving = [s for s, row in zip(spread, rows, strict=True) if row["zeta_lr"] > 0]
        assert len(moving) == 10 and 0 < moving[0] < moving[-1], key  # epochs 2–6; η = 0 in epoch 7
        assert spread[-2:] == [moving[-1]] * 2  # the last epoch: the cosine has reached 0


def test_contract_checks():
    out = check_loss(NUCLRLoss(num_samples=64, epochs=30))
    expected = {
        "objective",
        "surrogate",
        "objective_i2t",
        "xi_t2i",
        "zeta_mean_i2t",
        "zeta_std_t2i",
        "u_mean_t2i",
    }
    assert expected <= set(out.metrics)
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
        ({"epochs": None}, "total_steps and batch_size"),
        ({"first_visit": "never"}, "first_visit"),
        ({"xi_update": "never"}, "xi_update"),
        ({"offset_rescale": "never"}, "offset_rescale"),
        ({"zeta_momentum": 0.0}, "zeta_momentum"),
        ({"zeta_lr": -1.0}, "zeta_lr"),
        ({"freeze_epochs": -1.0}, "freeze_epochs"),
        ({"freeze_epochs": 2.5}, "freeze_epochs"),
    ],
)
def test_bad_arguments(kwargs, message):
    kwargs = {"num_samples": 8, "epochs": 30, **kwargs}
    with pytest.raises(ValueError, match=message):
        NUCLRLoss(**kwargs)


def test_too_short_a_run_warns_that_zeta_will_not_move():
    """E ≤ freeze_epochs + 1 (a smoke run, or E − 1 = start where the code divides by 0): η = 0."""
    with pytest.warns(UserWarning, match="ζ will not move"):
        loss = NUCLRLoss(8, epochs=6, freeze_epochs=5)
    assert [loss.zeta_lr_at(e) for e in range(8)] == [0.0] * 8


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
        NUCLRLoss(8, epochs=30)(logits, targets, ctx(index))
