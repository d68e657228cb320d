"""`retrieval`: image->text and text->image Recall@K with several captions per image (METHODS §8).

An image->text query is a hit at K if *any* of the image's captions is among the top K
texts; a text->image query is a hit if its own image is among the top K images. The report
also holds the recall curve R@1..R@K_max of both directions (for the recall-curve plot). For a
random-feature similarity (WPSE) the recalls are averaged over several feature seeds (± std).
"""

from __future__ import annotations

import torch

from clipkit.eval.evaluate import (
    encode_images,
    encode_texts,
    feature_seeds,
    image_text_logits,
    load_samples,
    mean_and_std,
)

#: Largest K of the recall curve kept in the report.
CURVE_MAX_K = 50


class Retrieval:
    """data: a source URI or shard directory whose samples carry one or more captions.

    ks: the K of the reported Recall@K (default 1, 5, 10); feature_seeds: as ``zero_shot``.
    """

    def __init__(
        self,
        data: str,
        ks: list | None = None,
        feature_seeds: int | None = None,
        limit: int | None = None,
        batch_size: int = 256,
    ) -> None:
        self.data, self.limit, self.batch_size = data, limit, batch_size
        self.ks = [int(k) for k in (ks or [1, 5, 10])]
        self.feature_seeds = feature_seeds

    def __call__(self, model, registry) -> dict:
        samples, _ = load_samples(self.data, self.limit, registry=registry)
        texts = [caption for sample in samples for caption in sample.captions]
        owner = torch.tensor([i for i, sample in enumerate(samples) for _ in sample.captions])
        images, captions = (
            encode_images(model, samples, self.batch_size),
            encode_texts(model, texts, self.batch_size),
        )
        runs, curves = [], []
        for seed in feature_seeds(model, self.feature_seeds):
            logits = image_text_logits(model, images, captions, seed=seed)
            ranks = retrieval_ranks(logits, owner)  # shared: the ranking is the costly part
            runs.append(recalls(logits, owner, self.ks, ranks))
            curves.append(recall_curves(logits, owner, CURVE_MAX_K, ranks))
        return {
            "data": self.data,
            "n_images": len(samples),
            "n_texts": len(texts),
            "feature_seeds": len(runs),
            **mean_and_std(runs),
            "curves": mean_curves(curves),
        }


def positives_of(owner: torch.Tensor, n_images: int) -> torch.Tensor:
    """[N_images, N_texts] bool: text t is a caption of image i (owner [N_texts] = its image)."""
    return owner.unsqueeze(0) == torch.arange(n_images).unsqueeze(1)


def first_hit_ranks(logits: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """[N] 1-based rank of each row's best-ranked positive (ties broken by column order).

    Counted, not sorted (O(N²) instead of O(N² log N)): 1 + the candidates scored above the best
    positive + those scored equal to it in an earlier column — what a stable descending sort gives.
    """
    best_score = logits.masked_fill(~positives, float("-inf")).max(dim=1, keepdim=True).values
    best_column = ((logits == best_score) & positives).float().argmax(dim=1, keepdim=True)  # first
    columns = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    above = (logits > best_score).sum(dim=1)
    tied_before = ((logits == best_score) & (columns < best_column)).sum(dim=1)
    return 1 + above + tied_before


def retrieval_ranks(logits: torch.Tensor, owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N_images, N_texts], owner [N_texts] -> (i2t ranks [N_images], t2i ranks [N_texts])."""
    positives = positives_of(owner, logits.shape[0])
    return first_hit_ranks(logits, positives), first_hit_ranks(logits.t(), positives.t())


def recalls(
    logits: torch.Tensor, owner: torch.Tensor, ks: list[int], ranks: tuple | None = None
) -> dict[str, float]:
    """logits [N_images, N_texts]; owner [N_texts] = index of each text's image; ``ranks`` from
    :func:`retrieval_ranks` when already computed."""
    i2t, t2i = ranks if ranks is not None else retrieval_ranks(logits, owner)
    result = {}
    for k in ks:
        result[f"i2t_R@{k}"] = float((i2t <= k).float().mean())
        result[f"t2i_R@{k}"] = float((t2i <= k).float().mean())
    result["mean_recall"] = sum(result.values()) / len(result)
    return result


def recall_curves(
    logits: torch.Tensor, owner: torch.Tensor, max_k: int, ranks: tuple | None = None
) -> dict[str, list[float]]:
    """{"k": [1..K], "i2t": [R@1..R@K], "t2i": [...]} with K = min(max_k, number of candidates)."""
    i2t, t2i = ranks if ranks is not None else retrieval_ranks(logits, owner)
    k_max = min(max_k, logits.shape[1], logits.shape[0])
    ks = torch.arange(1, k_max + 1)
    return {
        "k": ks.tolist(),
        "i2t": (i2t.unsqueeze(0) <= ks.unsqueeze(1)).float().mean(1).tolist(),
        "t2i": (t2i.unsqueeze(0) <= ks.unsqueeze(1)).float().mean(1).tolist(),
    }


def mean_curves(curves: list[dict[str, list]]) -> dict[str, list]:
    """The recall curves averaged over feature seeds (the K axis is shared)."""
    mean = {key: torch.tensor([c[key] for c in curves]).mean(0).tolist() for key in ("i2t", "t2i")}
    return {"k": curves[0]["k"], **mean}
