"""`zero_shot`: classify images by the similarity to prompt-ensembled class texts (METHODS §8).

Each class's prompts (templates × class name) are encoded and merged by the model's
similarity's own ``ensemble`` rule (CLIP: mean of unit vectors, renormalised; WPSE: mean of
the features; KME: union of the weighted point sets), so the same code scores every
similarity. Class names and templates come, in this order of precedence, from the task's
``classnames`` / ``classnames_file`` / ``templates``, from a named standard ``dataset`` (CIFAR-10,
ImageNet, ..., shipped with clipkit: :mod:`clipkit.plugins.evals.prompts`), from the source's own label set
(``info()["labels"][label]``, e.g. a ``classes:`` folder), or else from the label's distinct
values in the data (any labelled table works with no class list). ``prompt_map`` turns a label
value into the text put in the prompts (``{"n02085620": "chihuahua"}``). For a random-feature similarity
(WPSE) the scores are repeated over several feature seeds and reported as mean ± std.
"""

from __future__ import annotations

from pathlib import Path

import torch

from clipkit.errors import DataError
from clipkit.eval.data_checks import MIN_CLASS_SAMPLES
from clipkit.eval.evaluate import (
    encode_images,
    encode_texts,
    feature_seeds,
    image_text_logits,
    load_samples,
    mean_and_std,
    require_counts,
)
from clipkit.eval.metrics import class_baselines, classification_scores
from clipkit.plugins.evals.class_labels import (
    check_given_classnames,
    check_templates,
    described_labels,
    shown,
    squash,
)


