"""`zero_shot`: classify images by the similarity to prompt-ensembled class texts (METHODS §8).

Each class's prompts (templates × class name) are encoded and merged by the model's
similarity's own ``ensemble`` rule (CLIP: mean of unit vectors, renormalised), so the
same code scores every similarity. Class names and templates come from the task or, by
default, from the dataset's ``info()["labels"][label]``.
"""

from __future__ import annotations

import torch

from clipkit.errors import DataError
from clipkit.evaluate import encode_images, encode_texts, image_text_logits, load_samples, topk_accuracy


class ZeroShot:
    """data: a source URI or shard directory; label: the meta-data key holding each image's class."""

    def __init__(
        self,
        data: str,
        label: str,
        classnames: list | None = None,
        templates: list | None = None,
        limit: int | None = None,
        batch_size: int = 256,
    ) -> None:
        self.data, self.label, self.limit, self.batch_size = data, label, limit, batch_size
        self.classnames, self.templates = classnames, templates

    def __call__(self, model, registry) -> dict:
        samples, info = load_samples(self.data, self.limit, registry=registry)
        classnames, templates = self.prompts(info)
        labels = torch.tensor([self.class_index(s, classnames) for s in samples])
        class_points = self.class_points(model, classnames, templates)
        logits = image_text_logits(model, encode_images(model, samples, self.batch_size), class_points)
        result = {
            "data": self.data,
            "label": self.label,
            "num_classes": len(classnames),
            "num_templates": len(templates),
            "n": len(samples),
            "top1": topk_accuracy(logits, labels, 1),
            "chance": 1 / len(classnames),
        }
        if len(classnames) >= 5:
            result["top5"] = topk_accuracy(logits, labels, 5)
        return result

    def prompts(self, info: dict) -> tuple[list[str], list[str]]:
        described = (info.get("labels") or {}).get(self.label) or {}
        classnames = list(self.classnames or described.get("classes") or [])
        templates = list(self.templates or described.get("templates") or ["{}"])
        if not classnames:
            raise DataError(f"{self.data}: no class names for label {self.label!r}; pass classnames=[...]")
        return classnames, templates

    def class_points(self, model, classnames: list[str], templates: list[str]):
        texts = [template.format(name) for name in classnames for template in templates]
        groups = torch.arange(len(classnames)).repeat_interleave(len(templates))
        return model.similarity.ensemble(encode_texts(model, texts, self.batch_size), groups)

    def class_index(self, sample, classnames: list[str]) -> int:
        value = sample.meta.get(self.label)
        if value is None:
            raise DataError(f"{self.data}: sample {sample.key!r} has no meta-data {self.label!r}")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(classnames):
            return value
        if value not in classnames:
            raise DataError(
                f"{self.data}: sample {sample.key!r} has {self.label}={value!r}, not a known class"
            )
        return classnames.index(value)
