"""Linear-probe evaluation math (METHODS §8): frozen features -> a linear classifier.

Two protocols:

* **L-BFGS** (CLIP, Radford et al. 2021, App. A.3; followed by CLOOB App. A.2.5 and KME-CLIP App. A.2):
  multinomial L2-regularised logistic regression (:func:`fit_logistic_regression`), its
  regularisation strength chosen on a validation split by CLIP's parametric binary search
  (:func:`parametric_binary_search`), then refit on train + validation and scored on test.
* **SGD** (seed 000, §6.3): a linear layer trained by momentum SGD with a cosine schedule and no
  weight decay (:func:`fit_linear_sgd`, :func:`sgd_hyperparameters`).

Plus what the ``linear_probe`` eval task needs around them: a seeded stratified split, optional
feature standardisation and frozen-feature extraction (:func:`image_features`). Everything is
torch only (no scikit-learn / scipy); the tests check the fit against scikit-learn.

Shapes: N samples, D feature width, C classes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clipkit.contract.types import PointSet, Sample
from clipkit.errors import ClipkitError
from clipkit.eval.evaluate import embed_points, encode_images

# ----------------------------------------------------------------------------------------------
# Multinomial L2-regularised logistic regression (the L-BFGS protocol)
# ----------------------------------------------------------------------------------------------


def logistic_objective(features: Tensor, labels: Tensor, weight: Tensor, bias: Tensor, l2: float) -> Tensor:
    """Σ_i CE(W x_i + b, y_i) + (l2 / 2)·‖W‖²_F, the bias unpenalised. Scalar.

    With ``l2 = 1 / C`` this is exactly scikit-learn's ``LogisticRegression(C=C)`` objective for the
    multinomial loss, ``C·Σ_i loss_i + ½‖W‖²`` (scikit-learn minimises it divided by C·N: the same
    minimiser). features [N, D], labels [N] in [0, C), weight [C, D], bias [C].
    """
    logits = features @ weight.t() + bias
    return F.cross_entropy(logits, labels, reduction="sum") + 0.5 * l2 * weight.pow(2).sum()


def fit_logistic_regression(
    features: Tensor,
    labels: Tensor,
    l2: float,
    max_iter: int = 1000,
    *,
    num_classes: int | None = None,
    tolerance: float = 1e-4,
    tolerance_change: float = 64 * torch.finfo(torch.float64).eps,
) -> tuple[Tensor, Tensor]:
    """Minimise :func:`logistic_objective` with L-BFGS -> (weight [C, D], bias [C]), float64.

    ``l2 = 1 / C`` for scikit-learn's ``C``: the minimiser is sklearn's
    ``LogisticRegression(C=1/l2, solver="lbfgs")`` for C >= 3 classes (multinomial). For two
    classes sklearn fits a *binary* model with one vector w; our two multinomial rows then satisfy
    W[1] − W[0] = w for sklearn's ``C = 2 / l2`` (the optimum splits the difference evenly, so
    ``‖W‖² = ‖w‖² / 2``).

    Solved as CLIP's probe (sklearn's L-BFGS with its defaults and ``max_iter=1000``): float64, zero
    start, at most ``max_iter`` iterations, strong-Wolfe line search, 10 correction pairs. Like
    scikit-learn we minimise the objective divided by N, so its stopping rules carry over: stop when
    the largest absolute gradient entry is <= ``tolerance`` (sklearn's ``tol``, default 1e-4) or the
    objective / the step changes by less than ``tolerance_change`` (sklearn passes scipy
    ``ftol = 64·eps``). Tighten both (e.g. 1e-10 and 0) for a fit converged to machine precision.

    The bias is unpenalised, so the objective is invariant to adding one constant to every class's
    bias; we return the representative with Σ_c b_c = 0 (W already sums to 0 over classes at the
    optimum, since ``l2·Σ_c W_c = −Σ_c ∂CE/∂W_c = 0``).
    """
    features, labels, classes = _check_training_data(features, labels, num_classes)
    if not l2 > 0:
        raise ClipkitError(f"l2 must be > 0 (an unregularised fit diverges on separable data), got {l2}")
    if max_iter < 1:
        raise ClipkitError(f"max_iter must be >= 1, got {max_iter}")
    x = features.to(torch.float64)
    weight = torch.zeros(classes, x.shape[1], dtype=torch.float64, device=x.device, requires_grad=True)
    bias = torch.zeros(classes, dtype=torch.float64, device=x.device, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [weight, bias],
        lr=1.0,
        max_iter=max_iter,
        max_eval=20 * max_iter,  # iteration-bound, like scipy (whose maxfun default is 15000)
        tolerance_grad=tolerance,
        tolerance_change=tolerance_change,
        history_size=10,
        line_search_fn="strong_wolfe",
    )
    n = x.shape[0]

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = logistic_objective(x, labels, weight, bias, l2) / n
        loss.backward()
        return loss

    with torch.enable_grad():  # callers (eval tasks) may run under no_grad
        optimizer.step(closure)
    weight, bias = weight.detach(), bias.detach()
    return weight, bias - bias.mean()


def linear_logits(features: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """features [N, D] -> logits [N, C] = x Wᵀ + b (in the classifier's dtype)."""
    return features.to(weight.dtype) @ weight.t() + bias


def accuracy(logits: Tensor, labels: Tensor) -> float:
    """Top-1 accuracy. logits [N, C], labels [N]."""
    return float((logits.argmax(dim=1) == labels.to(logits.device)).double().mean())


# ----------------------------------------------------------------------------------------------
# CLIP's parametric binary search for the regularisation strength
# ----------------------------------------------------------------------------------------------

#: CLIP App. A.3: λ is swept over [1e-6, 1e6] at 8 steps per decade (96 steps), starting from
#: λ ∈ {1e-6, 1e-4, ..., 1e6} (one every 2 decades).
SEARCH_DECADES = (-6, 6)
SEARCH_STEPS_PER_DECADE = 8
SEARCH_START_SPACING = 2  # decades between the starting points


def parametric_binary_search(
    score: Callable[[float], float],
    *,
    decades: tuple[int, int] = SEARCH_DECADES,
    steps_per_decade: int = SEARCH_STEPS_PER_DECADE,
    start_spacing: int = SEARCH_START_SPACING,
) -> tuple[float, list[tuple[float, float]]]:
    """Maximise ``score(λ)`` over λ = 10^(k / steps_per_decade) in 10^decades -> (best λ, evaluated).

    CLIP App. A.3: "we perform a parametric binary search that starts with λ = [10^-6, 10^-4,
    10^-2, 1, 10^2, 10^4, 10^6] and iteratively halves the interval around the peak until it
    reaches a resolution of 8 steps per decade". The paper gives no code; we read it as follows,
    with k an integer grid index:

    1. score λ at every ``start_spacing`` decades (k = −48, −32, ..., 48: 7 fits);
    2. let s = the current spacing in grid steps (16); while s > 1: s ← s // 2 and score the two
       neighbours k* ± s of the best k* so far (skipping those outside the range or already
       scored), then take the best of *all* scored points as the new k*;
    3. stop at s = 1 (1/8 decade): 7 + 4·2 = 15 fits instead of the 97 of the full sweep.

    Ties go to the largest λ (the strongest regularisation), CLOOB App. A.2.5's rule. For a strictly
    unimodal score this finds the grid's peak; otherwise a local peak, like any binary search.
    ``evaluated`` lists (λ, score) for every scored λ, in increasing λ.
    """
    low, high = decades[0] * steps_per_decade, decades[1] * steps_per_decade
    spacing = start_spacing * steps_per_decade
    if low >= high or spacing < 1 or steps_per_decade < 1:
        raise ClipkitError(f"bad search grid: decades={decades}, steps_per_decade={steps_per_decade}")
    scores: dict[int, float] = {}

    def visit(k: int) -> None:
        if low <= k <= high and k not in scores:
            scores[k] = float(score(10.0 ** (k / steps_per_decade)))

    for k in range(low, high + 1, spacing):
        visit(k)
    visit(high)  # the range end, when the spacing does not divide the range

    def peak() -> int:  # the best score; among ties the largest λ
        return max(scores, key=lambda k: (scores[k], k))

    best = peak()
    while spacing > 1:
        spacing //= 2
        visit(best - spacing)
        visit(best + spacing)
        best = peak()
    evaluated = [(10.0 ** (k / steps_per_decade), scores[k]) for k in sorted(scores)]
    return 10.0 ** (best / steps_per_decade), evaluated


def select_l2(
    train: tuple[Tensor, Tensor],
    val: tuple[Tensor, Tensor],
    num_classes: int,
    max_iter: int = 1000,
) -> tuple[float, float, list[tuple[float, float]]]:
    """Choose λ = l2 by :func:`parametric_binary_search` of the validation top-1 accuracy of a
    classifier fitted on ``train`` -> (λ, its validation accuracy, [(λ, accuracy), ...]).
    ``train`` and ``val`` are (features [N, D], labels [N]) pairs."""

    def validation_accuracy(l2: float) -> float:
        weight, bias = fit_logistic_regression(*train, l2, max_iter, num_classes=num_classes)
        return accuracy(linear_logits(val[0], weight, bias), val[1])

    l2, evaluated = parametric_binary_search(validation_accuracy)
    return l2, dict(evaluated)[l2], evaluated


# ----------------------------------------------------------------------------------------------
# Seed 000's SGD protocol
# ----------------------------------------------------------------------------------------------

#: Seed 000 §6.3: datasets with fewer training images than this use (lr 0.05, batch 1024).
SGD_SMALL_DATASET = 10_000
SGD_MOMENTUM = 0.9
SGD_EPOCHS = 90


def sgd_hyperparameters(n_train: int) -> tuple[float, int]:
    """(initial learning rate, batch size) of seed 000 §6.3: (0.05, 1024) for fewer than 10 000
    training images (Stanford Cars, STL-10, Caltech-101), else (0.01, 4096)."""
    return (0.05, 1024) if n_train < SGD_SMALL_DATASET else (0.01, 4096)


def fit_linear_sgd(
    features: Tensor,
    labels: Tensor,
    *,
    num_classes: int | None = None,
    epochs: int = SGD_EPOCHS,
    lr: float | None = None,
    batch_size: int | None = None,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """Seed 000 §6.3: a linear layer trained with momentum-0.9 SGD, a cosine schedule and no weight
    decay for ``epochs`` (90) -> (weight [C, D], bias [C]), float32.

    ``lr`` / ``batch_size`` default to :func:`sgd_hyperparameters` of N. Mean cross-entropy per
    batch; each epoch visits a fresh seeded permutation (last batch may be smaller); the learning
    rate follows lr·½(1 + cos(π t / T)) per step t of T = epochs · ⌈N / batch⌉ (the paper does not
    say per step or per epoch). The layer starts from weight ~ N(0, 0.01²), bias 0 (the usual
    linear-evaluation init, e.g. MoCo v3/MAE; seed 000 does not say). Seeded by ``seed`` alone:
    the global RNG is neither used nor advanced.
    """
    features, labels, classes = _check_training_data(features, labels, num_classes)
    default_lr, default_batch = sgd_hyperparameters(features.shape[0])
    lr = default_lr if lr is None else float(lr)
    batch_size = default_batch if batch_size is None else int(batch_size)
    if epochs < 1 or batch_size < 1 or not lr > 0:
        raise ClipkitError(f"need epochs >= 1, batch_size >= 1 and lr > 0; got {epochs}, {batch_size}, {lr}")
    x = features.float()
    generator = torch.Generator().manual_seed(int(seed))
    weight = (torch.randn(classes, x.shape[1], generator=generator) * 0.01).to(x.device).requires_grad_()
    bias = torch.zeros(classes, device=x.device, requires_grad=True)
    optimizer = torch.optim.SGD([weight, bias], lr=lr, momentum=SGD_MOMENTUM, weight_decay=0.0)
    n = x.shape[0]
    total = epochs * math.ceil(n / batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    with torch.enable_grad():  # callers (eval tasks) may run under no_grad
        for _ in range(epochs):
            order = torch.randperm(n, generator=generator).to(x.device)
            for start in range(0, n, batch_size):
                batch = order[start : start + batch_size]
                loss = F.cross_entropy(linear_logits(x[batch], weight, bias), labels[batch])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
    return weight.detach(), bias.detach()


# ----------------------------------------------------------------------------------------------
# Data handling: split, standardisation
# ----------------------------------------------------------------------------------------------


def stratified_split(labels: Tensor, fraction: float, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Seeded split of indices 0..N−1 -> (fit indices, validation indices), both sorted.

    Each class sends round(fraction · n_c) of its n_c samples (a seeded random choice) to the
    validation side, so both sides keep the class proportions. labels [N].
    """
    if not 0 < fraction < 1:
        raise ClipkitError(f"the validation fraction must be in (0, 1), got {fraction}")
    generator = torch.Generator().manual_seed(int(seed))
    labels = labels.cpu()
    fit, val = [], []
    for value in torch.unique(labels):  # sorted, so the draw order does not depend on the data order
        members = torch.nonzero(labels == value).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        count = int(fraction * len(members) + 0.5)
        val.append(members[:count])
        fit.append(members[count:])
    return torch.cat(fit).sort().values, torch.cat(val).sort().values


@dataclass(frozen=True)
class Standardizer:
    """Per-feature z-scoring with statistics of the fitting set (constant features: std 1).

    mean, std: [D]. ``Standardizer.identity(D)`` leaves features unchanged.
    """

    mean: Tensor
    std: Tensor

    @classmethod
    def fit(cls, features: Tensor) -> Standardizer:
        std = features.std(dim=0, unbiased=False)
        return cls(features.mean(dim=0), torch.where(std > 0, std, torch.ones_like(std)))

    @classmethod
    def identity(cls, features: Tensor) -> Standardizer:
        width = features.shape[1]
        return cls(features.new_zeros(width), features.new_ones(width))

    def __call__(self, features: Tensor) -> Tensor:
        return (features - self.mean) / self.std


def _check_training_data(
    features: Tensor, labels: Tensor, num_classes: int | None
) -> tuple[Tensor, Tensor, int]:
    if features.dim() != 2 or labels.dim() != 1 or features.shape[0] != labels.shape[0]:
        raise ClipkitError(
            f"expected features [N, D] and labels [N], got {tuple(features.shape)} and {tuple(labels.shape)}"
        )
    if features.shape[0] == 0:
        raise ClipkitError("no training samples")
    if not torch.isfinite(features).all():
        raise ClipkitError("the features contain NaN or infinite values")
    labels = labels.to(device=features.device, dtype=torch.long)
    classes = int(labels.max()) + 1 if num_classes is None else int(num_classes)
    smallest, largest = int(labels.min()), int(labels.max())
    if smallest < 0 or largest >= classes:
        raise ClipkitError(f"labels must lie in [0, {classes}), got values in [{smallest}, {largest}]")
    return features, labels, classes


# ----------------------------------------------------------------------------------------------
# Frozen-feature extraction
# ----------------------------------------------------------------------------------------------

#: What ``image_features`` can extract (see its docstring).
FEATURES = ("embedding", "points_mean", "pre_projection")


@torch.no_grad()
def image_features(
    model,
    samples: Sequence[Sample],
    kind: str,
    *,
    batch_size: int = 256,
    projection: str | None = None,
) -> tuple[Tensor, str]:
    """Frozen image features [N, D] (fp32) of ``model`` -> (features, what was extracted).

    kind = "embedding":      the similarity's ``embed`` vector (dot: the unit point mean; WPSE:
                             concat(√α1·ū, √α2·z̄) with the export's fixed random features), or the
                             weighted point mean where ``embed`` returns None (KME) -> "embed" or
                             "points_mean";
           "points_mean":    :meth:`PointSet.mean` of the encoder output (weighted point mean);
           "pre_projection": the input of the image tower's submodule named ``projection`` (its
                             final projection), pooled over points with the encoder's own point
                             weights (:func:`pool_over_points`) -> "pre_projection".
    Images are encoded ``batch_size`` at a time and reduced to [b, D] at once, so the point sets of
    the whole data set are never held in memory.
    """
    if kind not in FEATURES:
        raise ClipkitError(f"features must be one of {FEATURES}, got {kind!r}")
    if kind == "pre_projection":
        if projection is None:
            raise ClipkitError("pre_projection features need the projection submodule's name")
        return _pre_projection_features(model, samples, projection, batch_size), "pre_projection"
    parts, used = [], "points_mean"
    for start in range(0, len(samples), batch_size):
        points = encode_images(model, samples[start : start + batch_size], batch_size)
        vectors, embedded = embed_points(model, points) if kind == "embedding" else (points.mean(), False)
        used = "embed" if embedded else "points_mean"
        parts.append(vectors.float())
    return torch.cat(parts), used


def _pre_projection_features(model, samples: Sequence[Sample], projection: str, batch_size: int) -> Tensor:
    encoder = model.image_encoder
    module = projection_submodule(encoder, projection)
    captured: list[Tensor] = []

    def keep_input(_module, args) -> None:
        captured.append(args[0].detach().float())

    handle = module.register_forward_pre_hook(keep_input)
    try:
        parts = []
        for start in range(0, len(samples), batch_size):
            captured.clear()
            points = encode_images(model, samples[start : start + batch_size], batch_size)
            if len(captured) != 1:
                raise ClipkitError(
                    f"{type(encoder).__name__}.{projection} ran {len(captured)} times in one forward pass; "
                    "pre_projection features need it to run exactly once"
                )
            parts.append(pool_over_points(captured[0], points, f"{type(encoder).__name__}.{projection}"))
    finally:
        handle.remove()
    return torch.cat(parts)


def projection_submodule(encoder: nn.Module, name: str) -> nn.Module:
    """``encoder``'s submodule at dotted path ``name``, or a ClipkitError naming the encoder."""
    try:
        return encoder.get_submodule(name)
    except AttributeError:
        raise ClipkitError(
            f"image encoder {type(encoder).__name__} has no submodule {name!r} (its projection_module_name)"
        ) from None


def pool_over_points(inputs: Tensor, points: PointSet, where: str) -> Tensor:
    """The projection's input -> one [B, D'] vector per image.

    inputs [B, D'] (already pooled, e.g. a ResNet's averaged features) are returned as they are;
    inputs [B, M, D'] (one row per output point, e.g. ViT tokens) are averaged with the point set's
    own mixture weights (:meth:`PointSet.normalized_weights`): KME-CLIP App. A.2's "weighted vector,
    using the learned weight" of the features before projection; for M = 1 (CLIP's class token)
    that is the token itself.
    """
    batch, count = points.batch_size, points.num_points
    if inputs.dim() == 2 and inputs.shape[0] == batch:
        return inputs
    if inputs.dim() == 3 and tuple(inputs.shape[:2]) == (batch, count):
        weights = points.normalized_weights().to(inputs)
        return (weights.unsqueeze(-1) * inputs).sum(dim=1)
    raise ClipkitError(
        f"{where}: cannot pool its input of shape {tuple(inputs.shape)} to one vector per image "
        f"(the encoder returned {batch} images × {count} points)"
    )
