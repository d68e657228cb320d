"""`retrieval`: image->text and text->image Recall@K with several captions per image (METHODS §8).

An image->text query is a hit at K if *any* of the image's captions is among the top K
texts; a text->image query is a hit if its own image is among the top K images.
"""

from __future__ import annotations

import torch

from clipkit.evaluate import encode_images, encode_texts, image_text_logits, load_samples, recall_at_k


class Retrieval:
    """data: a source URI or shard directory whose samples carry one or more captions."""

    def __init__(
        self, data: str, ks: list | None = None, limit: int | None = None, batch_size: int = 256
    ) -> None:
        self.data, self.limit, self.batch_size = data, limit, batch_size
        self.ks = [int(k) for k in (ks or [1, 5, 10])]

    def __call__(self, model, registry) -> dict:
        samples, _ = load_samples(self.data, self.limit, registry=registry)
        texts = [caption for sample in samples for caption in sample.captions]
        owner = torch.tensor([i for i, sample in enumerate(samples) for _ in sample.captions])
        logits = image_text_logits(
            model, encode_images(model, samples, self.batch_size), encode_texts(model, texts, self.batch_size)
        )
        return {
            "data": self.data,
            "n_images": len(samples),
            "n_texts": len(texts),
            **recalls(logits, owner, self.ks),
        }


def recalls(logits: torch.Tensor, owner: torch.Tensor, ks: list[int]) -> dict[str, float]:
    """logits [N_images, N_texts]; owner [N_texts] = index of each text's image."""
    positives = owner.unsqueeze(0) == torch.arange(logits.shape[0]).unsqueeze(1)  # [N_images, N_texts]
    result = {}
    for k in ks:
        result[f"i2t_R@{k}"] = recall_at_k(logits, positives, k)
        result[f"t2i_R@{k}"] = recall_at_k(logits.t(), positives.t(), k)
    result["mean_recall"] = sum(result.values()) / len(result)
    return result
