"""The K-mixture model of seed 003 §4.2: can a similarity express the PMI as the classes grow?

Seed 003 (KME-CLIP), Assumption 5 (K-mixture model): K classes z; for each class k one datapoint
that represents it purely, p(z|x_k) = δ_zk, and for each pair i < j one datapoint that is a
half-and-half mixture, p(z|x_ij) = ½(δ_zi + δ_zj); the same on the y side, x ⟂ y | z. Theorem 6:
CLIP's similarity s = t·u·v cannot stay within ε of PMI + C on this data unless its dimension grows
with K (a packing argument: K disjoint balls in a bounded region of R^d). Theorem 7: KME-CLIP's
log Σ w_i w'_j k(u_i, v_j) can, in any dimension, with two points per datapoint (the classes in
its support, weighted by p(z|x)), the error vanishing as the kernel bandwidth γ grows.

The source's formulas were lost in extraction, so these choices are clipkit's (and reported):

- p(x) uniform over the N = K + K(K−1)/2 datapoints (same for y). Then the class prior is uniform,
  π_z = 1/K, and exp PMI(x, y) = Σ_z p(z|x) p(z|y)/π_z takes four values: log K (same pure class),
  log K/2 (pure k with a mixture holding k, or the same mixture), log K/4 (mixtures sharing one
  class) and −∞ (no shared class).
- The error "as the theorems measure it": the sup over the pairs where PMI is finite (the support
  of p(x, y); no finite similarity is within ε of −∞) of |s(x, y) − PMI(x, y) − C|, with the best
  constant C (the theorems allow one): half the range of s − PMI over the support. Also reported:
  the p(x, y)-weighted RMS with its best C, and how often an off-support pair outscores the
  weakest support pair of its row (where −∞ is not respected).
- Equal embedding budget: each datapoint gets ``budget`` learned floats on each side. CLIP (dot):
  one unit vector of that dimension. WPSE and KME: M points of dimension d and M softplus
  weights, M·d + M = budget (default budget 8: CLIP d = 8; WPSE/KME M = 2, d = 3).
- Encoders are free lookup tables (one embedding per datapoint): the theorems are about what a
  similarity can express, not what an encoder network generalises to.
- Trained with symmetric InfoNCE (registry ``infonce``) on batches from the joint, Adam; the
  scale / bandwidth clamps are lifted (the theorems take γ → ∞ and allow any CLIP scale), KME's γ
  starts at 50 (Theorem 7 needs a large γ; from the recipe's 1/0.07 it grows too slowly for a
  short run), WPSE draws 256 random features (CPU budget; the recipes use 512).
- Assumption 4 (low modality gap), an assumption of Theorem 6 on the model, is not imposed:
  CLIP here is freer than the theorem's CLIP, so growth of its error is the practical question,
  not a consequence of the theorem.

Entry point: :func:`run_mixture_study` (CLI: ``clipkit experiment kme-mixture``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from clipkit.contract.types import LossContext, PointSet

#: The similarities compared, as registry configs (clamps lifted; see the module docstring).
MIXTURE_SIMILARITIES: tuple[dict[str, Any], ...] = (
    {"name": "dot", "label": "dot (CLIP)", "max_scale": None},
    {"name": "wpse", "label": "wpse gaussian", "kernel": "gaussian", "num_features": 256, "max_scale": None},
    {"name": "kme", "label": "kme", "init_gamma": 50.0, "max_gamma": None},
)


class KMixture:
    """The K-mixture model: N = K + K(K−1)/2 datapoints per modality, their posteriors p(z|·).

    posterior: [N, K] float64, rows 0..K−1 pure (one-hot), then the pairs i < j (½, ½) in
    lexicographic order. Both modalities share the structure (x_a and y_a carry the same classes).
    """

    def __init__(self, classes: int) -> None:
        if classes < 2:
            raise ValueError(f"the K-mixture model needs K >= 2 classes, got {classes}")
        self.classes = classes
        pairs = [(i, j) for i in range(classes) for j in range(i + 1, classes)]
        posterior = torch.zeros(classes + len(pairs), classes, dtype=torch.float64)
        posterior[torch.arange(classes), torch.arange(classes)] = 1.0
        for row, (i, j) in enumerate(pairs, start=classes):
            posterior[row, i] = posterior[row, j] = 0.5
        self.posterior = posterior

    @property
    def size(self) -> int:
        """N, the datapoints per modality."""
        return self.posterior.shape[0]

    def pmi(self) -> Tensor:
        """[N, N] float64 PMI(x_a, y_b) = log(K Σ_z p(z|x_a) p(z|y_b)), −inf off the support."""
        return torch.log(self.classes * self.posterior @ self.posterior.t())

    def joint(self) -> Tensor:
        """[N, N] float64 p(x_a, y_b) = p(x_a) p(y_b) exp PMI, with p uniform over the N points."""
        return self.classes * self.posterior @ self.posterior.t() / self.size**2

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """n joint pairs -> (a [n], b [n]) long datapoint indices: z ~ π, x ~ p(x|z), y ~ p(y|z)."""
        z = torch.randint(self.classes, (n,), generator=generator)
        given_z = self.posterior.t()[z]  # [n, N]: p(x|z) ∝ p(z|x) under a uniform p(x)
        a = torch.multinomial(given_z, 1, generator=generator).squeeze(1)
        b = torch.multinomial(given_z, 1, generator=generator).squeeze(1)
        return a, b


def approximation_error(similarity: Tensor, task: KMixture) -> dict[str, float]:
    """How far [N, N] learned similarities are from the task's PMI, up to a constant.

    sup_error:   min_C max_support |s − PMI − C| = (max − min of s − PMI over the support)/2 (the
                 theorems' measure).
    rms_error:   sqrt(E_p(x,y) (s − PMI − C)²) with the p-weighted best C (the typical pair).
    off_support: the share of off-support pairs (a, b) scored above the lowest support pair of
                 row a (0 when −∞ is respected in rank).
    """
    s, pmi = similarity.detach().double(), task.pmi()
    support = torch.isfinite(pmi)
    residual = (s - pmi)[support]
    joint = task.joint()[support]
    shift = (joint * residual).sum() / joint.sum()
    weakest = torch.where(support, s, torch.full_like(s, math.inf)).min(dim=1, keepdim=True).values
    above = (s > weakest) & ~support
    return {
        "sup_error": float((residual.max() - residual.min()) / 2),
        "rms_error": float(((joint * (residual - shift).square()).sum() / joint.sum()).sqrt()),
        "off_support": float(above.sum() / (~support).sum().clamp_min(1)),
    }


class PointTable(nn.Module):
    """A free embedding per datapoint: index [B] -> PointSet of M unit points in R^d (+ M
    softplus weights when ``weighted``). ``budget`` = M·d (+ M) learned floats per datapoint."""

    def __init__(self, size: int, points: int, dim: int, *, weighted: bool, generator: torch.Generator):
        super().__init__()
        self.points, self.dim, self.weighted = points, dim, weighted
        self.coordinates = nn.Parameter(torch.randn(size, points * dim, generator=generator))
        self.raw_weights = nn.Parameter(torch.zeros(size, points)) if weighted else None

    def forward(self, index: Tensor) -> PointSet:
        points = nn.functional.normalize(self.coordinates[index].view(-1, self.points, self.dim), dim=-1)
        weights = nn.functional.softplus(self.raw_weights[index]) + 1e-6 if self.weighted else None
        return PointSet(points, weights)


@dataclass
class MixtureTraining:
    """One training run's settings (same for every similarity)."""

    budget: int = 8
    points: int = 2
    steps: int = 1500
    batch_size: int = 256
    lr: float = 0.02


def shape_for(name: str, training: MixtureTraining) -> tuple[int, int, bool]:
    """(points M, dimension d, weighted) so that every similarity spends ``budget`` floats:
    dot: 1 × budget, unweighted; the point-set similarities: M points of d with M·d + M = budget."""
    if name == "dot":
        return 1, training.budget, False
    dim = (training.budget - training.points) // training.points
    if dim < 1 or dim * training.points + training.points != training.budget:
        raise ValueError(
            f"budget {training.budget} is not M·d + M for M = {training.points} points "
            f"(try a budget that is a multiple of {training.points})"
        )
    return training.points, dim, True


def train_similarity(
    spec: dict[str, Any], task: KMixture, training: MixtureTraining, seed: int, registry
) -> tuple[Tensor, dict[str, float]]:
    """Train lookup tables + the registered similarity ``spec`` with InfoNCE on joint batches.

    Returns ([N, N] learned similarity on every pair, with WPSE's features fixed by ``seed``) and
    the similarity's own metrics (scale, γ)."""
    from clipkit.model import build_slot

    config = {k: v for k, v in spec.items() if k != "label"}
    points, dim, weighted = shape_for(config["name"], training)
    generator = torch.Generator().manual_seed(seed)
    towers = nn.ModuleList(
        [PointTable(task.size, points, dim, weighted=weighted, generator=generator) for _ in range(2)]
    )
    similarity = build_slot(registry, "similarity", config, "kme-mixture", embed_dim=dim)
    loss = build_slot(registry, "loss", {"name": "infonce"}, "kme-mixture")
    modules = nn.ModuleList([towers, similarity])
    optimizer = torch.optim.Adam(modules.parameters(), lr=training.lr)
    features = torch.Generator()
    for step in range(training.steps):
        a, b = task.sample(training.batch_size, generator)
        features.manual_seed(seed * 1_000_003 + step)  # WPSE's random features, fresh every step
        logits = similarity(towers[0](a), towers[1](b), generator=features)
        value = loss(logits, torch.arange(len(a)), LossContext()).loss
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
    everything = torch.arange(task.size)
    with torch.no_grad():
        learned = similarity(
            towers[0](everything), towers[1](everything), generator=features.manual_seed(seed)
        )
    metrics = {k: float(v) for k, v in getattr(similarity, "metrics", dict)().items()}
    return learned.i2t, metrics


def run_mixture_study(
    *,
    classes: Sequence[int] = (4, 8, 16, 32),
    seeds: Sequence[int] = (0, 1, 2, 3, 4),
    similarities: Sequence[dict[str, Any]] = MIXTURE_SIMILARITIES,
    training: MixtureTraining | None = None,
    registry=None,
    progress=None,
) -> dict[str, Any]:
    """Every similarity × K × seed: train, measure :func:`approximation_error`; aggregate over seeds.

    Returns {"config", "runs": [per run], "summary": [per similarity × K: mean ± 95 % interval],
    "trend": [per similarity: error(K_max) − error(K_min), paired over seeds], "verdict"}."""
    from clipkit.contract.registry import default_registry
    from clipkit.plugins.experiments.kme_mixture_report import summarise

    training = training or MixtureTraining()
    registry = registry or default_registry()
    if len(seeds) < 1 or len(classes) < 1:
        raise ValueError("kme-mixture needs at least one seed and one K")
    for spec in similarities:
        shape_for(spec["name"], training)  # a budget that does not fit fails before any training
    runs = []
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest and gives the same bits everywhere
    try:
        for k in classes:
            task = KMixture(k)
            for spec in similarities:
                for seed in seeds:
                    started = time.process_time()
                    learned, metrics = train_similarity(spec, task, training, seed, registry)
                    run = {
                        "label": spec["label"],
                        "classes": k,
                        "seed": seed,
                        **approximation_error(learned, task),
                        "similarity_metrics": metrics,
                        "cpu_seconds": time.process_time() - started,
                    }
                    runs.append(run)
                    if progress is not None:
                        progress(run)
    finally:
        torch.set_num_threads(previous)
    config = {
        "classes": list(classes),
        "seeds": list(seeds),
        "similarities": [dict(s) for s in similarities],
        **training.__dict__,
    }
    return {
        "config": config,
        "runs": runs,
        **summarise(runs, [s["label"] for s in similarities], list(classes)),
    }
