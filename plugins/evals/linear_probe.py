"""`linear_probe`: a linear classifier on frozen image features, scored on a test set (METHODS §8).

protocol="lbfgs" (CLIP App. A.3, followed by CLOOB and KME-CLIP): multinomial L2 logistic
regression; its strength λ is chosen on a seeded stratified validation split of ``train``
(``val_fraction``) by CLIP's parametric binary search over [1e-6, 1e6], then the classifier is refit
on all of ``train`` (train + validation) with that λ and scored on ``test``. ``l2`` fixes λ instead.
protocol="sgd" (seed 000 §6.3): momentum SGD, cosine schedule, no weight decay, 90 epochs,
lr 0.05 / batch 1024 below 10 000 training images, else lr 0.01 / batch 4096; fit on all of
``train`` (no validation split: the protocol has no hyper-parameter search).

Features (``features``): "embedding" — what the model's similarity compares (its ``embed`` vector;
the weighted point mean for KME, which has none); "points_mean" — the weighted mean of the image
tower's points; "pre_projection" — the image tower's representation before its final projection
(the usual linear-probe feature, seed 000's "CLIP before projection"), pooled over points with the
tower's own point weights (KME-CLIP App. A.2). The projection submodule is found from the encoder's
``projection_module_name`` attribute (the built-in encoders set it; third-party encoders may).
See :mod:`clipkit.plugins.evals.linear_probe_fit` for the math.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from clipkit.contract.types import Sample, optional_member
from clipkit.errors import ClipkitError, DataError
from clipkit.eval.evaluate import load_samples, require_counts
from clipkit.eval.metrics import class_baselines, classification_scores
from clipkit.plugins.evals.class_labels import (
    check_given_classnames,
    described_labels,
    is_index,
    shown,
    squash,
)

PROTOCOLS = ("lbfgs", "sgd")


class LinearProbe:
    """train / test: source URIs or shard directories (``data`` is accepted for ``test``, so
    ``clipkit eval --task linear_probe --data TEST --set train=TRAIN`` works); label: the
    meta-data key holding the class.

    classnames: the classes, in order; default: a standard ``dataset``'s
    (``clipkit.plugins.evals.prompts``, as
    ``zero_shot``; ``dataset`` also names the result in reports), else the train (or test) source's
    ``info()`` label classes, else the sorted distinct label values of train + test. A label value
    may be a class name or, with known classes, its integer index (as ``zero_shot``); the index
    labels of a source that names its classes (a ``classes:`` folder) are matched across train and
    test by those names (:func:`translation`), so a test folder may hold a subset of the classes.
    ``standardize`` z-scores each feature with the statistics of the samples the classifier is
    fitted on (off by default, as CLIP's probe).
    ``max_iter`` bounds each L-BFGS fit (CLIP: 1000); ``epochs``, ``lr`` and ``sgd_batch_size``
    override seed 000's SGD settings. ``seed`` drives the split and SGD. ``batch_size``: images
    encoded at a time.
    """

    def __init__(
        self,
        train: str,
        test: str | None = None,
        label: str = "label",
        dataset: str | None = None,
        classnames: list | None = None,
        features: str = "embedding",
        protocol: str = "lbfgs",
        val_fraction: float = 0.2,
        l2: float | None = None,
        max_iter: int = 1000,
        epochs: int = 90,
        lr: float | None = None,
        sgd_batch_size: int | None = None,
        standardize: bool = False,
        limit_train: int | None = None,
        limit_test: int | None = None,
        seed: int = 0,
        batch_size: int = 256,
        data: str | None = None,
    ) -> None:
        from clipkit.plugins.evals.linear_probe_fit import FEATURES

        if (test is None) == (data is None):
            raise ClipkitError("linear_probe: give the test set as `test` (or `data`, as other tasks), once")
        test = test if test is not None else data

        choose("features", features, FEATURES)
        choose("protocol", protocol, PROTOCOLS)
        if not 0 < val_fraction < 1:
            raise ClipkitError(f"linear_probe: val_fraction must be in (0, 1), got {val_fraction!r}")
        for name, value in (("l2", l2), ("lr", lr)):
            if value is not None and not value > 0:
                raise ClipkitError(f"linear_probe: {name} must be > 0, got {value!r}")
        require_counts(
            "linear_probe",
            max_iter=max_iter,
            epochs=epochs,
            batch_size=batch_size,
            sgd_batch_size=sgd_batch_size,
            limit_train=limit_train,
            limit_test=limit_test,
        )
        if classnames is not None:
            check_given_classnames("linear_probe", classnames)
        self.train, self.test, self.label, self.classnames = train, test, label, classnames
        self.dataset = dataset
        self.features, self.protocol, self.standardize = features, protocol, bool(standardize)
        self.val_fraction, self.l2, self.max_iter = float(val_fraction), l2, int(max_iter)
        self.epochs, self.lr, self.sgd_batch_size = int(epochs), lr, sgd_batch_size
        self.limit_train, self.limit_test = limit_train, limit_test
        self.seed, self.batch_size = int(seed), int(batch_size)

    def __call__(self, model, registry) -> dict:
        from clipkit.plugins.evals.linear_probe_fit import image_features, linear_logits

        train_samples, train_info = load_samples(self.train, self.limit_train, registry=registry)
        test_samples, test_info = load_samples(self.test, self.limit_test, registry=registry)
        train = self.source_labels(train_samples, train_info, self.train)
        test = self.source_labels(test_samples, test_info, self.test)
        classes = self.class_list(train, test)
        y_train = self.class_indices(train, classes)
        y_test = self.class_indices(test, classes)
        projection = (
            projection_module_name(model.image_encoder) if self.features == "pre_projection" else None
        )
        extract = {"batch_size": self.batch_size, "projection": projection}
        x_train, used = image_features(model, train_samples, self.features, **extract)
        x_test, _ = image_features(model, test_samples, self.features, **extract)
        fit = self.fit_lbfgs if self.protocol == "lbfgs" else self.fit_sgd
        standardizer, weight, bias, details = fit(x_train, y_train, len(classes))
        logits = linear_logits(standardizer(x_test), weight, bias).float()
        y_test = y_test.to(logits.device)
        result: dict[str, Any] = {
            "data": self.test,
            "train": self.train,
            "label": self.label,
            "dataset": self.dataset,
            "protocol": self.protocol,
            "features": self.features,
            "features_used": used,
            "feature_dim": int(x_train.shape[1]),
            "standardize": self.standardize,
            "n_train": len(train_samples),
            "n_test": len(test_samples),
            "num_classes": len(classes),
            **classification_scores(logits, y_test),
            "chance": 1 / len(classes),
            # of the test labels: the scores are measured there (the classifier saw train's)
            "baselines": class_baselines(y_test, classes),
            **details,
        }
        return result

    def fit_lbfgs(self, x, y, num_classes: int):
        """λ by the parametric binary search on a validation split (or ``l2``), then the fit on all
        of train -> (standardizer, weight, bias, result entries)."""
        from clipkit.plugins.evals.linear_probe_fit import (
            fit_logistic_regression,
            select_l2,
            stratified_split,
        )

        details: dict[str, Any] = {"n_val": 0}
        l2 = self.l2
        if l2 is None:
            fit_rows, val_rows = stratified_split(y, self.val_fraction, self.seed)
            if len(fit_rows) == 0 or len(val_rows) == 0:
                raise DataError(
                    f"{self.train}: {len(y)} training samples cannot be split into fit and validation "
                    f"parts with val_fraction={self.val_fraction}; use more samples or pass l2=..."
                )
            scale = self.standardizer(x[fit_rows])
            fit_part = (scale(x[fit_rows]), y[fit_rows])
            val_part = (scale(x[val_rows]), y[val_rows])
            l2, val_top1, evaluated = select_l2(fit_part, val_part, num_classes, self.max_iter)
            details.update(n_val=len(val_rows), val_top1=val_top1, search=[list(pair) for pair in evaluated])
        scale = self.standardizer(x)
        weight, bias = fit_logistic_regression(scale(x), y, l2, self.max_iter, num_classes=num_classes)
        details.update(l2=float(l2), fit={"C": 1 / float(l2), "max_iter": self.max_iter})
        return scale, weight, bias, details

    def fit_sgd(self, x, y, num_classes: int):
        """Seed 000's SGD protocol on all of train -> (standardizer, weight, bias, result entries)."""
        from clipkit.plugins.evals.linear_probe_fit import fit_linear_sgd, sgd_hyperparameters

        default_lr, default_batch = sgd_hyperparameters(len(y))
        lr = default_lr if self.lr is None else float(self.lr)
        batch = default_batch if self.sgd_batch_size is None else int(self.sgd_batch_size)
        scale = self.standardizer(x)
        weight, bias = fit_linear_sgd(
            scale(x), y, num_classes=num_classes, epochs=self.epochs, lr=lr, batch_size=batch, seed=self.seed
        )
        details = {"l2": 0.0, "fit": {"lr": lr, "batch_size": batch, "epochs": self.epochs, "momentum": 0.9}}
        return scale, weight, bias, details

    def standardizer(self, features):
        from clipkit.plugins.evals.linear_probe_fit import Standardizer

        return Standardizer.fit(features) if self.standardize else Standardizer.identity(features)

    def source_labels(self, samples: list[Sample], info: dict, data: str) -> SourceLabels:
        """Each sample's label value, and the class names the source gives its index labels (a
        ``classes:`` folder's own sorted folder names: label 0 of one folder need not be label 0 of
        another, so train and test are matched by these names)."""
        values = [self.label_value(sample, data) for sample in samples]
        for sample, value in zip(samples, values, strict=True):
            if not isinstance(value, Hashable):
                raise DataError(
                    f"{data}: sample {sample.key!r}: {self.label}={value!r} cannot be a class (not a scalar)"
                )
        named = described_labels(info, samples, self.label).get("classes")
        return SourceLabels(data, [s.key for s in samples], values, list(named) if named else None)

    def class_list(self, train: SourceLabels, test: SourceLabels) -> list:
        """The probe's classes: ``classnames``, a ``dataset``'s, the train (else test) source's own
        class names, else the sorted distinct label values of train + test."""
        if self.classnames:
            return list(self.classnames)
        if self.dataset is not None:
            from clipkit.plugins.evals import prompts

            return prompts.classnames(self.dataset)
        for source in (train, test):
            if source.named:
                return list(source.named)
        values = set(train.values) | set(test.values)
        return sorted(values, key=lambda v: (type(v).__name__, v))

    def class_indices(self, source: SourceLabels, classes: list):
        """[N] long class index into ``classes`` of each sample: a class name looked up, an index
        label translated through its source's own class names (:func:`translation`), or, where the
        source names none, an integer index into ``classes`` (given or described classes)."""
        import torch

        lookup = {name: i for i, name in enumerate(classes)}
        translate = translation(source, classes) if source.named else None
        indices = []
        for key, value in zip(source.keys, source.values, strict=True):
            if translate is not None and is_index(value):
                index = translate[value] if 0 <= value < len(translate) else None
            else:
                index = lookup.get(value)
                if index is None and source.named is None and is_index(value):
                    index = value if 0 <= value < len(classes) else None
            if index is None:
                raise DataError(
                    f"{source.data}: sample {key!r} has {self.label}={value!r}, not one of the "
                    f"{len(classes)} classes ({shown(classes, 10)})"
                )
            indices.append(index)
        return torch.tensor(indices, dtype=torch.long)

    def label_value(self, sample: Sample, data: str):
        value = sample.meta.get(self.label)
        if value is None:
            raise DataError(f"{data}: sample {sample.key!r} has no meta-data {self.label!r}")
        return value


@dataclass(frozen=True)
class SourceLabels:
    """One source's samples' label values: ``named``, the class names its index labels refer to
    (None where the source names none)."""

    data: str
    keys: list[str]
    values: list
    named: list | None


def translation(source: SourceLabels, classes: list) -> list[int]:
    """Index in ``source.named`` -> index in ``classes``: by name (compared loosely, in any order;
    a test folder may hold a subset of the train folder's classes), or, where none of the names is
    among ``classes`` and the counts agree, by position (another vocabulary, e.g. WordNet ids
    against words, as ``zero_shot``). A source naming some classes the probe lacks is refused: its
    labels would be scored against the wrong classes."""
    position = {squash(name): i for i, name in enumerate(classes)}
    found = [position.get(squash(name)) for name in source.named]
    if all(index is not None for index in found):
        return found
    missing = [name for name, index in zip(source.named, found, strict=True) if index is None]
    if len(missing) == len(found) and len(found) == len(classes):
        return list(range(len(classes)))
    raise DataError(
        f"{source.data}: {'class' if len(missing) == 1 else 'classes'} {shown(missing, 10)} "
        f"{'is' if len(missing) == 1 else 'are'} not among the probe's {len(classes)} classes "
        f"({shown(classes, 10)}); evaluate on data of the train set's classes, or give `classnames` "
        "covering both"
    )


def choose(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ClipkitError(f"linear_probe: {name} must be one of {choices}, got {value!r}")


def projection_module_name(encoder) -> str:
    """The dotted name of ``encoder``'s final projection submodule (its input is the
    "pre_projection" feature), from the encoder's ``projection_module_name`` attribute (built-ins:
    ViT and ResNet ``proj``; CLIP's modified ResNet ``attnpool.c_proj``; DenseNet3d ``head``)."""
    name = optional_member(encoder, "projection_module_name")
    if name:
        return str(name)
    raise ClipkitError(
        f"linear_probe: image encoder {type(encoder).__name__} does not name its final projection, so "
        "features='pre_projection' cannot find its input; give the encoder an attribute "
        "`projection_module_name = '<dotted submodule name>'`, or use features='embedding' / 'points_mean'"
    )
