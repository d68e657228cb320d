"""`retrieval`: image->text and text->image Recall@K with several captions per image (METHODS §8).

An image->text query is a hit at K if *any* of the image's captions is among the top K
texts; a text->image query is a hit if its own image is among the top K images (the COCO /
Flickr protocol: every caption is a query). Ties count at their expected value, never in
candidate order, and every recall comes with its chance level for this gallery
(:mod:`clipkit.plugins.evals.recall`). Identical captions (and identical image files) are
encoded once, so they score exactly alike and tie. The report also holds the recall curve
R@1..R@K_max of both directions (for the recall-curve plot). For a random-feature similarity
(WPSE) the recalls are averaged over several feature seeds (± std).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from clipkit.errors import ClipkitError, DataError
from clipkit.eval.evaluate import (
    encode_images,
    encode_texts,
    feature_seeds,
    image_text_logits,
    load_samples,
    mean_and_std,
    require_counts,
)

from .recall import (  # noqa: F401 — re-exported: the recall maths is part of this task's interface
    QueryTies,
    chance_curves,
    chance_recalls,
    mean_curves,
    positives_of,
    recall_curves,
    recalls,
    retrieval_ties,
)

#: Largest K of the recall curve kept in the report.
CURVE_MAX_K = 50


class Retrieval:
    """data: a source URI or shard directory whose samples carry one or more captions.

    ks: the K of the reported Recall@K (default 1, 5, 10); feature_seeds: as ``zero_shot``.
    training_data: the URI of the samples the model was trained on (``clipkit train --data`` sets
    it): the result then says which fraction of the evaluated captions also occur in training
    (``overlap``, with a warning; :mod:`clipkit.eval.data_checks`).
    """

    def __init__(
        self,
        data: str,
        ks: list | None = None,
        feature_seeds: int | None = None,
        limit: int | None = None,
        batch_size: int = 256,
        training_data: str | None = None,
    ) -> None:
        require_counts("retrieval", limit=limit, batch_size=batch_size, feature_seeds=feature_seeds)
        if ks is not None:  # an empty list would fall back to the defaults unseen; R@0 is always 0
            ks = list(ks) if isinstance(ks, Sequence) and not isinstance(ks, str) else [ks]
            require_counts("retrieval", **{f"ks[{i}]": k for i, k in enumerate(ks)})
            if not ks:
                raise ClipkitError("retrieval: ks must list the K of Recall@K (integers >= 1), got []")
        self.data, self.limit, self.batch_size = data, limit, batch_size
        self.ks = list(dict.fromkeys(int(k) for k in (ks or [1, 5, 10])))  # each K once, as given
        self.feature_seeds = feature_seeds
        self.training_data = training_data

    def __call__(self, model, registry) -> dict:
        samples, _ = load_samples(self.data, self.limit, registry=registry)
        texts = [caption for sample in samples for caption in sample.captions]
        if not texts:
            raise DataError(f"{self.data}: no sample has a caption; retrieval needs image-caption pairs")
        owner = torch.tensor([i for i, s in enumerate(samples) for _ in s.captions], dtype=torch.long)
        distinct_images, image_of = distinct([sample.image for sample in samples])
        distinct_texts, text_of = distinct(texts)
        images = encode_images(model, [samples[i] for i in distinct_images], self.batch_size)
        captions = encode_texts(model, [texts[i] for i in distinct_texts], self.batch_size)
        runs, curves = [], []
        for seed in feature_seeds(model, self.feature_seeds):
            # Scored once per distinct input, then spread back: duplicates tie exactly.
            logits = image_text_logits(model, images, captions, seed=seed)[image_of][:, text_of]
            ties = retrieval_ties(logits, owner)  # shared: locating the positives is the costly part
            runs.append(recalls(logits, owner, self.ks, ties))
            curves.append(recall_curves(logits, owner, CURVE_MAX_K, ties))
        checked = {}
        if self.training_data:
            from clipkit.eval.data_checks import overlap_checks, training_text

            training = training_text(self.training_data, registry)
            overlap, warnings = overlap_checks(self.data, samples, training)
            checked = {"overlap": overlap, "warnings": warnings}
        return {
            "data": self.data,
            **checked,
            "n_images": len(samples),
            "n_texts": len(texts),
            "n_distinct_texts": len(distinct_texts),
            "feature_seeds": len(runs),
            **mean_and_std(runs),
            "chance_recall": chance_recalls(owner, len(samples), self.ks),
            "curves": with_chance(mean_curves(curves), owner, len(samples)),
        }


def with_chance(curves: dict[str, list], owner: torch.Tensor, n_images: int) -> dict[str, list]:
    """The recall curves plus the chance level at each of their K (drawn dotted in the plot)."""
    return {**curves, **chance_curves(owner, n_images, len(curves["k"]))}


def distinct(values: Sequence[Hashable]) -> tuple[list[int], torch.Tensor]:
    """(index of the first occurrence of each distinct value, in order; [len(values)] long: the
    place of each value among those)."""
    place: dict[Hashable, int] = {}
    firsts, inverse = [], []
    for i, value in enumerate(values):
        if value not in place:
            place[value] = len(firsts)
            firsts.append(i)
        inverse.append(place[value])
    return firsts, torch.tensor(inverse, dtype=torch.long)
