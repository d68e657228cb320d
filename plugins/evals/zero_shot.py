"""`zero_shot`: classify images by the similarity to prompt-ensembled class texts (METHODS §8).

Each class's prompts (templates × class name) are encoded and merged by the model's
similarity's own ``ensemble`` rule (CLIP: mean of unit vectors, renormalised; WPSE: mean of
the features; KME: union of the weighted point sets), so the same code scores every
similarity. Class names and templates come, in this order of precedence, from the task's
``classnames`` / ``templates``, from a named standard ``dataset`` (CIFAR-10, ImageNet, ...,
shipped with clipkit: :mod:`clipkit.plugins.evals.prompts`), or from the source's own label set
(``info()["labels"][label]``, e.g. a ``classes:`` folder). For a random-feature similarity
(WPSE) the scores are repeated over several feature seeds and reported as mean ± std.
"""

from __future__ import annotations

import torch

from clipkit.errors import DataError
from clipkit.eval.evaluate import (
    encode_images,
    encode_texts,
    feature_seeds,
    image_text_logits,
    load_samples,
    mean_and_std,
    topk_accuracy,
)


class ZeroShot:
    """Zero-shot classification.

    data:          a source URI or shard directory.
    label:         the meta-data key holding each image's class (an index or a class name).
    dataset:       a standard dataset's class names and templates
                   (``clipkit.plugins.evals.prompts.dataset_names()``).
    classnames:    explicit class names (override ``dataset`` and the source's).
    templates:     a list of ``{}`` templates, or a style name for ``dataset``: "clip" (CLIP's
                   per-dataset prompts), "clip80" / "clip7" (CLIP's 80 / 7 ImageNet templates),
                   "slip" (SLIP's per-dataset templates), "clip_benchmark".
    feature_seeds: how many random-feature draws to average (default 5 for WPSE, 1 otherwise).
    """

    def __init__(
        self,
        data: str,
        label: str = "label",
        dataset: str | None = None,
        classnames: list | None = None,
        templates: list | str | None = None,
        feature_seeds: int | None = None,
        limit: int | None = None,
        batch_size: int = 256,
    ) -> None:
        self.data, self.label, self.limit, self.batch_size = data, label, limit, batch_size
        self.dataset, self.classnames, self.templates = dataset, classnames, templates
        self.feature_seeds = feature_seeds

    def __call__(self, model, registry) -> dict:
        samples, info = load_samples(self.data, self.limit, registry=registry)
        classnames, templates = self.prompts(info)
        labels = torch.tensor([self.class_index(s, classnames) for s in samples])
        class_points = self.class_points(model, classnames, templates)
        images = encode_images(model, samples, self.batch_size)
        seeds = feature_seeds(model, self.feature_seeds)
        runs = [
            self.score(image_text_logits(model, images, class_points, seed=seed), labels) for seed in seeds
        ]
        return {
            "data": self.data,
            "label": self.label,
            "dataset": self.dataset,
            "num_classes": len(classnames),
            "num_templates": len(templates),
            "n": len(samples),
            "feature_seeds": len(seeds),
            **mean_and_std(runs),
            "chance": 1 / len(classnames),
        }

    @staticmethod
    def score(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Top-1 (and top-5 with at least 5 classes) of logits [N, C] against labels [N]."""
        scores = {"top1": topk_accuracy(logits, labels, 1)}
        if logits.shape[1] >= 5:
            scores["top5"] = topk_accuracy(logits, labels, 5)
        return scores

    def prompts(self, info: dict) -> tuple[list[str], list[str]]:
        """(class names, templates) by precedence: task arguments, ``dataset``, the source's labels."""
        described = (info.get("labels") or {}).get(self.label) or {}
        classnames = list(self.classnames or self.dataset_classnames() or described.get("classes") or [])
        if not classnames:
            raise DataError(
                f"{self.data}: no class names for label {self.label!r}; pass classnames=[...] or dataset=NAME"
            )
        return classnames, self.resolve_templates(described)

    def dataset_classnames(self) -> list[str] | None:
        if self.dataset is None:
            return None
        from clipkit.plugins.evals import prompts

        return prompts.classnames(self.dataset)

    def resolve_templates(self, described: dict) -> list[str]:
        if isinstance(self.templates, str):
            from clipkit.plugins.evals import prompts

            return prompts.templates(self.dataset or "imagenet", style=self.templates)
        if self.templates:
            return list(self.templates)
        if self.dataset is not None:
            from clipkit.plugins.evals import prompts

            return prompts.templates(self.dataset)
        return list(described.get("templates") or ["{}"])

    def class_points(self, model, classnames: list[str], templates: list[str]):
        """Encode every (class, template) prompt and merge each class's prompts by the similarity's rule."""
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
