"""Recall@K with an explicit tie policy, multi-caption positives and the chance level.

Tie policy: a tie is never broken by candidate order. When a query's best-scored positive shares
its score with other candidates, the tied candidates are taken in a uniformly random order and
the query counts as the *expected* hit: the probability that this order puts a positive within
the top K. Its expected rank is ``above + (tied + 1) / (tied_positives + 1)``. Counting the hit
probability (not "expected rank <= K") keeps the recall the exact mean over random tie-breaks:
two identical captions tied at the top give R@1 = 0.5 each, not 0 and not "1 for the one listed
first".

Chance: a scorer that ties every candidate (or ranks them at random) gets exactly the same
formula with nothing above: ``1 - C(T - c, K) / C(T, K)`` for a query with ``c`` positives among
``T`` candidates, i.e. ``K / N`` for a text->image query over N images, and more for an
image->text query whose image has several captions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def positives_of(owner: torch.Tensor, n_images: int) -> torch.Tensor:
    """[N_images, N_texts] bool: text t is a caption of image i (owner [N_texts] = its image)."""
    return owner.unsqueeze(0) == torch.arange(n_images).unsqueeze(1)


@dataclass(frozen=True)
class QueryTies:
    """Per query (one row of the scores), where its best-scored positive stands.

    above [N]: candidates scored strictly above the best positive (no positive among them);
    tied [N]: candidates scored exactly as the best positive (itself included);
    tied_positives [N]: the positives among those (>= 1).
    """

    above: torch.Tensor
    tied: torch.Tensor
    tied_positives: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, positives: torch.Tensor) -> QueryTies:
        """logits [N, C] scores of C candidates per query; positives [N, C] bool, >= 1 per row.

        Counted, not sorted (O(N·C) instead of O(N·C log C)).
        """
        best = logits.masked_fill(~positives, float("-inf")).max(dim=1, keepdim=True).values
        at_best = logits == best
        return cls(
            above=(logits > best).sum(dim=1),
            tied=at_best.sum(dim=1),
            tied_positives=(at_best & positives).sum(dim=1),
        )

    def expected_rank(self) -> torch.Tensor:
        """[N] float64: the expected 1-based rank of the first positive under random tie-breaking."""
        return self.above.double() + (self.tied.double() + 1) / (self.tied_positives.double() + 1)

    def hit_probability(self, k: int | torch.Tensor) -> torch.Tensor:
        """[N] float64 (or [K, N] for a [K, 1] tensor ``k``): P(a positive is in the top k)."""
        return hit_probability(self.above, self.tied, self.tied_positives, k)


def hit_probability(above, tied, tied_positives, k) -> torch.Tensor:
    """P(at least one of ``tied_positives`` lands in the top ``k``) when ``tied`` candidates, after
    ``above`` sure misses, are put in random order. All arguments broadcast; float64 result.

    The ``slots = k - above`` places left for the tie (clamped to [0, tied]) miss every positive
    with the hypergeometric probability C(tied - p, slots) / C(tied, slots).
    """
    above, tied, p = (torch.as_tensor(x, dtype=torch.float64) for x in (above, tied, tied_positives))
    slots = (torch.as_tensor(k, dtype=torch.float64) - above).clamp(min=0)
    slots = torch.minimum(slots, tied)
    negatives = tied - p
    possible = slots <= negatives  # otherwise a positive must be within the slots
    safe = torch.where(possible, slots, torch.zeros_like(slots))
    miss = torch.exp(log_binomial(negatives, safe) - log_binomial(tied, safe))
    return torch.where(possible, 1 - miss, torch.ones_like(miss))


def log_binomial(n: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """log C(n, m) for float64 tensors with 0 <= m <= n."""
    return torch.lgamma(n + 1) - torch.lgamma(m + 1) - torch.lgamma(n - m + 1)


def retrieval_ties(logits: torch.Tensor, owner: torch.Tensor) -> tuple[QueryTies, QueryTies]:
    """logits [N_images, N_texts], owner [N_texts] -> (image->text ties, text->image ties)."""
    positives = positives_of(owner, logits.shape[0])
    return QueryTies.of(logits, positives), QueryTies.of(logits.t(), positives.t())


def recalls(
    logits: torch.Tensor, owner: torch.Tensor, ks: list[int], ties: tuple | None = None
) -> dict[str, float]:
    """``i2t_R@K``, ``t2i_R@K`` for each K and their ``mean_recall``; logits [N_images, N_texts],
    owner [N_texts] = index of each text's image; ``ties`` from :func:`retrieval_ties` when known."""
    i2t, t2i = ties if ties is not None else retrieval_ties(logits, owner)
    result = {}
    for k in ks:
        result[f"i2t_R@{k}"] = float(i2t.hit_probability(k).mean())
        result[f"t2i_R@{k}"] = float(t2i.hit_probability(k).mean())
    result["mean_recall"] = sum(result.values()) / len(result)
    return result


def chance_recalls(owner: torch.Tensor, n_images: int, ks: list[int]) -> dict[str, float]:
    """The recalls of a scorer that ties everything (= a random ranking) for this gallery: the
    same keys as :func:`recalls`. owner [N_texts]."""
    n_texts = owner.numel()
    captions_per_image = torch.bincount(owner, minlength=n_images)
    result = {}
    for k in ks:
        result[f"i2t_R@{k}"] = float(hit_probability(0, n_texts, captions_per_image, k).mean())
        result[f"t2i_R@{k}"] = float(hit_probability(0, n_images, 1, k))
    result["mean_recall"] = sum(result.values()) / len(result)
    return result


def chance_curves(owner: torch.Tensor, n_images: int, k_max: int) -> dict[str, list[float]]:
    """{"chance_i2t": [chance R@1..R@K], "chance_t2i": [...]}, K = 1..k_max (:func:`chance_recalls`)."""
    ks = torch.arange(1, k_max + 1).unsqueeze(1)  # [K, 1] against [N] images
    captions_per_image = torch.bincount(owner, minlength=n_images)
    i2t = hit_probability(0, owner.numel(), captions_per_image, ks).mean(1)
    return {"chance_i2t": i2t.tolist(), "chance_t2i": hit_probability(0, n_images, 1, ks).squeeze(1).tolist()}


def recall_curves(
    logits: torch.Tensor, owner: torch.Tensor, max_k: int, ties: tuple | None = None
) -> dict[str, list[float]]:
    """{"k": [1..K], "i2t": [R@1..R@K], "t2i": [...]} with K = min(max_k, number of candidates)."""
    i2t, t2i = ties if ties is not None else retrieval_ties(logits, owner)
    k_max = min(max_k, logits.shape[1], logits.shape[0])
    ks = torch.arange(1, k_max + 1).unsqueeze(1)  # [K, 1] against [N] queries
    return {
        "k": ks.squeeze(1).tolist(),
        "i2t": i2t.hit_probability(ks).mean(1).tolist(),
        "t2i": t2i.hit_probability(ks).mean(1).tolist(),
    }


def mean_curves(curves: list[dict[str, list]]) -> dict[str, list]:
    """The recall curves averaged over feature seeds (the K axis is shared)."""
    mean = {key: torch.tensor([c[key] for c in curves]).mean(0).tolist() for key in ("i2t", "t2i")}
    return {"k": curves[0]["k"], **mean}
