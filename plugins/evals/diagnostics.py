"""`diagnostics`: geometry of the image and text embeddings (CLOOB's analyses, Wang & Isola, modality gap).

For each sample, one image embedding and one caption embedding, each a single vector per input.
With ``embedding: similarity`` (default) that is ``model.similarity.embed(points)`` where the
similarity factorises (dot, cosine_mean, hopfield: the unit pooled vector; wpse: concat(√α1·ū,
√α2·z̄) with the export's eval-seeded random features, the same draw for images and texts), else
the weighted point mean (``PointSet.mean()``; kme, whose log-RKHS similarity has no finite
embedding). ``embedding: mean`` always takes the point mean (the encoders' own d-dimensional
space, also for wpse). Every vector is then L2-normalised, so all numbers describe points on the
unit sphere. See plugins/evals/diagnostic_stats.py for the formulas.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from clipkit.contract.types import PointSet
from clipkit.errors import DataError
from clipkit.eval.evaluate import embed_points, encode_images, encode_texts, load_samples, require_counts
from clipkit.plugins.evals import diagnostic_stats as diagnostics

CAPTION_CHOICES = ("first", "random")
EMBEDDING_CHOICES = ("similarity", "mean")


class Diagnostics:
    """data: a source URI or shard directory of captioned images.

    limit:       evaluate at most this many samples (pairwise statistics cost O(N²·D)).
    batch_size:  encoder batch size.
    caption:     which caption pairs with each image: "first", or "random" (seeded, reproducible).
    embedding:   "similarity" (the similarity's own embed, else the point mean) or "mean" (point mean).
    fraction:    the share of the covariance spectrum the effective eigenvalues must reach (CLOOB: 0.99).
    alpha, t:    Wang & Isola's alignment exponent and uniformity temperature (both 2, METHODS §5).
    spectrum:    also return the sorted normalised covariance eigenvalues per modality (CLOOB Fig. A1).
    """

    def __init__(
        self,
        data: str,
        limit: int | None = None,
        batch_size: int = 256,
        caption: str = "first",
        embedding: str = "similarity",
        fraction: float = 0.99,
        alpha: float = 2.0,
        t: float = 2.0,
        spectrum: bool = False,
    ) -> None:
        require_counts("diagnostics", limit=limit, batch_size=batch_size)
        if caption not in CAPTION_CHOICES:
            raise ValueError(f"caption must be one of {CAPTION_CHOICES}, got {caption!r}")
        if embedding not in EMBEDDING_CHOICES:
            raise ValueError(f"embedding must be one of {EMBEDDING_CHOICES}, got {embedding!r}")
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.data, self.limit, self.batch_size, self.caption = data, limit, batch_size, caption
        self.embedding = embedding
        self.fraction, self.alpha, self.t, self.spectrum = fraction, alpha, t, spectrum

    def __call__(self, model, registry) -> dict:
        samples, _ = load_samples(self.data, self.limit, registry=registry)
        if len(samples) < 2:
            raise DataError(f"{self.data}: diagnostics need at least 2 samples, got {len(samples)}")
        texts = self.pick_captions(samples)
        image_points = encode_images(model, samples, self.batch_size)
        image = self.embed(model, image_points)
        text = self.embed(model, encode_texts(model, texts, self.batch_size))
        result = {
            "data": self.data,
            "embedding": self.embedding_used(model, image_points),
            "n": len(samples),
            "dim": int(image.shape[1]),
        }
        result.update(embedding_metrics(image, text, self.fraction, self.alpha, self.t))
        if self.spectrum:
            for name, x in (("image", image), ("text", text)):
                eigenvalues = diagnostics.covariance_eigenvalues(x)
                result[f"spectrum_{name}"] = (eigenvalues / eigenvalues.sum().clamp_min(1e-300)).tolist()
        return result

    def pick_captions(self, samples) -> list[str]:
        rng = random.Random(0)
        texts = []
        for sample in samples:
            if not sample.captions:
                raise DataError(f"{self.data}: sample {sample.key!r} has no caption")
            index = 0 if self.caption == "first" else rng.randrange(len(sample.captions))
            texts.append(sample.captions[index])
        return texts

    def embed(self, model, points: PointSet) -> Tensor:
        """[N, M, d] -> [N, D] unit vectors, in chunks of ``batch_size`` (random features are [N·M, D]).

        Each chunk gets a freshly seeded eval generator, so every chunk (and the texts) sees the
        same random features, exactly as ``image_text_logits`` scores them.
        """
        parts = []
        for start in range(0, points.batch_size, self.batch_size):
            part = points.rows(start, start + self.batch_size)
            parts.append(embed_points(model, part)[0] if self.embedding == "similarity" else part.mean())
        return torch.nn.functional.normalize(torch.cat(parts).float(), dim=-1)

    def embedding_used(self, model, points: PointSet) -> str:
        """Which vectors ``embed`` returns: "similarity.embed", or "point mean" (asked for, or the
        similarity has no finite embedding)."""
        if self.embedding == "similarity" and embed_points(model, points.rows(0, 1))[1]:
            return "similarity.embed"
        return "point mean"


def embedding_metrics(image: Tensor, text: Tensor, fraction: float, alpha: float, t: float) -> dict:
    """Flat float metrics of paired unit embeddings image [N, D], text [N, D]."""
    metrics: dict[str, float] = {}
    for name, x in (("image", image), ("text", text)):
        metrics[f"effective_eigenvalues_{name}"] = float(diagnostics.effective_eigenvalues(x, fraction))
        metrics[f"uniformity_{name}"] = diagnostics.uniformity(x, t)
        metrics[f"ajne_{name}"] = diagnostics.ajne_statistic(x)
        metrics[f"rayleigh_{name}"], metrics[f"rayleigh_p_{name}"] = diagnostics.rayleigh_test(x)
        metrics[f"bingham_{name}"], metrics[f"bingham_p_{name}"] = diagnostics.bingham_test(x)
    metrics["alignment"] = diagnostics.alignment(image, text, alpha)
    metrics["modality_gap"] = diagnostics.modality_gap(image, text)
    cosines = diagnostics.pair_cosines(image, text)
    metrics["cosine_matched"], metrics["cosine_unmatched"] = cosines["matched"], cosines["unmatched"]
    return metrics