class ZeroShot:
    """Zero-shot classification.

    data:          a source URI or shard directory.
    label:         the meta-data key holding each image's class (an index or a class name).
    dataset:       a standard dataset's class names and templates
                   (``clipkit.plugins.evals.prompts.dataset_names()``).
    classnames:    explicit class names (override ``dataset`` and the source's).
    classnames_file: a text file with one class name per line (label i = line i), for lists too
                   long for a command line.
    prompt_map:    label value -> the text used in prompts, a mapping or a JSON / YAML file of one
                   (values it lacks are used as they are).
    templates:     a list of ``{}`` templates, a text file of them (one per line), or a style name
                   for ``dataset``: "clip" (CLIP's per-dataset prompts), "clip80" / "clip7" (CLIP's
                   80 / 7 ImageNet templates), "slip" (SLIP's per-dataset templates), "clip_benchmark".
    feature_seeds: how many random-feature draws to average (default 5 for WPSE, 1 otherwise).
    training_data: the URI of the samples the model was trained on (``clipkit train --data`` sets
                   it): the result then names the class names that share no word with any training
                   caption and the share of evaluated captions and labels also seen in training.
    min_class_samples: classes with fewer evaluated samples are flagged with their count.
    (Warnings and fields: :mod:`clipkit.eval.data_checks`.)
    """

    def __init__(
        self,
        data: str,
        label: str = "label",
        dataset: str | None = None,
        classnames: list | None = None,
        classnames_file: str | None = None,
        prompt_map: dict | str | None = None,
        templates: list | str | None = None,
        feature_seeds: int | None = None,
        limit: int | None = None,
        batch_size: int = 256,
        training_data: str | None = None,
        min_class_samples: int = MIN_CLASS_SAMPLES,
    ) -> None:
        self.data, self.label, self.limit, self.batch_size = data, label, limit, batch_size
        self.dataset, self.classnames, self.templates = dataset, classnames, templates
        self.feature_seeds = feature_seeds
        self.classnames_file, self.prompt_map = classnames_file, prompt_map
        self.from_values = False  # class names taken from the label's values (matched by value)
        self.training_data, self.min_class_samples = training_data, int(min_class_samples)
        if self.min_class_samples < 1:
            raise ValueError(f"min_class_samples must be >= 1, got {min_class_samples}")
        # Checked here, before a model loads: an empty list would fall back to the defaults unseen.
        require_counts("zero_shot", limit=limit, batch_size=batch_size, feature_seeds=feature_seeds)
        if classnames is not None:
            check_given_classnames("zero_shot", classnames)
        if templates is not None and not isinstance(templates, str):
            check_templates("zero_shot", templates)

    def __call__(self, model, registry) -> dict:
        samples, info = load_samples(self.data, self.limit, registry=registry)
        samples, unlabelled = self.labelled(samples)
        classnames, templates = self.prompts(info, samples)
        labels = torch.tensor([self.class_index(s, classnames) for s in samples])
        names = self.prompt_names(classnames)
        class_points = self.class_points(model, names, templates)
        images = encode_images(model, samples, self.batch_size)
        seeds = feature_seeds(model, self.feature_seeds)
        runs = [
            self.score(image_text_logits(model, images, class_points, seed=seed), labels) for seed in seeds
        ]
        checks = self.checks(samples, classnames, names, labels, registry)
        if unlabelled:
            checks["unlabelled"] = len(unlabelled)
            checks["warnings"] = [
                f"{len(unlabelled)} of {len(samples) + len(unlabelled)} samples have no {self.label!r} "
                f"value and were not scored (e.g. {unlabelled[0]!r})",
                *checks["warnings"],
            ]
        return {
            "data": self.data,
            "label": self.label,
            "dataset": self.dataset,
            **checks,
            "num_classes": len(classnames),
            "num_templates": len(templates),
            "n": len(samples),
            "feature_seeds": len(seeds),
            **mean_and_std(runs),
            "chance": 1 / len(classnames),
            "baselines": class_baselines(labels, classnames),
        }

    def labelled(self, samples) -> tuple[list, list[str]]:
        """(the samples with a ``label`` value, the keys of those without): a table whose label
        column is empty in some rows is scored on the rest, the others counted and named in a
        warning (a training run's final evaluation is not lost to one empty cell); data where no
        sample has the label is refused (:meth:`label_values`)."""
        kept = [sample for sample in samples if sample.meta.get(self.label) is not None]
        if not kept:
            return samples, []
        return kept, [sample.key for sample in samples if sample.meta.get(self.label) is None]

    def checks(self, samples, classnames, names, labels, registry) -> dict:
        """The fields and ``warnings`` of :mod:`clipkit.eval.data_checks` for this task."""
        from clipkit.eval.data_checks import overlap_checks, training_text, zero_shot_checks

        training = training_text(self.training_data, registry) if self.training_data else None
        minimum = self.min_class_samples
        fields, warnings = zero_shot_checks(classnames, names, labels.tolist(), training, minimum)
        if training is not None:
            fields["overlap"], shared = overlap_checks(self.data, samples, training, self.label)
            warnings = shared + warnings
        return {**fields, "warnings": warnings}

    @staticmethod
    def score(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Top-1, top-5 (with at least 5 classes) and mean per-class recall of logits [N, C]
        against labels [N] (:func:`clipkit.eval.metrics.classification_scores`)."""
        return classification_scores(logits, labels)

    def prompts(self, info: dict, samples=()) -> tuple[list[str], list[str]]:
        """(class names, templates) by precedence: task arguments, ``dataset``, the source's labels,
        the label's distinct values in ``samples``."""
        described = self.data_labels(info, samples)
        given = self.classnames or self.file_classnames() or self.dataset_classnames()
        if given and described.get("classes"):
            self.check_matches(list(given), list(described["classes"]))
        classnames = list(given or described.get("classes") or [])
        if not classnames and described.get("classes_missing") and not self.prompt_map:
            raise DataError(
                f"{self.data}: {described['classes_missing']} is missing, so its labels are class "
                "indices with no names to prompt with; restore the file, or pass classnames, "
                "classnames_file or dataset"
            )
        if not classnames:
            # A split of a larger set (holdout:) reports the values of the whole set: every class.
            whole = (info.get("label_values") or {}).get(self.label)
            classnames, self.from_values = self.label_values(samples, whole), True
        return classnames, self.resolve_templates(described)

    def data_labels(self, info: dict, samples=()) -> dict:
        """What the source says about the classes its label values refer to
        (:func:`~clipkit.plugins.evals.class_labels.described_labels`)."""
        return described_labels(info, samples, self.label)

    def given_source(self) -> str:
        if self.classnames:
            return "classnames"
        if self.classnames_file is not None:
            return f"classnames_file {self.classnames_file}"
        return f"dataset {self.dataset!r}"

    def check_matches(self, given: list, data: list) -> None:
        """The class list given (``classnames``, ``classnames_file``, ``dataset``) must be the data's:
        the same number of classes, and no data class at another index of the list (a list in
        another vocabulary, e.g. WordNet ids against words, is matched by index)."""
        synonyms = self.given_synonyms(given)
        problem = None
        if len(given) != len(data):
            problem = f"{len(data)} classes in the data but {len(given)} in {self.given_source()}"
        else:
            for index, name in enumerate(data):
                found = [i for i, names in enumerate(synonyms) if squash(name) in names]
                if found and index not in found:
                    problem = (
                        f"class {index} is {name!r} in the data but {given[index]!r} in "
                        f"{self.given_source()} (which has {name!r} at index {found[0]})"
                    )
                    break
        if problem:
            raise DataError(
                f"{self.data}: the class list does not match the data's labels: {problem}; "
                f"data classes: {shown(data, 10)}; {self.given_source()}: {shown(given, 10)}"
            )

    def given_synonyms(self, given: list) -> list[set[str]]:
        if self.classnames or self.classnames_file is not None or self.dataset is None:
            return [{squash(name)} for name in given]
        from clipkit.plugins.evals import prompts

        return [{squash(name) for name in names} for names in prompts.class_synonyms(self.dataset)]

    def label_values(self, samples, whole: list | None = None) -> list:
        """The label's distinct values in ``samples`` (and ``whole``), sorted: numbers, then text."""
        values = ({s.meta.get(self.label) for s in samples} | set(whole or [])) - {None}
        if not values:
            present = sorted(k for k in (samples[0].meta if samples else {}) if k != "index")
            raise DataError(f"{self.data}: no sample has meta-data {self.label!r} (its columns: {present})")
        return sorted(values, key=lambda v: (isinstance(v, str), 0 if isinstance(v, str) else v, str(v)))

    def file_classnames(self) -> list[str] | None:
        if self.classnames_file is None:
            return None
        lines = read_text(self.classnames_file, "classnames_file").splitlines()
        names = [line.strip() for line in lines if line.strip()]
        if not names:
            raise DataError(f"{self.classnames_file}: classnames_file holds no class names")
        return check_given_classnames("zero_shot", names, f"classnames_file {self.classnames_file}")

    def prompt_names(self, classnames: list) -> list[str]:
        """The text of each class in prompts: ``prompt_map[value]`` where given, else the name itself."""
        mapping = read_mapping(self.prompt_map) if isinstance(self.prompt_map, str) else self.prompt_map
        mapping = {str(k): str(v) for k, v in (mapping or {}).items()}
        return [mapping.get(str(name), str(name)) for name in classnames]

    def dataset_classnames(self) -> list[str] | None:
        if self.dataset is None:
            return None
        from clipkit.plugins.evals import prompts

        return prompts.classnames(self.dataset)

    def resolve_templates(self, described: dict) -> list[str]:
        """The templates by precedence (task, ``dataset``, the source's, ``{}``), each checked."""
        return check_templates("zero_shot", self.templates_by_precedence(described), self.templates_source())

    def templates_source(self) -> str:
        if self.templates is not None:
            return f"templates {self.templates}" if isinstance(self.templates, str) else "templates"
        return f"dataset {self.dataset!r}'s templates" if self.dataset else f"{self.data}'s templates"

    def templates_by_precedence(self, described: dict) -> list[str]:
        if isinstance(self.templates, str) and Path(self.templates).is_file():
            return read_templates(self.templates)
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

    def class_index(self, sample, classnames: list) -> int:
        value = sample.meta.get(self.label)
        if value is None:
            raise DataError(f"{self.data}: sample {sample.key!r} has no meta-data {self.label!r}")
        if self.from_values:
            return classnames.index(value)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(classnames):
            return value
        if value not in classnames:
            raise DataError(
                f"{self.data}: sample {sample.key!r} has {self.label}={value!r}, not a known class; "
                f"the classes are {shown(classnames)} (or their indices 0-{len(classnames) - 1})"
            )
        return classnames.index(value)


def read_text(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{option}: cannot read {path} ({error})") from None


def read_templates(path: str) -> list[str]:
    """A text file of templates, one per line, each with one ``{}`` for the class name."""
    templates = [line.strip() for line in read_text(path, "templates").splitlines() if line.strip()]
    missing = [t for t in templates if "{}" not in t]
    if not templates or missing:
        raise DataError(f"templates: {path}: every line needs a {{}} for the class name; got {missing[:3]}")
    return templates


def read_mapping(path: str) -> dict:
    """A JSON or YAML file holding one mapping (``prompt_map=FILE``)."""
    import yaml

    try:
        loaded = yaml.safe_load(read_text(path, "prompt_map"))  # YAML reads JSON too
    except yaml.YAMLError as error:
        raise DataError(f"prompt_map: {path} is neither JSON nor YAML ({error})") from None
    if not isinstance(loaded, dict):
        raise DataError(f"prompt_map: {path} must hold a mapping label value -> prompt text")
    return loaded
