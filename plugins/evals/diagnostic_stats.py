"""Embedding diagnostics: spectrum, alignment / uniformity, uniformity tests on the sphere, modality gap.

Pure functions on tensors; they never see a model. Unless a docstring says otherwise the rows
are expected to be L2-normalised (points on the unit sphere S^{D-1}); the ``diagnostics`` eval
task (clipkit/plugins/diagnostics.py) normalises before calling them. All arithmetic runs in
float64, so results do not depend on the embeddings' dtype. Pairwise quantities are computed in
row blocks of ``chunk`` rows, so N×N matrices are never held at once.

References
- CLOOB (seed 001, §3 and App. A.2.7; METHODS §4): the number of *effective eigenvalues* of
  the embedding covariance, and Ajne's uniformity statistic (Ajne 1968, extended to the
  hypersphere by Prentice 1978).
- Wang & Isola 2020 (METHODS §5): L_align = E‖f(x) − f(x⁺)‖^α, L_unif = log E e^{−t‖f(x) − f(x')‖²}.
- Rayleigh and Bingham tests of uniformity on S^{D-1} (Mardia & Jupp 2000, §10.4; the same
  normalisations as the R package sphunif's ``sph_stat_Rayleigh`` / ``sph_stat_Bingham``).
- Liang et al. 2022, "Mind the Gap": the modality gap ‖mean(image) − mean(text)‖.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

#: Rows per block when a pairwise (N×N) quantity is accumulated.
DEFAULT_CHUNK = 1024


def _as_matrix(x: Tensor, name: str = "x", min_rows: int = 1) -> Tensor:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [N, D], got shape {tuple(x.shape)}")
    if x.shape[0] < min_rows:
        raise ValueError(f"{name} needs at least {min_rows} rows, got {x.shape[0]}")
    return x.detach().to(torch.float64)


def _gram_blocks(x: Tensor, chunk: int) -> Iterator[tuple[int, Tensor]]:
    """(start, x[start:start+chunk] @ x.T) for consecutive row blocks; x: [N, D] float64."""
    for start in range(0, x.shape[0], chunk):
        yield start, x[start : start + chunk] @ x.t()


def _off_diagonal(block: Tensor, start: int) -> Tensor:
    """[c, N] bool, False where column == global row index (the i == j entries)."""
    rows = torch.arange(start, start + block.shape[0]).unsqueeze(1)
    return rows != torch.arange(block.shape[1]).unsqueeze(0)


# --- spectrum (CLOOB) -----------------------------------------------------------------------------


def covariance_eigenvalues(embeddings: Tensor) -> Tensor:
    """[N, D] -> [D] eigenvalues (descending, ≥ 0) of the *centred* covariance (1/N) Σ (x_i − x̄)(x_i − x̄)ᵀ.

    CLOOB (App. A.2.7, following Jing et al. 2022) uses the eigenvalues of "the covariance
    matrix of the image and text embeddings", i.e. of the unit embeddings the similarity
    sees, centred on their mean. The 1/N vs 1/(N−1) choice cancels in every ratio.
    Computed as the squared singular values of the centred data / N (no D×D matrix is
    diagonalised; more accurate for the small eigenvalues), padded with zeros to D.
    """
    x = _as_matrix(embeddings, "embeddings")
    centred = x - x.mean(dim=0, keepdim=True)
    eigenvalues = torch.linalg.svdvals(centred).pow(2) / x.shape[0]  # descending, min(N, D) values
    return torch.cat([eigenvalues, eigenvalues.new_zeros(x.shape[1] - eigenvalues.numel())])


def effective_eigenvalues(embeddings: Tensor, fraction: float = 0.99) -> int:
    """CLOOB's number of effective eigenvalues: [N, D] -> int in [0, D].

    The smallest k such that the k largest eigenvalues of the centred covariance
    (:func:`covariance_eigenvalues`) sum to at least ``fraction`` (CLOOB: 99 %) of the trace.
    0 when the embeddings have no variance at all (every row identical).
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    eigenvalues = covariance_eigenvalues(embeddings)
    total = float(eigenvalues.sum())
    if total <= 0.0:
        return 0
    cumulative = torch.cumsum(eigenvalues, 0) / total
    # A relative slack of 1e-9 so that e.g. three equal eigenvalues reach 2/3 after two, not three.
    below = int((cumulative < fraction * (1.0 - 1e-9)).sum())
    return min(below + 1, eigenvalues.numel())


# --- alignment and uniformity (Wang & Isola 2020) -------------------------------------------------


def alignment(x: Tensor, y: Tensor, alpha: float = 2.0) -> float:
    """Wang & Isola's L_align = mean_i ‖x_i − y_i‖^α for positive pairs (x_i, y_i); x, y: [N, D].

    Lower is better aligned. For unit vectors and α = 2 this is 2 − 2·mean_i cos(x_i, y_i).
    """
    x, y = _as_matrix(x, "x"), _as_matrix(y, "y")
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    return float((x - y).norm(dim=1).pow(alpha).mean())


