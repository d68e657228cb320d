"""CLOOB's Hopfield-retrieval similarity (`hopfield`, METHODS §4): the batch is its own memory.

The retrieval formulas are in :mod:`clipkit.plugins.losses.cloob`, beside InfoLOOB, the loss
the paper pairs it with; this module holds the similarity so every similarity is registered
from :mod:`clipkit.plugins.similarities`.
"""

from __future__ import annotations

import warnings
from typing import Annotated

import torch
from torch import Tensor, nn

from clipkit.config.constraints import POSITIVE
from clipkit.contract.types import Logits, PointSet
from clipkit.plugins.similarities.temperature import bounded_exp, check_start, log_bounds, register_log_value

#: CLIP's bound on a learnable logit scale, applied to a learnable 1/τ.
MAX_LEARNED_INVERSE_TAU = 100.0


def hopfield_retrieval(queries: Tensor, stored: Tensor, beta: float) -> Tensor:
    """H(β, Q, S) re-normalised: queries [Nq, d], stored [Ns, d] -> [Nq, d] unit vectors.

    Row i is Σ_k softmax_k(β S_k·Q_i) S_k / ‖·‖ — one step of the modern Hopfield update with
    the stored patterns as memory (β → 0: the store's mean; β → ∞: the nearest stored pattern).
    """
    attention = torch.softmax(beta * queries @ stored.t(), dim=-1)  # [Nq, Ns], rows sum to 1
    return nn.functional.normalize(attention @ stored, dim=-1)


class HopfieldSimilarity(nn.Module):
    """CLOOB's Hopfield-retrieval logits (METHODS §4); plain scaled cosine in evaluation.

    beta:        Hopfield inverse temperature β > 0 (seed 001: 8 on CC, 14.3 on YFCC; the
                 official code's default is 14.3, §11).
    inverse_tau: 1/τ > 0, the logits' scale (seed 001: 30, fixed; code default 14.3, §11).
    learn_scale: learn log(1/τ) (clamped to ≤ 100 in the forward pass, as CLIP's scale);
                 by default 1/τ is a fixed buffer, since a learnable τ misbehaves with
                 InfoLOOB (seed §5.1). A loss that multiplies by τ (``cloob``) uses its own
                 constant τ, not this learned value.

    Point sets [B, M, d] are pooled by their weighted mean and L2-normalised first (for
    CLIP's M == 1 unit vectors this is the point itself).

    In ``train()`` mode with a paired batch (Na == Nb) the logits are the retrieved ones of
    the module docstring, with i2t [N, N] and t2i [N, N] computed from different stores (t2i
    is not i2t.T). The batch must be the global one: retrieval from a rank's local shard
    would use a different memory, so a "local loss" (rows = local samples) is not CLOOB.
    In ``eval()`` mode, and whenever Na != Nb, the logits are (1/τ)·x̂_a·ŷ_b with t2i = i2t.T;
    a train-mode call with Na != Nb warns, since it silently skips the retrieval.
    """

    # Logits depend on the whole batch (the Hopfield stores): clipkit refuses a local loss with it.
    pairwise = False

    #: train.tiled: each logit depends on the whole batch through the Hopfield retrieval (every
    #: retrieved embedding is a softmax over all stored patterns), so a tile cannot be scored alone.
    tiled_unsupported = "its logits depend on the whole batch (Hopfield retrieval over all stored patterns)"

    def __init__(
        self,
        beta: Annotated[float, POSITIVE] = 8.0,
        inverse_tau: Annotated[float, POSITIVE] = 30.0,
        learn_scale: bool = False,
    ) -> None:
        super().__init__()
        if not beta > 0:
            # β = 0 retrieves the batch mean for every query: all logits equal, the loss constant.
            raise ValueError(f"beta (Hopfield inverse temperature) must be > 0, got {beta}")
        if inverse_tau <= 0:
            raise ValueError(f"inverse_tau (1/τ) must be > 0, got {inverse_tau}")
        self.beta = float(beta)
        self.learn_scale = learn_scale
        # A learned 1/τ is bounded as CLIP's scale (100): a larger start would be clamped unseen.
        check_start(
            "inverse_tau",
            inverse_tau,
            "the bound of a learned inverse_tau",
            self.maximum(),
            "lower inverse_tau, or set learn_scale=false (a fixed 1/τ has no bound)",
        )
        register_log_value(
            self, "log_inverse_tau", inverse_tau, learnable=learn_scale, maximum=self.maximum()
        )

    def scale(self) -> Tensor:
        """0-d tensor 1/τ (at most 100 when learnable: the parameter is clamped after each step)."""
        return bounded_exp(self.log_inverse_tau, self.maximum())

    def maximum(self) -> float | None:
        """The bound on a learned 1/τ (none on a fixed one)."""
        return MAX_LEARNED_INVERSE_TAU if self.learn_scale else None

    def parameter_bounds(self) -> dict[str, tuple[float | None, float | None]]:
        """log 1/τ ≤ log 100 when learnable, applied to the parameter after each optimiser step."""
        return log_bounds(self, "log_inverse_tau", self.maximum())

    def embed(self, x: PointSet, *, generator: torch.Generator | None = None) -> Tensor:
        """[B, M, d] -> [B, d] unit pooled embeddings; eval-mode logits = (1/τ)·embed(a) @ embed(b).T.

        (Training-mode logits depend on the whole batch through the retrieval and do not
        factorise; only evaluation uses ``embed``.)
        """
        return nn.functional.normalize(x.mean(), dim=-1)

    def retrieve(self, a: PointSet, b: PointSet) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(U_x, U_y, V_x, V_y), each [N, d] unit vectors, for the paired batch a (X), b (Y)."""
        x, y = self.embed(a), self.embed(b)
        return (
            hopfield_retrieval(x, x, self.beta),  # U_x: images from the image store
            hopfield_retrieval(y, x, self.beta),  # U_y: texts from the image store
            hopfield_retrieval(x, y, self.beta),  # V_x: images from the text store
            hopfield_retrieval(y, y, self.beta),  # V_y: texts from the text store
        )

    def forward(self, a: PointSet, b: PointSet, *, generator: torch.Generator | None = None) -> Logits:
        """a: [Na, Ma, d], b: [Nb, Mb, d] -> Logits(i2t [Na, Nb], t2i [Nb, Na])."""
        scale = self.scale()
        if self.training and a.batch_size == b.batch_size:
            u_x, u_y, v_x, v_y = self.retrieve(a, b)
            return Logits(i2t=scale * u_x @ u_y.t(), t2i=scale * v_y @ v_x.t())
        if self.training:
            warnings.warn(
                f"hopfield: Na={a.batch_size} != Nb={b.batch_size} in train mode, so there is no paired "
                "batch to retrieve from; using the plain scaled cosine (call .eval() for evaluation)",
                stacklevel=2,
            )
        return Logits.symmetric(scale * self.embed(a) @ self.embed(b).t())

    def ensemble(self, x: PointSet, groups: Tensor) -> PointSet:
        """CLIP's prompt ensembling: mean of the prompts' unit vectors, renormalised.

        x: [B, M, d] prompt point sets, groups: [B] class id in [0, G) -> PointSet [G, 1, d].
        """
        pooled = self.embed(x)
        num_groups = int(groups.max()) + 1
        sums = pooled.new_zeros(num_groups, pooled.shape[1]).index_add_(0, groups, pooled)
        return PointSet(nn.functional.normalize(sums, dim=-1).unsqueeze(1))

    def metrics(self) -> dict[str, float]:
        """Numbers worth logging during training (1/τ, the logits' scale)."""
        return {"logit_scale": float(self.scale().detach())}
