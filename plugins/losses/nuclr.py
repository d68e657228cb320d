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
NUCLR's official code computes the full-batch loss on gathered features, METHODS §11). Every
process sees the same gathered batch and indices, so the state stays identical on every rank.

Directions and sides
--------------------
Σ_ij = e(o_i, a_j) − e(o_i, a_i) = τ (L_ij − L_ii) for row i's anchor. Direction 0 is
image→text (rows of ``logits.i2t``: image anchors, text candidates), direction 1 text→image
(rows of ``logits.t2i``: text anchors, image candidates). Each direction has its own u, b, ζ, z,
ξ; the loss is the sum of both. ζ_j of a direction belongs to *candidate* j, so ``zeta[0]`` is
the popularity of the texts (the authors' ``zeta_T``) and ``zeta[1]`` the popularity of the
images (``zeta_I``). The authors' ``eta_I_ratio`` = 0.1 scales the step of ``zeta_I``, i.e.
direction 1 here (``zeta_lr_image_scale``).

The ζ step: why the official η multiplies n·Ĝ(ζ)
------------------------------------------------
Algorithm 1 (the paper) steps ζ_j ← ζ_j − η Ĝ(ζ_j) with the gradient of the 1/n-normalised
objective, ν = n − 1, a_ij = (Σ_ij − ζ_j)/τ:

    Ĝ(ζ_j) = 1/n − (1/ν)(1/B) Σ_{i∈B} exp(a_ij) / (u_i + exp(−ζ_i/τ)/ν)      (i = j included).

The authors' code (``DGCL_Loss``) keeps a running maximum b_i of Σ_ij and stores
s_i = Σ_{j≠i} exp((Σ_ij − b_i − ζ_j)/τ) averaged, i.e. s_i = (B−1) u_i exp(−b_i/τ). Its ratio
w̃_ij = exp((Σ_ij − b_i − ζ_j)/τ) / (s_i/(B−1) + exp(−(ζ_i + b_i)/τ)/ν) therefore equals
exp(a_ij)/(u_i + exp(−ζ_i/τ)/ν) (the exp(−b_i/τ) cancels), and its per-candidate target

    z*_j = 1 − (n/ν) · mean_{i∈B} w̃_ij = n · Ĝ(ζ_j)

is of order 1, n times the paper's gradient. The code averages it, z_j ← (1−θ) z_j + θ z*_j
(θ = 0.9; on the first update of sample j, z_j := z*_j), and steps ζ_j ← ζ_j − η_t z_j with
η = 5e-6. So η_code·z ≈ (n·η_code)·Ĝ(ζ): the paper-scale step size is n·η_code (≈ 13.6 on
CC3M, n = 2 723 200). The paper's update is this one with θ = 1 and η = η_paper / n, so no
separate option is needed. (clipkit used to apply η = 5e-6 to Ĝ(ζ) itself: ζ moved ~n times
slower than in the authors' runs, effectively frozen.)

Schedule (``zeta_lr_schedule="cosine_stepdown"``, the code's): for the batch's epoch e
(0-based, see :func:`batch_epoch`), nothing before ``freeze_epochs`` (the code's
``start_epochs``), then η_e = ½ η (1 + cos(π (e − e0)/(E − 1 − e0))), ÷10 for e ≥ ⌊E/2⌋ and
÷100 for e ≥ ⌊3E/4⌋, E the number of epochs; past epoch E − 1 the cosine stays at 0 (the code
never runs there).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from torch import Tensor, nn

from clipkit.config.constraints import NON_NEGATIVE, POSITIVE, OneOf, Range
from clipkit.contract.types import Logits, LossContext, LossOutput
from clipkit.tiled import TiledLogits

DIRECTIONS = ("i2t", "t2i")
ZETA_LR_SCHEDULES = ("constant", "cosine_stepdown")
FIRST_VISITS = ("ema", "set")
XI_UPDATES = ("epoch", "step")
OFFSET_RESCALES = ("exact", "code")

# Ranges `clipkit validate` checks (docs/plugins.md, "Declaring ranges"); the factories check them too.
TAU = Annotated[float, POSITIVE]
GAMMA = Annotated[float, Range(gt=0, le=1)]  # γ = 1: u is this batch's g alone (no averaging)


@dataclass(frozen=True)
class WholeEpochs:
    """The constraint on ``freeze_epochs`` that ``clipkit validate`` checks: a whole number ≥ 0 (5 or
    5.0). The factory truncates it to an int, so 2.5 would read as 2; it refuses it, but only once
    the data is sharded (the loss needs the dataset's size)."""

    def problem(self, value: Any) -> str | None:
        problem = NON_NEGATIVE.problem(value)
        if problem is None and isinstance(value, float) and not value.is_integer():
            return f"must be a whole number of epochs >= 0, got {value!r}"
        return problem


@dataclass(frozen=True)
class DirectionStep:
    """One direction's quantities for one batch (all detached, dtype of the computation).

    coef:        [B, B] ∂loss/∂Σ_ij: the Ĝ(w) coefficient of ∇Σ_ij (0 on the diagonal).
    log_u:       [B] log u_i after the moving-average update (u_{t+1} of Algorithm 1).
    log_g:       [B] log g_i, the batch estimate (1/(B−1)) Σ_{j≠i} exp((Σ_ij − ζ_j)/τ).
    b:           [B] running maximum b_i = max(b_i, max_j Σ_ij) after this batch (the code's offset).
    zeta_target: [B] z*_j = n·Ĝ(ζ_j) for the batch's candidates, or None (SogCLR: ζ ≡ 0).
    objective:   0-d minibatch estimate of the eq. 7 objective (see ``objective_estimate``).
    """

    coef: Tensor
    log_u: Tensor
    log_g: Tensor
    b: Tensor
    zeta_target: Tensor | None
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
    b: Tensor | None = None,
    code_rescale: bool = False,
) -> DirectionStep:
    """Algorithm 1 steps 4–6 and 8 for one direction (no state is written here).

    logits: [B, B] e(o_i, a_j)/τ, row i = anchor i, its positive on the diagonal (detached inside).
    log_u:  [B] log u_i of the anchors before the update.
    zeta:   [B] ζ of the batch's pairs (candidate j's ζ_j; anchor i's own ζ_i), or None for ζ ≡ 0.
    xi:     0-d ξ (positive down-weighting), or None for no positive term (SogCLR).
    b:      [B] the anchors' running maxima of Σ_ij before the batch (zeros if None).
    code_rescale: reproduce the official code's rescaling of its stored s by exp(b_old − b_new)
            where exp((b_old − b_new)/τ) is exact: u_old is multiplied by exp(δ(1/τ − 1)),
            δ = b_new − b_old ≥ 0, before averaging (METHODS §11, "a quirk, not the paper").

    With a_ij = (Σ_ij − ζ_j)/τ = L_ij − L_ii − ζ_j/τ and ν = n − 1:
      g_i          = (1/(B−1)) Σ_{j≠i} exp(a_ij),  u_i ← (1−γ)u_i + γ g_i
      coef_ij      = (1/B)(1/(B−1)) exp(a_ij) / (u_i + exp(−ξ/τ)/ν)          (j ≠ i)
      z*_j = n Ĝ(ζ_j) = 1 − (n/ν)(1/B) Σ_{i∈B} exp(a_ij) / (u_i + exp(−ζ_i/τ)/ν)
    where the ζ sum includes i = j (Σ_jj = 0, so a_jj = −ζ_j/τ). Every ratio is formed as
    exp(log numerator − log denominator) with the denominators from logaddexp, so the large
    exponents cancel before exponentiation; the ratios are bounded (≤ (B−1)/γ and ≤ ν).
    """
    size = logits.shape[0]
    eye = torch.eye(size, dtype=torch.bool, device=logits.device)
    with torch.no_grad():
        margins = logits - logits.diagonal().unsqueeze(1)  # Σ_ij/τ, exactly 0 on the diagonal
        b_old = torch.zeros_like(log_u) if b is None else b
        b_new = torch.maximum(b_old, (tau * margins).max(dim=1).values)  # includes Σ_ii = 0
        exponents = margins if zeta is None else margins - (zeta / tau).unsqueeze(0)
        log_g = off_diagonal_log_mean_exp(exponents)
        log_u_new = updated_log_u(log_u, log_g, b_old, b_new, tau=tau, gamma=gamma, set_first=set_first,
                                  code_rescale=code_rescale)  # fmt: skip
        log_den, log_den_zeta = log_denominators(log_u_new, xi, zeta, tau=tau, num_samples=num_samples)
        coef = (exponents - log_den.unsqueeze(1)).exp().masked_fill(eye, 0.0) / (size * (size - 1))

        zeta_target = None
        if zeta is not None:
            log_sum = torch.logsumexp(exponents - log_den_zeta.unsqueeze(1), dim=0)  # over anchors i
            zeta_target = zeta_target_from(log_sum, num_samples=num_samples, size=size)
        objective = objective_estimate(log_g, zeta, tau=tau, num_samples=num_samples)
    return DirectionStep(coef, log_u_new, log_g, b_new, zeta_target, objective)


def updated_log_u(
    log_u, log_g, b_old, b_new, *, tau: float, gamma: float, set_first, code_rescale: bool
) -> Tensor:
    """[B] log u after the moving average (with the code's rescaling of u_old when ``code_rescale``)."""
    if code_rescale:
        shift = b_new - b_old
        log_u = log_u + (shift / tau - shift)
    return moving_average_log(log_u, log_g, gamma, set_first)


def log_denominators(log_u_new, xi, zeta, *, tau: float, num_samples: int) -> tuple[Tensor, Tensor | None]:
    """[B] log(u_i + exp(−ξ/τ)/ν) (log u_i for SogCLR) and, with ζ, [B] log(u_i + exp(−ζ_i/τ)/ν)."""
    log_nu = math.log(num_samples - 1)
    log_den = log_u_new if xi is None else torch.logaddexp(log_u_new, -xi / tau - log_nu)
    log_den_zeta = None if zeta is None else torch.logaddexp(log_u_new, -zeta / tau - log_nu)
    return log_den, log_den_zeta


def zeta_target_from(log_sum: Tensor, *, num_samples: int, size: int) -> Tensor:
    """z*_j = 1 − (n/ν)(1/B)·exp(log_sum_j), log_sum_j the lse over anchors of the ζ ratios."""
    return 1.0 - (log_sum + math.log(num_samples) - math.log(num_samples - 1) - math.log(size)).exp()


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


def batch_epoch(epoch: float) -> int:
    """The 0-based epoch a batch belongs to, from the host's fractional ``ctx.epoch``.

    The host passes epochs done *including* this batch (stream.epoch + batches·B/n, the batch
    counted), so an epoch's batches have ctx.epoch in (e, e + 1] and the batch epoch is
    ⌈ctx.epoch⌉ − 1 (the official code's integer loop variable). 0 for ctx.epoch ≤ 0.
    """
    return max(math.ceil(epoch) - 1, 0)


def cosine_stepdown(epoch: int, start: int, epochs: int) -> float:
    """Factor of the ζ step size in epoch ``epoch`` (0-based; official NUCLR code, METHODS §11).

    0 before ``start``; then ½(1 + cos(π (epoch − start)/(epochs − 1 − start))), held at 0 past the
    last epoch, divided by 10 from epoch ⌊epochs/2⌋ and by 100 from ⌊3·epochs/4⌋. 0 throughout
    when epochs ≤ start + 1 (too short a run; the constructor warns).
    """
    if epoch < start or epochs - 1 - start <= 0:  # the code would divide by 0 at epochs − 1 = start
        return 0.0
    progress = min((epoch - start) / (epochs - 1 - start), 1.0)
    factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    if epoch >= int(epochs * 3 / 4):
        return factor / 100.0
    if epoch >= int(epochs / 2):
        return factor / 10.0
    return factor


class CompositionalContrastive(nn.Module):
    """The shared NUCLR/SogCLR machinery (METHODS §6; Appendix G Algorithm 1 of seed 004; §11).

    Per call and per direction d (0 = i2t, 1 = t2i), for the batch's global indices idx and the
    batch epoch e (:func:`batch_epoch`):
      0. (NUCLR, ``xi_update="epoch"``) on the first batch of a new epoch, ξ_d ← max(ξ0, max ζ_d)
         (the official code refreshes ξ at each epoch's end);
      1. b_idx ← max(b_idx, max_j Σ_ij); u_idx ← (1−γ) u_idx + γ g (u set to g on a first visit
         when ``first_visit="set"``; u_old rescaled as the code does when
         ``offset_rescale="code"``);
      2. the surrogate Σ_i Σ_{j≠i} coef_ij·Σ_ij (coef detached, Σ_ij = τ (L_ij − L_ii)) has
         ∂/∂Σ_ij = coef_ij, so autograd gives Ĝ(w) = Σ_ij coef_ij ∇Σ_ij exactly; with respect to
         the logits ∂/∂L_ij = τ coef_ij (j ≠ i) and ∂/∂L_ii = −τ Σ_{j≠i} coef_ij;
      3. (NUCLR, once e ≥ ``freeze_epochs``) z_idx ← (1−θ) z_idx + θ z* (z := z* on a sample's
         first update), ζ_idx ← ζ_idx − η_{d,e} z_idx with z* = n·Ĝ(ζ) (module docstring);
      4. (NUCLR, ``xi_update="step"``) ξ_d ← max(ξ0, max ζ_d).
    Steps 2–3 use the updated u and the ζ, ξ from before this call. Every call advances the
    state, so call it once per optimiser step (no gradient accumulation, §11).

    The returned ``loss`` has the *value* of the eq. 7 objective estimate (summed over both
    directions, see :func:`objective_estimate`, plus mean ζ) and the *gradient* of the
    surrogate: loss = objective.detach() + surrogate − surrogate.detach(). The objective is what
    a user wants to watch (METHODS §6); the official code logs the surrogate, here the metric
    ``surrogate`` (§11).

    State (buffers, saved in checkpoints; [2, n] rows are directions): ``log_u`` (log u; −inf =
    0, the initial value), ``visited`` bool, ``b`` (running max of Σ, starts at 0); NUCLR also
    ``zeta``, ``z``, ``z_visited`` bool, ``xi`` [2] and ``xi_epoch`` (the epoch ξ was last
    refreshed for). u is kept in log-space because u ≈ exp((Σ − ζ)/τ) overflows fp32 at τ = 0.01
    as soon as Σ − ζ > 0.88; the code's stored s is (B−1)·u·exp(−b/τ).
    """

    requires: frozenset[str] = frozenset({"index", "epoch", "step"})
    stateful = True  # every call updates the per-sample state: no accumulation, no skipped steps
    # Its two sweeps use Separable offsets and SoftmaxWeightedLogits: fused kernels on CUDA.
    fused_reductions = True

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
        zeta_momentum: float = 1.0,
        zeta_lr_image_scale: float = 1.0,
        freeze_epochs: float = 0,
        epochs: int | None = None,
        zeta_lr_schedule: str = "constant",
        first_visit: str = "ema",
        xi_update: str = "step",
        offset_rescale: str = "exact",
    ) -> None:
        super().__init__()
        _validate(num_samples, tau, gamma, zeta_init, xi_init, zeta_lr, zeta_lr_image_scale, freeze_epochs)
        _validate_options(zeta_momentum, zeta_lr_schedule, first_visit, xi_update, offset_rescale)
        self.num_samples, self.tau, self.gamma = int(num_samples), float(tau), float(gamma)
        self.learn_popularity = learn_popularity
        self.xi_init = float(xi_init)
        self.zeta_lr, self.zeta_momentum = float(zeta_lr), float(zeta_momentum)
        self.zeta_lr_image_scale = float(zeta_lr_image_scale)
        self.freeze_epochs, self.epochs = int(freeze_epochs), epochs
        self.zeta_lr_schedule, self.first_visit = zeta_lr_schedule, first_visit
        self.xi_update, self.offset_rescale = xi_update, offset_rescale
        if learn_popularity and zeta_lr_schedule == "cosine_stepdown":
            _validate_epochs(epochs, self.freeze_epochs)
        self.register_buffer("log_u", torch.full((2, num_samples), -math.inf))
        self.register_buffer("visited", torch.zeros(2, num_samples, dtype=torch.bool))
        self.register_buffer("b", torch.zeros(2, num_samples))
        if learn_popularity:
            self.register_buffer("zeta", torch.full((2, num_samples), float(zeta_init)))
            self.register_buffer("z", torch.zeros(2, num_samples))
            self.register_buffer("z_visited", torch.zeros(2, num_samples, dtype=torch.bool))
            self.register_buffer("xi", torch.full((2,), max(float(xi_init), float(zeta_init))))
            self.register_buffer("xi_epoch", torch.zeros((), dtype=torch.long))

    def similarity_refusal(self, similarity: nn.Module) -> str | None:
        """Why ``similarity``'s logits are not e/τ for this loss's τ (a fixed ``dot`` scale 1/τ, module
        docstring), or None: with another scale, or a learnt one, Σ = τ·L is another objective."""
        from clipkit.plugins.similarities.temperature import scale_refusal

        return scale_refusal(similarity, 1.0 / self.tau, f"loss.tau={self.tau:g}", fixed=True)

    @property
    def u(self) -> Tensor:
        """[2, n] u = exp(log u) in float64 (for inspection; the state is ``log_u``)."""
        return self.log_u.double().exp()

    def zeta_lr_at(self, epoch: int) -> float:
        """The base ζ step size η in (0-based) ``epoch``, before the image-side scale; 0 while frozen."""
        if epoch < self.freeze_epochs:
            return 0.0
        if self.zeta_lr_schedule == "constant":
            return self.zeta_lr
        return self.zeta_lr * cosine_stepdown(epoch, self.freeze_epochs, self.epochs)

    def forward(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput:
        index = ctx.index
        _validate_batch(logits, targets, index, self.num_samples)
        work = torch.promote_types(logits.i2t.dtype, self.log_u.dtype)
        epoch = batch_epoch(float(ctx.epoch))
        if self.learn_popularity and self.xi_update == "epoch":
            self._refresh_xi(epoch)
        update_zeta = self.learn_popularity and epoch >= self.freeze_epochs
        base_lr = self.zeta_lr_at(epoch) if self.learn_popularity else 0.0
        surrogate = logits.i2t.new_zeros(())
        objective = torch.zeros((), dtype=work, device=logits.i2t.device)
        metrics: dict[str, Tensor | float] = {}
        for d, (name, rows) in enumerate(zip(DIRECTIONS, (logits.i2t, logits.t2i), strict=True)):
            step = self._step(d, rows.detach().to(work), index)
            margins = self.tau * (rows - rows.diagonal().unsqueeze(1))  # Σ_ij, with gradient
            surrogate = surrogate + (step.coef.to(rows.dtype) * margins).sum()
            objective = objective + self._commit_direction(d, name, index, step, work, metrics,
                                                           base_lr if update_zeta else None)  # fmt: skip
        return self._output(objective, surrogate, metrics, base_lr)

    def tiled_loss(self, logits: TiledLogits, ctx: LossContext) -> LossOutput:
        """The same step from two sweeps of row/column reductions (``train.tiled``;
        :mod:`clipkit.plugins.losses.nuclr_tiled`): state, value and gradient as :meth:`forward`."""
        from clipkit.plugins.losses import nuclr_tiled

        index = ctx.index
        _validate_tiled_batch(logits, index, self.num_samples)
        epoch = batch_epoch(float(ctx.epoch))
        if self.learn_popularity and self.xi_update == "epoch":
            self._refresh_xi(epoch)
        update_zeta = self.learn_popularity and epoch >= self.freeze_epochs
        base_lr = self.zeta_lr_at(epoch) if self.learn_popularity else 0.0
        positive = logits.positives("i2t")  # [B] L_ii: both directions' positives (the diagonal)
        work, size = torch.promote_types(positive.dtype, self.log_u.dtype), positive.shape[0]
        zetas = {name: self.zeta[d, index].to(work) if self.learn_popularity else None
                 for d, name in enumerate(DIRECTIONS)}  # fmt: skip
        first = nuclr_tiled.first_sweep(self, logits, zetas)
        anchors, rows = {}, {}
        for d, name in enumerate(DIRECTIONS):
            anchors[name] = self._tiled_rows(d, index, positive.detach().to(work), *first[name])
            xi = self.xi[d].to(work) if self.learn_popularity else None
            rows[name] = log_denominators(anchors[name][1], xi, zetas[name], tau=self.tau,
                                          num_samples=self.num_samples)  # fmt: skip
        second = nuclr_tiled.second_sweep(self, logits, positive, zetas, rows)
        surrogate = positive.new_zeros(())
        objective = torch.zeros((), dtype=work, device=positive.device)
        metrics: dict[str, Tensor | float] = {}
        for d, name in enumerate(DIRECTIONS):
            row_sums, log_sum = second[name]
            log_g, log_u_new, b_new = anchors[name]
            coef_sums = nuclr_tiled.row_coefficient_sums(log_g, rows[name][0], size).to(positive.dtype)
            surrogate = surrogate + row_sums.sum() - self.tau * (positive * coef_sums).sum()
            zeta_target = None
            if log_sum is not None:
                zeta_target = zeta_target_from(log_sum.to(work), num_samples=self.num_samples, size=size)
            step_objective = objective_estimate(
                log_g, zetas[name], tau=self.tau, num_samples=self.num_samples
            )
            step = DirectionStep(None, log_u_new, log_g, b_new, zeta_target, step_objective)
            objective = objective + self._commit_direction(d, name, index, step, work, metrics,
                                                           base_lr if update_zeta else None)  # fmt: skip
        return self._output(objective, surrogate, metrics, base_lr)

    def _commit_direction(self, d, name, index, step, work, metrics, zeta_lr) -> Tensor:
        """Write direction ``d``'s new state (ζ only when ``zeta_lr`` is not None), log its metrics,
        and return its objective (with mean ζ when ζ is learned), for :meth:`forward` and
        :meth:`tiled_loss` alike."""
        direction_objective = step.objective
        if self.learn_popularity:
            direction_objective = direction_objective + self.zeta[d].to(work).mean()
        self._write_state(d, index, step, zeta_lr)
        metrics.update(self._metrics(d, name, index, direction_objective))
        return direction_objective

    def _output(self, objective, surrogate, metrics, base_lr) -> LossOutput:
        """The loss: the objective's value with the surrogate's gradient (see the module docs)."""
        metrics["objective"] = objective
        metrics["surrogate"] = surrogate.detach()
        if self.learn_popularity:
            metrics["zeta_lr"] = base_lr
        loss = objective.to(surrogate.dtype) + surrogate - surrogate.detach()
        return LossOutput(loss, metrics)

    def _tiled_rows(self, d: int, index: Tensor, positive: Tensor, negative_lse: Tensor, row_max: Tensor):
        """(log g, log u_new, b_new) [B] of direction d from the first sweep (detached)."""
        work = positive.dtype
        size = positive.shape[0]
        log_g = negative_lse.to(work) - positive - math.log(size - 1)
        b_old = self.b[d, index].to(work)
        b_new = torch.maximum(b_old, self.tau * (row_max.to(work) - positive))
        set_first = ~self.visited[d, index] if self.first_visit == "set" else None
        log_u_new = updated_log_u(self.log_u[d, index].to(work), log_g, b_old, b_new, tau=self.tau,
                                  gamma=self.gamma, set_first=set_first,
                                  code_rescale=self.offset_rescale == "code")  # fmt: skip
        return log_g, log_u_new, b_new

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
            b=self.b[d, index].to(rows.dtype),
            code_rescale=self.offset_rescale == "code",
        )

    @torch.no_grad()
    def _refresh_xi(self, epoch: int) -> None:
        """ξ_d ← max(ξ0, max ζ_d) once per new epoch (the official code does it at each epoch's end,
        i.e. before the next epoch's first batch; ``xi_epoch`` makes it survive a resume)."""
        if epoch > int(self.xi_epoch):
            self.xi.copy_(self.zeta.max(dim=1).values.clamp_min(self.xi_init))
            self.xi_epoch.fill_(epoch)

    @torch.no_grad()
    def _write_state(self, d: int, index: Tensor, step: DirectionStep, base_lr: float | None) -> None:
        """Write u, b (always) and z, ζ, ξ (NUCLR) of direction d, on the batch's coordinates.

        base_lr: η of this epoch, or None while ζ is frozen (z is not updated either).
        """
        self.log_u[d, index] = step.log_u.to(self.log_u.dtype)
        self.visited[d, index] = True
        self.b[d, index] = step.b.to(self.b.dtype)
        if not self.learn_popularity:
            return
        if base_lr is not None:
            first = ~self.z_visited[d, index]
            target = step.zeta_target
            old = self.z[d, index].to(target.dtype)
            z = torch.where(first, target, (1.0 - self.zeta_momentum) * old + self.zeta_momentum * target)
            self.z[d, index] = z.to(self.z.dtype)
            self.z_visited[d, index] = True
            lr = base_lr * (self.zeta_lr_image_scale if d == 1 else 1.0)  # d = 1: ζ of the images
            zeta = self.zeta[d, index].to(target.dtype) - lr * self.z[d, index].to(target.dtype)
            self.zeta[d, index] = zeta.to(self.zeta.dtype)
        if self.xi_update == "step":
            self.xi[d] = self.zeta[d].max().clamp_min(self.xi_init)

    def _metrics(self, d: int, name: str, index: Tensor, objective: Tensor) -> dict[str, Tensor]:
        out = {
            f"objective_{name}": objective.detach(),
            f"u_mean_{name}": self.log_u[d, index].double().exp().mean(),
        }
        if self.learn_popularity:
            out[f"zeta_mean_{name}"] = self.zeta[d].mean()
            out[f"zeta_std_{name}"] = self.zeta[d].double().std(correction=0)  # the spread over all n
            out[f"xi_{name}"] = self.xi[d].clone()
        return out


class NUCLRLoss(CompositionalContrastive):
    """NUCLR (METHODS §6; seed 004 §2.3, Appendix G Algorithm 1, Appendix H; §11 code notes).

    The defaults are the authors' CC3M run (``DGCL_Loss`` and ``run_nuclr_cc3m_dist.slurm``).

    num_samples:         n, the dataset size (passed by the host from the shard manifest).
    tau:                 τ; the similarity must be ``dot`` with fixed scale 1/τ (module docstring).
    gamma:               γ of the moving average u (0.8).
    zeta_init:           ζ0 (−0.05 on CC3M and in the official code, 0 on CC12M).
    xi_init:             ξ0, must exceed ζ0 (Algorithm 1; official code 0). A recipe with ζ0 = 0
                         must raise ξ0.
    zeta_lr:             η (code 5e-6), the step on z ≈ n·Ĝ(ζ): ζ ← ζ − η z (module docstring).
    zeta_momentum:       θ of z ← (1−θ) z + θ n·Ĝ(ζ) (code 0.9; z := n·Ĝ(ζ) on a sample's first
                         update). The paper's ζ ← ζ − η' Ĝ(ζ) is θ = 1, η = η'/n.
    zeta_lr_image_scale: factor on η for ζ of the *images* (direction 1, text anchors; the code's
                         ``eta_I_ratio`` = 0.1).
    freeze_epochs:       integer; ζ and z are updated only from epoch ``freeze_epochs`` on (code
                         ``start_epochs`` = 5), epochs counted by :func:`batch_epoch`.
    epochs:              E for the schedule (the code's ``max_epoch``). None: derived from the
                         host as round(total_steps · batch_size / n).
    total_steps, batch_size: host arguments (train.steps, data.batch_size, the global batch).
    zeta_lr_schedule:    "cosine_stepdown" (code: :func:`cosine_stepdown` over epochs from
                         ``freeze_epochs``) or "constant" (the paper).
    first_visit:         "set" (code: u_i ← g_i on a sample's first visit) or "ema" (paper: u
                         starts at 0 and is averaged).
    xi_update:           "epoch" (code: ξ refreshed once per epoch) or "step" (Algorithm 1).
    offset_rescale:      "exact" (u is the moving average of g) or "code" (reproduces the
                         official rescaling of the stored u, which omits a 1/τ; METHODS §11).

    Metrics: ``objective`` (eq. 7 estimate, both directions; also the loss's value),
    ``surrogate`` (the official code's logged loss), ``objective_{d}``, ``zeta_mean_{d}`` and
    ``zeta_std_{d}`` (mean and spread over all n), ``xi_{d}``, ``u_mean_{d}`` (over the batch,
    after the update), ``zeta_lr`` (the base η of this epoch, 0 while frozen).

    Hand-derived case (tested): B = 3, n = 5, τ = 0.5, ζ0 = −0.1, row 0 of Σ = (0, −0.8, −0.6):
    g_0 = ½(e^{2(−0.8+0.1)} + e^{2(−0.6+0.1)}) = ½(e^{−1.4} + e^{−1}) ≈ 0.30722.
    """

    def __init__(
        self,
        num_samples: int,
        tau: TAU = 0.01,
        gamma: GAMMA = 0.8,
        zeta_init: float = -0.05,
        xi_init: float = 0.0,
        zeta_lr: Annotated[float, NON_NEGATIVE] = 5e-6,
        zeta_momentum: Annotated[float, Range(gt=0, le=1)] = 0.9,
        zeta_lr_image_scale: Annotated[float, NON_NEGATIVE] = 0.1,
        freeze_epochs: Annotated[float, WholeEpochs()] = 5,
        epochs: Annotated[int | None, Range(ge=1)] = None,
        total_steps: int | None = None,
        batch_size: int | None = None,
        zeta_lr_schedule: Annotated[str, OneOf(ZETA_LR_SCHEDULES)] = "cosine_stepdown",
        first_visit: Annotated[str, OneOf(FIRST_VISITS)] = "set",
        xi_update: Annotated[str, OneOf(XI_UPDATES)] = "epoch",
        offset_rescale: Annotated[str, OneOf(OFFSET_RESCALES)] = "exact",
    ) -> None:
        if epochs is not None and not epochs >= 1:  # E = 0 or less: no epoch for the ζ schedule to run
            raise ValueError(f"epochs must be >= 1 (or null: derived from train.steps), got {epochs}")
        if not xi_init > zeta_init:
            raise ValueError(f"xi_init (ξ0) must exceed zeta_init (ζ0), got ξ0={xi_init}, ζ0={zeta_init}")
        if epochs is None and zeta_lr_schedule == "cosine_stepdown":
            epochs = derived_epochs(total_steps, batch_size, num_samples)
        super().__init__(
            num_samples,
            tau,
            gamma,
            learn_popularity=True,
            zeta_init=zeta_init,
            xi_init=xi_init,
            zeta_lr=zeta_lr,
            zeta_momentum=zeta_momentum,
            zeta_lr_image_scale=zeta_lr_image_scale,
            freeze_epochs=freeze_epochs,
            epochs=epochs,
            zeta_lr_schedule=zeta_lr_schedule,
            first_visit=first_visit,
            xi_update=xi_update,
            offset_rescale=offset_rescale,
        )


class SogCLRLoss(CompositionalContrastive):
    """SogCLR (METHODS §6 baseline; Yuan et al. 2022): NUCLR with ζ ≡ 0 and no ξ term.

    Model weights exp(Σ_ij/τ)/u_i, u the γ-moving average of g_i = (1/(B−1)) Σ_{j≠i} exp(Σ_ij/τ).
    No ζ/ξ state is stored. Defaults are LibAUC's code (§11): γ = 0.9, τ = 0.01.

    Metrics: ``objective`` = eq. 7 at ζ ≡ 0, i.e. τ × the global (all-n-candidates) InfoNCE
    estimate mean_i τ log(1 + (n−1) g_i), summed over directions (also the loss's value);
    ``surrogate``; ``objective_{d}`` and ``u_mean_{d}`` per direction.
    """

    def __init__(self, num_samples: int, tau: TAU = 0.01, gamma: GAMMA = 0.9) -> None:
        super().__init__(num_samples, tau, gamma, learn_popularity=False)


def derived_epochs(total_steps: int | None, batch_size: int | None, num_samples: int) -> int:
    """E = round(total_steps · batch_size / n), the run's length in epochs (CC3M recipe: 30)."""
    if total_steps is None or batch_size is None:
        raise ValueError(
            "zeta_lr_schedule='cosine_stepdown' needs the number of epochs: pass epochs, or "
            "total_steps and batch_size (the training host passes both)"
        )
    return max(round(total_steps * batch_size / num_samples), 1)


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
    if not (freeze_epochs >= 0 and float(freeze_epochs).is_integer()):
        raise ValueError(f"freeze_epochs must be a whole number of epochs ≥ 0, got {freeze_epochs}")


def _validate_options(
    zeta_momentum: float, zeta_lr_schedule: str, first_visit: str, xi_update: str, offset_rescale: str
) -> None:
    if not 0 < zeta_momentum <= 1:
        raise ValueError(f"zeta_momentum (θ) must be in (0, 1], got {zeta_momentum}")
    for name, value, allowed in (
        ("zeta_lr_schedule", zeta_lr_schedule, ZETA_LR_SCHEDULES),
        ("first_visit", first_visit, FIRST_VISITS),
        ("xi_update", xi_update, XI_UPDATES),
        ("offset_rescale", offset_rescale, OFFSET_RESCALES),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _validate_epochs(epochs: int | None, freeze_epochs: int) -> None:
    if epochs is None or int(epochs) != epochs:
        raise ValueError(f"zeta_lr_schedule='cosine_stepdown' needs an integer epochs, got {epochs!r}")
    if epochs - 1 - freeze_epochs < 1:  # a smoke run, say; not an error, but never silent
        warnings.warn(
            f"nuclr: ζ will not move in this run: zeta_lr_schedule='cosine_stepdown' decays over epochs "
            f"freeze_epochs..epochs−1 and needs epochs ≥ freeze_epochs + 2, got epochs={epochs}, "
            f"freeze_epochs={freeze_epochs} (set loss.epochs, lower loss.freeze_epochs, or use "
            "loss.zeta_lr_schedule=constant)",
            stacklevel=4,
        )


def _validate_tiled_batch(logits: TiledLogits, index: Tensor, num_samples: int) -> None:
    """The tiled counterpart of :func:`_validate_batch` (the global batch, positives on the diagonal)."""
    size = logits.num_rows("i2t")
    if not logits.shared or logits.num_candidates("i2t") != size:
        raise ValueError("nuclr/sogclr need the full global batch (no train.distributed.local_loss)")
    if size < 2:
        raise ValueError(f"the batch needs at least 2 pairs (negatives), got {size}")
    _validate_index(index, size, num_samples)


def _validate_batch(logits: Logits, targets: Tensor, index: Tensor, num_samples: int) -> None:
    size = logits.i2t.shape[0]
    if logits.i2t.shape != (size, size) or logits.t2i.shape != (size, size):
        raise ValueError(
            "nuclr/sogclr need the full global batch: square logits, got "
            f"i2t {tuple(logits.i2t.shape)} and t2i {tuple(logits.t2i.shape)}"
        )
    if size < 2:
        raise ValueError(f"the batch needs at least 2 pairs (negatives), got {size}")
    if not torch.equal(targets, torch.arange(size, device=targets.device)):
        raise ValueError("nuclr/sogclr need the positives on the diagonal (targets = arange(N))")
    _validate_index(index, size, num_samples)


def _validate_index(index: Tensor, size: int, num_samples: int) -> None:
    if index.shape != (size,):
        raise ValueError(f"ctx.index must be [N] = ({size},), got {tuple(index.shape)}")
    if int(index.min()) < 0 or int(index.max()) >= num_samples:
        raise ValueError(
            f"ctx.index must lie in [0, {num_samples}), got [{int(index.min())}, {int(index.max())}]"
        )
    if torch.unique(index).numel() != size:
        raise ValueError("ctx.index holds a sample twice in one batch; its state update would be ambiguous")