def uniformity(x: Tensor, t: float = 2.0, chunk: int = DEFAULT_CHUNK) -> float:
    """Wang & Isola's L_unif = log mean_{i≠j} exp(−t‖x_i − x_j‖²); x: [N ≥ 2, D].

    Over all ordered pairs of distinct rows (the same mean as over i < j, as their code's
    ``pdist``). Lower is more uniform; 0 when all rows coincide; on S^{D-1} it is bounded
    below by −4t (only reachable with two antipodal points). Computed as a log-sum-exp.
    """
    x = _as_matrix(x, "x", min_rows=2)
    squared_norms = (x * x).sum(dim=1)
    block_lse = []
    for start, gram in _gram_blocks(x, chunk):
        squared = squared_norms[start : start + gram.shape[0]].unsqueeze(1) + squared_norms - 2 * gram
        exponent = (-t * squared.clamp_min(0.0)).masked_fill(~_off_diagonal(gram, start), -math.inf)
        block_lse.append(torch.logsumexp(exponent.flatten(), 0))
    n = x.shape[0]
    return float(torch.logsumexp(torch.stack(block_lse), 0) - math.log(n * (n - 1)))


# --- tests of uniformity on the sphere ------------------------------------------------------------


def chi2_survival(statistic: float, df: float) -> float:
    """P(χ²_df > statistic) = Q(df/2, statistic/2), the regularised upper incomplete gamma."""
    value = torch.special.gammaincc(
        torch.tensor(df / 2.0, dtype=torch.float64),
        torch.tensor(max(statistic, 0.0) / 2.0, dtype=torch.float64),
    )
    return float(value)


def rayleigh_test(x: Tensor) -> tuple[float, float]:
    """Rayleigh test of uniformity on S^{D-1}: x [N, D] unit rows -> (statistic, p-value).

    R = D·N·‖x̄‖² with x̄ the mean row. Under uniformity E[R] = D exactly and R → χ²_D as N → ∞
    (the p-value uses χ²_D). It detects a non-zero mean direction (a "cone" of embeddings);
    it cannot see antipodally symmetric or anisotropic non-uniformity (use the Bingham test).
    """
    x = _as_matrix(x, "x")
    n, d = x.shape
    statistic = d * n * float(x.mean(dim=0).pow(2).sum())
    return statistic, chi2_survival(statistic, d)


def bingham_test(x: Tensor) -> tuple[float, float]:
    """Bingham test of uniformity on S^{D-1}: x [N, D] unit rows -> (statistic, p-value).

    B = (N·D·(D+2)/2)·(tr(T²) − 1/D), T = (1/N) Σ x_i x_iᵀ the scatter (second-moment) matrix,
    whose trace is 1. Uniformity gives T ≈ I/D; B → χ²_{(D−1)(D+2)/2} as N → ∞. It detects
    anisotropy (embeddings concentrated near a subspace: dimensional collapse, cf. the
    effective eigenvalues) but not a shifted mean on its own.
    """
    x = _as_matrix(x, "x")
    n, d = x.shape
    scatter = x.t() @ x / n
    statistic = 0.5 * n * d * (d + 2) * (float((scatter * scatter).sum()) - 1.0 / d)
    return statistic, chi2_survival(statistic, (d - 1) * (d + 2) / 2)


def ajne_statistic(x: Tensor, chunk: int = DEFAULT_CHUNK) -> float:
    """Ajne's statistic as extended to S^{D-1} by Prentice (CLOOB eq. A177): x [N ≥ 2, D] unit rows.

    A_N = N/4 − (1/(N·π)) Σ_{i<j} ψ_ij, ψ_ij = arccos(x_iᵀ x_j) ∈ [0, π].
    Under uniformity E[ψ_ij] = π/2, so E[A_N] = 1/4 exactly; all rows identical give N/4 (the
    maximum), so larger means less uniform (CLOOB Fig. 3). Its null law is a weighted sum of
    χ² variables (no p-value here). It does not detect antipodally symmetric alternatives
    (N/2 copies each of x and −x give 0).
    """
    x = _as_matrix(x, "x", min_rows=2)
    angle_sum = x.new_zeros(())
    for start, gram in _gram_blocks(x, chunk):
        angles = torch.arccos(gram.clamp(-1.0, 1.0))
        angle_sum = angle_sum + angles.masked_fill(~_off_diagonal(gram, start), 0.0).sum()
    n = x.shape[0]
    return n / 4.0 - float(angle_sum / 2.0) / (n * math.pi)  # each unordered pair was counted twice


# --- the two modalities together -------------------------------------------------------------------


def modality_gap(image: Tensor, text: Tensor) -> float:
    """Liang et al. 2022's modality gap ‖mean_i image_i − mean_j text_j‖.

    image [N, D], text [M, D] unit rows (M may differ from N: the two means are separate).
    """
    image, text = _as_matrix(image, "image"), _as_matrix(text, "text")
    if image.shape[1] != text.shape[1]:
        raise ValueError(f"image and text widths differ: {image.shape[1]} vs {text.shape[1]}")
    return float((image.mean(dim=0) - text.mean(dim=0)).norm())


def pair_cosines(image: Tensor, text: Tensor) -> dict[str, float]:
    """Mean cosine of matched pairs (image_i, text_i) and of unmatched pairs (i ≠ j); image, text [N ≥ 2, D].

    Rows must be unit vectors (the dot product is the cosine). The unmatched mean uses
    Σ_{i≠j} x_i·y_j = (Σx)·(Σy) − Σ_i x_i·y_i, so no N×N matrix is formed.
    """
    image, text = _as_matrix(image, "image", min_rows=2), _as_matrix(text, "text", min_rows=2)
    if image.shape != text.shape:
        raise ValueError(
            f"image and text must be paired [N, D], got {tuple(image.shape)}, {tuple(text.shape)}"
        )
    n = image.shape[0]
    matched = (image * text).sum(dim=1)
    all_pairs = image.sum(dim=0) @ text.sum(dim=0)
    return {
        "matched": float(matched.mean()),
        "unmatched": float((all_pairs - matched.sum()) / (n * (n - 1))),
    }
