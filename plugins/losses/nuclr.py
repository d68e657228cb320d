"""`nuclr` and `sogclr`: global contrastive losses with per-sample state (METHODS.md §6, §11).

Both optimise a finite-sum coupled compositional objective with a moving-average estimate
u_i of each anchor's inner sum (SOX / SogCLR), so small batches see "all n negatives".
NUCLR (seed 004, Appendix G Algorithm 1) adds a learned per-sample popularity ζ ∈ R^n and a
scalar ξ = max(ξ0, max ζ) that down-weights the positive; SogCLR is the same machinery with
ζ ≡ 0 and no positive term. One implementation (:class:`CompositionalContrastive`), two
configurations.

What the losses assume about their logits
-----------------------------------------
The logits are e(o_i, a_j)/τ: the ``dot`` similarity with a *fixed* scale 1/τ, and the
loss's ``tau`` set to the same τ. A recipe therefore says::

    similarity: {name: dot, init_scale: 100.0, learn_scale: false, max_scale: null}   # 1/τ
    loss: {name: nuclr, tau: 0.01}

(``max_scale`` must not clip 1/τ: dot clamps at 100 by default, i.e. τ ≥ 0.01.) The batch must
be the full global batch: ``logits.i2t`` and ``logits.t2i`` are [N, N], ``targets`` is the
diagonal and ``ctx.index`` [N] holds the global index of each pair (distinct within a batch;
NUCLR's official code computes the full-batch loss on gathered features, METHODS §11).

Σ_ij = e(o_i, a_j) − e(o_i, a_i) = τ (L_ij − L_ii) for row i's anchor. Direction 0 is
image→text (rows of ``logits.i2t``: image anchors, text candidates), direction 1 text→image
(rows of ``logits.t2i``). Each direction has its own u, ζ, ξ; the loss is the sum of both.
ζ_j of a direction belongs to candidate j, so direction 0's ζ measures the popularity of the
texts among image anchors. "Image side" in §11's "ζ step size × 0.1 on the image side" is
taken to be direction 0 (the image-anchored loss); ``zeta_lr_image_scale`` applies to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from clipkit.types import Logits, LossContext, LossOutput

DIRECTIONS = ("i2t", "t2i")
ZETA_LR_SCHEDULES = ("constant", "cosine_stepdown")
FIRST_VISITS = ("ema", "set")


@dataclass(frozen=True)
class DirectionStep:
    """One direction's quantities for one batch (all detached, dtype of the computation).

    coef:      [B, B] ∂loss/∂Σ_ij: the Ĝ(w) coefficient of ∇Σ_ij (0 on the diagonal).
    log_u:     [B] log u_i after the moving-average update (u_{t+1} of Algorithm 1).
    log_g:     [B] log g_i, the batch estimate (1/(B−1)) Σ_{j≠i} exp((Σ_ij − ζ_j)/τ).
    zeta_grad: [B] Ĝ(ζ_j) for the batch's candidates, or None (SogCLR: ζ ≡ 0).
    objective: 0-d minibatch estimate of the eq. 7 objective (see ``objective_estimate``).
    """

    coef: Tensor
    log_u: Tensor
    log_g: Tensor
    zeta_grad: Tensor | None
    objective: Tensor


def off_diagonal_log_mean_exp(exponents: Tensor) -> Tensor:
    """[B, B] exponents a_ij -> [B] log((1/(B−1)) Σ_{j≠i} exp a_ij).

    logsumexp subtracts the row maximum before exponentiating and adds it back, an exact
    rewrite that never overflows (τ = 0.01 puts a_ij near 200, beyond fp32's exp range 88).
    """
    size = exponents.shape[0]
    eye = torch.eye(size, dtype=torch.bool, device=exponents.device)
    return torch.logsumexp(exponents.masked_fill(eye, -math.inf), dim=1) - math.log(size - 1)


def moving_average_log(log_u: Tensor, log_g: Tensor, gamma: float, set_first: Tensor | None) -> Tensor:
    """log of u ← (1−γ)u + γ g, computed as logaddexp so u never leaves log-space.

    log_u, log_g: [B]; u = 0 (never visited) is log_u = −inf and gives log γ + log g.
    set_first:    [B] bool, rows where u is set to g instead (official code's first visit), or None.
    """
    if gamma == 1.0:  # u ← g; also avoids math.log1p(-1), a domain error
        return log_g
    updated = torch.logaddexp(log_u + math.log1p(-gamma), log_g + math.log(gamma))
    return updated if set_first is None else torch.where(set_first, log_g, updated)


def direction_step(
    logits: Tensor,
    log_u: Tensor,
    zeta: Tensor | None,
    xi: Tensor | None,
    *,
    tau: float,
    gamma: float,
    num_samples: int,
    set_first: Tensor | None = None,
) -> DirectionStep:
    """Algorithm 1 steps 4–6 and 8 for one direction (no state is written here).

    logits: [B, B] e(o_i, a_j)/τ, row i = anchor i, its positive on the diagonal (detached inside).
    log_u:  [B] log u_i of the anchors before the update.
    zeta:   [B] ζ of the batch's pairs (candidate j's ζ_j; anchor i's own ζ_i), or None for ζ ≡ 0.
    xi:     0-d ξ (positive down-weighting), or None for no positive term (SogCLR).

    With a_ij = (Σ_ij − ζ_j)/τ = L_ij − L_ii − ζ_j/τ and ν = n − 1:
      g_i          = (1/(B−1)) Σ_{j≠i} exp(a_ij),  u_i ← (1−γ)u_i + γ g_i
      coef_ij      = (1/B)(1/(B−1)) exp(a_ij) / (u_i + exp(−ξ/τ)/ν)          (j ≠ i)
      Ĝ(ζ_j)       = −(1/ν)(1/B) Σ_{i∈B} exp(a_ij) / (u_i + exp(−ζ_i/τ)/ν) + 1/n
    where the ζ sum includes i = j (Σ_jj = 0, so a_jj = −ζ_j/τ). Every ratio is formed as
    exp(log numerator − log denominator) with the denominators from logaddexp, so the large
    exponents cancel before exponentiation; the ratios are bounded (≤ (B−1)/γ and ≤ ν).
    """
    size = logits.shape[0]
    eye = torch.eye(size, dtype=torch.bool, device=logits.device)
    with torch.no_grad():
        margins = logits - logits.diagonal().unsqueeze(1)  # Σ_ij/τ, exactly 0 on the diagonal
        exponents = margins if zeta is None else margins - (zeta / tau).unsqueeze(0)
        log_g = off_diagonal_log_mean_exp(exponents)
        log_u_new = moving_average_log(log_u, log_g, gamma, set_first)

        log_nu = math.log(num_samples - 1)
        log_den = log_u_new if xi is None else torch.logaddexp(log_u_new, -xi / tau - log_nu)
        coef = (exponents - log_den.unsqueeze(1)).exp().masked_fill(eye, 0.0) / (size * (size - 1))

        zeta_grad = None
        if zeta is not None:
            log_den_zeta = torch.logaddexp(log_u_new, -zeta / tau - log_nu)
            log_sum = torch.logsumexp(exponents - log_den_zeta.unsqueeze(1), dim=0)  # over anchors i
            zeta_grad = 1.0 / num_samples - (log_sum - log_nu - math.log(size)).exp()
        objective = objective_estimate(log_g, zeta, tau=tau, num_samples=num_samples)
    return DirectionStep(coef, log_u_new, log_g, zeta_grad, objective)


def objective_estimate(log_g: Tensor, zeta: Tensor | None, *, tau: float, num_samples: int) -> Tensor:
    """The batch's estimate of one direction of eq. 7 (seed 004), without the (1/n) Σ ζ term.

    Eq. 7 per anchor: −τ log( exp(e_ii/τ) / Σ_{j∈[n]} exp((e_ij − ζ_j)/τ) )
                    = τ log( exp(−ζ_i/τ) + Σ_{j≠i} exp((Σ_ij − ζ_j)/τ) ).
    The sum over the n − 1 negatives is estimated from the batch as (n − 1)·g_i, so this returns
    mean_{i∈B} τ·log( exp(−ζ_i/τ) + (n − 1) g_i ). With ζ ≡ 0 it is τ × the InfoNCE loss over all
    n candidates (the global contrastive loss, Remark 2 of seed 004), which is what SogCLR logs.
    The caller adds (1/n) Σ_{j∈[n]} ζ_j, known exactly from the state.
    """
    positive = torch.zeros_like(log_g) if zeta is None else -zeta / tau
    return tau * torch.logaddexp(positive, log_g + math.log(num_samples - 1)).mean()


def cosine_stepdown(step: int, total_steps: int) -> float:
    """Factor of the ζ step size at ``step`` (§11, official NUCLR code): cosine decay to 0 over
    ``total_steps``, divided by 10 from 50 % of training and by 100 (not 1000) from 75 %."""
    progress = min(max(step, 0), total_steps) / total_steps
    factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    if progress >= 0.75:
        return factor / 100.0
    if progress >= 0.5:
        return factor / 10.0
    return factor


class CompositionalContrastive(nn.Module):
    """The shared NUCLR/SogCLR machinery (METHODS §6; Appendix G Algorithm 1 of seed 004).

    Per call and per direction d (0 = i2t, 1 = t2i), for the batch's global indices idx:
      1. u_idx ← (1−γ) u_idx + γ g (u set to g on a first visit when ``first_visit="set"``);
      2. the surrogate Σ_i Σ_{j≠i} coef_ij·Σ_ij (coef detached, Σ_ij = τ (L_ij − L_ii)) has
         ∂/∂Σ_ij = coef_ij, so autograd gives Ĝ(w) = Σ_ij coef_ij ∇Σ_ij exactly; with respect to
         the logits ∂/∂L_ij = τ coef_ij (j ≠ i) and ∂/∂L_ii = −τ Σ_{j≠i} coef_ij;
      3. (NUCLR, once ``ctx.epoch ≥ freeze_epochs``) ζ_idx ← ζ_idx − η_d Ĝ(ζ);
      4. (NUCLR) ξ_d ← max(ξ0, max ζ_d).
    Steps 2–3 use the updated u (Algorithm 1 order) and the ζ, ξ from before this call. Every
    call advances the state, so call it once per optimiser step (no gradient accumulation, §11).

    The returned ``loss`` has the *value* of the eq. 7 objective estimate (summed over both
    directions, see :func:`objective_estimate`, plus mean ζ) and the *gradient* of the
    surrogate: loss = objective.detach() + surrogate − surrogate.detach(). The objective is what
    a user wants to watch (METHODS §6); the official code logs the surrogate instead (§11).

    State (buffers, saved in checkpoints): ``log_u`` [2, n] (log u; −inf = 0, the initial value)
    and ``visited`` [2, n] bool; NUCLR also ``zeta`` [2, n] and ``xi`` [2]. u is kept in log-space
    because u ≈ exp((Σ − ζ)/τ) overflows fp32 at τ = 0.01 as soon as Σ − ζ > 0.88.
    """

    requires: frozenset[str] = frozenset({"index", "epoch", "step"})

    def __init__(
        self,
        num_samples: int,
        tau: float,
        gamma: float,
        *,
        learn_popularity: bool,
        zeta_init: float = 0.0,
        xi_init: float = 0.0,
        zeta_lr: float = 0.0,
        zeta_lr_image_scale: float = 1.0,
        freeze_epochs: float = 0.0,
        total_steps: int | None = None,
        zeta_lr_schedule: str = "constant",
        first_visit: str = "ema",
    ) -> None:
        super().__init__()
        _validate(num_samples, tau, gamma, zeta_init, xi_init, zeta_lr, zeta_lr_image_scale, freeze_epochs)
        _validate_schedule(total_steps, zeta_lr_schedule, first_visit)
        self.num_samples, self.tau, self.gamma = int(num_samples), float(tau), float(gamma)
        self.learn_popularity = learn_popularity
        self.xi_init = float(xi_init)
        self.zeta_lr, self.zeta_lr_image_scale = float(zeta_lr), float(zeta_lr_image_scale)
        self.freeze_epochs, self.total_steps = float(freeze_epochs), total_steps
        self.zeta_lr_schedule, self.first_visit = zeta_lr_schedule, first_visit
        self.register_buffer("log_u", torch.full((2, num_samples), -math.inf))
        self.register_buffer("visited", torch.zeros(2, num_samples, dtype=torch.bool))
        if learn_popularity:
            self.register_buffer("zeta", torch.full((2, num_samples), float(zeta_init)))
            self.register_buffer("xi", torch.full((2,), max(float(xi_init), float(zeta_init))))

    @property
    def u(self) -> Tensor:
        """[2, n] u = exp(log u) in float64 (for inspection; the state is ``log_u``)."""
        return self.log_u.double().exp()

    def zeta_lr_at(self, step: int) -> float:
        """The base ζ step size η at optimiser ``step`` (before the image-side scale)."""
        if self.zeta_lr_schedule == "constant":
            return self.zeta_lr
        return self.zeta_lr * cosine_stepdown(step, self.total_steps)

    def forward(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        index = ctx.index
        _validate_batch(logits, targets, index, self.num_samples)
        work = torch.promote_types(logits.i2t.dtype, self.log_u.dtype)
        update_zeta = self.learn_popularity and float(ctx.epoch) >= self.freeze_epochs
        base_lr = self.zeta_lr_at(int(ctx.step))
        surrogate = logits.i2t.new_zeros(())
        objective = torch.zeros((), dtype=work, device=logits.i2t.device)
        metrics: dict[str, Tensor | float] = {}
        for d, (name, rows) in enumerate(zip(DIRECTIONS, (logits.i2t, logits.t2i), strict=True)):
            step = self._step(d, rows.detach().to(work), index)
            margins = self.tau * (rows - rows.diagonal().unsqueeze(1))  # Σ_ij, with gradient
            surrogate = surrogate + (step.coef.to(rows.dtype) * margins).sum()
            direction_objective = step.objective
            if self.learn_popularity:
                direction_objective = direction_objective + self.zeta[d].to(work).mean()
            objective = objective + direction_objective
            self._write_state(d, index, step, base_lr if update_zeta else 0.0)
            metrics.update(self._metrics(d, name, index, direction_objective))
        metrics["objective"] = objective
        if self.learn_popularity:
            metrics["zeta_lr"] = base_lr if update_zeta else 0.0
        loss = objective.to(surrogate.dtype) + surrogate - surrogate.detach()
        return LossOutput(loss, metrics)

    def _step(self, d: int, rows: Tensor, index: Tensor) -> DirectionStep:
        """Direction d's quantities from the current state (nothing written)."""
        zeta = self.zeta[d, index].to(rows.dtype) if self.learn_popularity else None
        xi = self.xi[d].to(rows.dtype) if self.learn_popularity else None
        set_first = ~self.visited[d, index] if self.first_visit == "set" else None
        return direction_step(
            rows,
            self.log_u[d, index].to(rows.dtype),
            zeta,
            xi,
            tau=self.tau,
            gamma=self.gamma,
            num_samples=self.num_samples,
            set_first=set_first,
        )

    @torch.no_grad()
    def _write_state(self, d: int, index: Tensor, step: DirectionStep, base_lr: float) -> None:
        """Write u (always) and ζ, ξ (NUCLR) of direction d; only the batch's coordinates of u, ζ."""
        self.log_u[d, index] = step.log_u.to(self.log_u.dtype)
        self.visited[d, index] = True
        if not self.learn_popularity:
            return
        lr = base_lr * (self.zeta_lr_image_scale if d == 0 else 1.0)
        if lr > 0.0:
            zeta = self.zeta[d, index].to(step.zeta_grad.dtype) - lr * step.zeta_grad
            self.zeta[d, index] = zeta.to(self.zeta.dtype)
        self.xi[d] = self.zeta[d].max().clamp_min(self.xi_init)

    def _metrics(self, d: int, name: str, index: Tensor, objective: Tensor) -> dict[str, Tensor]:
        out = {
            f"objective_{name}": objective.detach(),
            f"u_mean_{name}": self.log_u[d, index].double().exp().mean(),
        }
        if self.learn_popularity:
            out[f"zeta_mean_{name}"] = self.zeta[d].mean()
            out[f"xi_{name}"] = self.xi[d].clone()
        return out


class NUCLRLoss(CompositionalContrastive):
    """NUCLR (METHODS §6; seed 004 §2.3, Appendix G Algorithm 1, Appendix H; §11 code notes).

    num_samples:         n, the dataset size (passed by the host from the shard manifest).
    tau:                 τ; the similarity must be ``dot`` with fixed scale 1/τ (module docstring).
    gamma:               γ of the moving average u (0.8).
    zeta_init:           ζ0 (−0.05 on CC3M and in the official code, 0 on CC12M).
    xi_init:             ξ0, must exceed ζ0 (Algorithm 1; official code 0). The defaults are the
                         official code's ζ0 = −0.05, ξ0 = 0: a recipe with ζ0 = 0 must raise ξ0.
    zeta_lr:             η, the ζ step size (official code 5e-6).
    zeta_lr_image_scale: factor on η for direction 0, the image-anchored side (§11: 0.1).
    freeze_epochs:       ζ is updated only once ``ctx.epoch ≥ freeze_epochs`` (5).
    total_steps:         training length for ``zeta_lr_schedule="cosine_stepdown"``.
    zeta_lr_schedule:    "constant" (the paper) or "cosine_stepdown" (§11: cosine decay, then
                         ÷10 from 50 % and ÷100 from 75 % of ``total_steps``).
    first_visit:         "ema" (the paper: u starts at 0 and is averaged) or "set" (official
                         code: u_i ← g_i on a sample's first visit).

    Metrics: ``objective`` (eq. 7 estimate, both directions; also the loss's value),
    ``objective_{d}``, ``zeta_mean_{d}`` (over all n), ``xi_{d}``, ``u_mean_{d}`` (over the
    batch, after the update), ``zeta_lr`` (the base η applied this step, 0 while frozen).

    Hand-derived case (tested): B = 3, n = 5, τ = 0.5, ζ0 = −0.1, row 0 of Σ = (0, −0.8, −0.6):
    g_0 = ½(e^{2(−0.8+0.1)} + e^{2(−0.6+0.1)}) = ½(e^{−1.4} + e^{−1}) ≈ 0.30722.
    """

    def __init__(
        self,
        num_samples: int,
        tau: float = 0.01,
        gamma: float = 0.8,
        zeta_init: float = -0.05,
        xi_init: float = 0.0,
        zeta_lr: float = 5e-6,
        zeta_lr_image_scale: float = 0.1,
        freeze_epochs: float = 5.0,
        total_steps: int | None = None,
        zeta_lr_schedule: str = "constant",
        first_visit: str = "ema",
    ) -> None:
        if not xi_init > zeta_init:
            raise ValueError(f"xi_init (ξ0) must exceed zeta_init (ζ0), got ξ0={xi_init}, ζ0={zeta_init}")
        super().__init__(
            num_samples,
            tau,
            gamma,
            learn_popularity=True,
            zeta_init=zeta_init,
            xi_init=xi_init,
            zeta_lr=zeta_lr,
            zeta_lr_image_scale=zeta_lr_image_scale,
            freeze_epochs=freeze_epochs,
            total_steps=total_steps,
            zeta_lr_schedule=zeta_lr_schedule,
            first_visit=first_visit,
        )


class SogCLRLoss(CompositionalContrastive):
    """SogCLR (METHODS §6 baseline; Yuan et al. 2022): NUCLR with ζ ≡ 0 and no ξ term.

    Model weights exp(Σ_ij/τ)/u_i, u the γ-moving average of g_i = (1/(B−1)) Σ_{j≠i} exp(Σ_ij/τ).
    No ζ/ξ state is stored. §11: LibAUC's code uses γ = 0.9 and τ = 0.01.

    Metrics: ``objective`` = eq. 7 at ζ ≡ 0, i.e. τ × the global (all-n-candidates) InfoNCE
    estimate mean_i τ log(1 + (n−1) g_i), summed over directions (also the loss's value);
    ``objective_{d}`` and ``u_mean_{d}`` per direction.
    """

    def __init__(self, num_samples: int, tau: float = 0.1, gamma: float = 0.9) -> None:
        super().__init__(num_samples, tau, gamma, learn_popularity=False)


def _validate(
    num_samples: int,
    tau: float,
    gamma: float,
    zeta_init: float,
    xi_init: float,
    zeta_lr: float,
    zeta_lr_image_scale: float,
    freeze_epochs: float,
) -> None:
    if int(num_samples) != num_samples or num_samples < 2:
        raise ValueError(f"num_samples (dataset size n) must be an integer ≥ 2, got {num_samples}")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if not math.isfinite(zeta_init) or math.isnan(xi_init):
        raise ValueError(f"zeta_init must be finite and xi_init a number, got {zeta_init}, {xi_init}")
    if not zeta_lr >= 0 or not zeta_lr_image_scale >= 0:
        raise ValueError(f"zeta_lr and zeta_lr_image_scale must be ≥ 0, got {zeta_lr}, {zeta_lr_image_scale}")
    if not freeze_epochs >= 0:
        raise ValueError(f"freeze_epochs must be ≥ 0, got {freeze_epochs}")


def _validate_schedule(total_steps: int | None, zeta_lr_schedule: str, first_visit: str) -> None:
    if zeta_lr_schedule not in ZETA_LR_SCHEDULES:
        raise ValueError(f"zeta_lr_schedule must be one of {ZETA_LR_SCHEDULES}, got {zeta_lr_schedule!r}")
    if first_visit not in FIRST_VISITS:
        raise ValueError(f"first_visit must be one of {FIRST_VISITS}, got {first_visit!r}")
    if total_steps is not None and total_steps < 1:
        raise ValueError(f"total_steps must be ≥ 1, got {total_steps}")
    if zeta_lr_schedule == "cosine_stepdown" and total_steps is None:
        raise ValueError("zeta_lr_schedule='cosine_stepdown' needs total_steps")


def _validate_batch(logits: Logits, targets: Tensor, index: Tensor, num_samples: int) -> None:
    size = logits.i2t.shape[0]
    if logits.i2t.shape != (size, size) or logits.t2i.shape != (size, size):
        raise ValueError(
            "nuclr/sogclr need the full global batch: square logits, got "
            f"i2t {tuple(logits.i2t.shape)} and t2i {tuple(logits.t2i.shape)}"
        )
    if size < 2:
        raise ValueError(f"the batch needs at least 2 pairs (negatives), got {size}")
    if index.shape != (size,):
        raise ValueError(f"ctx.index must be [N] = ({size},), got {tuple(index.shape)}")
    if not torch.equal(targets, torch.arange(size, device=targets.device)):
        raise ValueError("nuclr/sogclr need the positives on the diagonal (targets = arange(N))")
    if int(index.min()) < 0 or int(index.max()) >= num_samples:
        raise ValueError(
            f"ctx.index must lie in [0, {num_samples}), got [{int(index.min())}, {int(index.max())}]"
        )
    if torch.unique(index).numel() != size:
        raise ValueError("ctx.index holds a sample twice in one batch; its state update would be ambiguous")
