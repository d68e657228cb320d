"""CLIP_benchmark's result files, written and read, so a published row and a clipkit run sit side by side.

CLIP_benchmark (LAION-AI/CLIP_benchmark) writes one JSON per (model, dataset, task)::

    {"dataset": "wds/vtab/cifar10", "model": "ViT-B-32", "pretrained": "laion2b_s34b_b79k",
     "task": "zeroshot_classification", "language": "en",
     "metrics": {"acc1": 0.93, "acc5": 0.99, "mean_per_class_recall": 0.93}}

with ``lp_acc1`` / ``lp_acc5`` / ``lp_mean_per_class_recall`` for ``linear_probe`` and
``image_retrieval_recall@K`` (text -> image) / ``text_retrieval_recall@K`` (image -> text) for
``zeroshot_retrieval``. :func:`write_results` writes clipkit's zero-shot, linear-probe and retrieval
results in that schema beside clipkit's report (``REPORT-clip_benchmark-<dataset>-<task>.json``);
:func:`read_result` turns such a file back into a clipkit result row (clipkit's metric names), so
``clipkit report`` can put published numbers beside a run's.

Data read from CLIP_benchmark's wds layout (``wds:DIR``, a ``wds_<name>`` folder) is named as
CLIP_benchmark names it (:func:`benchmark_name`: ``wds_vtab-cifar10`` -> ``vtab/cifar10``), in the
files and in clipkit's own report rows, so both tables use the same dataset names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from clipkit.artifacts.io import atomic_write_text
from clipkit.errors import ClipkitError

#: clipkit task -> CLIP_benchmark task.
TASKS = {
    "zero_shot": "zeroshot_classification",
    "linear_probe": "linear_probe",
    "retrieval": "zeroshot_retrieval",
}
#: clipkit metric -> CLIP_benchmark metric (zero-shot; the probe adds `lp_`; retrieval: `benchmark_metrics`).
CLASSIFICATION = {"top1": "acc1", "top5": "acc5", "mean_per_class_recall": "mean_per_class_recall"}
PROBE = {key: f"lp_{name}" for key, name in CLASSIFICATION.items()}
#: The keys a CLIP_benchmark result file holds (``language`` is optional in older files).
SCHEMA_KEYS = ("dataset", "model", "pretrained", "task", "metrics")
#: CLIP_benchmark's dataset-name prefixes whose "/" its wds folder names write as "-".
NAME_PREFIXES = ("vtab", "fairness", "wilds", "retrieval", "misc", "tfds")
WDS_SCHEME = "wds:"


def benchmark_name(folder: str | Path) -> str:
    """CLIP_benchmark's dataset name of a wds folder: ``wds_vtab-cifar10`` -> ``vtab/cifar10``,
    ``wds_imagenet-a`` -> ``imagenet-a`` (its folders write the name's ``/`` as ``-``)."""
    name = Path(str(folder).rstrip("/")).name
    name = name[len("wds_") :] if name.startswith("wds_") else name
    prefix, dash, rest = name.partition("-")
    return f"{prefix}/{rest}" if dash and prefix in NAME_PREFIXES else name


def wds_dataset(data: Any) -> str | None:
    """The CLIP_benchmark dataset name of a data URI read from its wds layout (``wds:DIR[?split=S]``
    or a ``wds_<name>`` folder), with ``[split]`` when the split is not ``test``; None otherwise."""
    if not isinstance(data, str):
        return None
    path, _, query = data.partition("?")
    explicit = path.startswith(WDS_SCHEME)
    path = path[len(WDS_SCHEME) :] if explicit else path
    if not explicit and (
        "://" in path or ":" in path.split("/")[0] or not Path(path).name.startswith("wds_")
    ):
        return None
    split = dict(part.split("=", 1) for part in query.split("&") if "=" in part).get("split", "test")
    name = benchmark_name(path)
    return name if split == "test" else f"{name}[{split}]"


def metric_names(name: str) -> dict[str, str]:
    """clipkit metric -> CLIP_benchmark metric for clipkit task ``name``."""
    if name == "zero_shot":
        return dict(CLASSIFICATION)
    if name == "linear_probe":
        return dict(PROBE)
    return {}


def benchmark_metrics(result: dict) -> dict[str, float]:
    """The CLIP_benchmark ``metrics`` of one clipkit result (only what clipkit measured)."""
    if result.get("name") == "retrieval":
        metrics = {}
        for key, value in result.items():
            match = re.fullmatch(r"(i2t|t2i)_R@(\d+)", key)
            if match and isinstance(value, (int, float)):
                kind = "text" if match.group(1) == "i2t" else "image"  # i2t retrieves texts
                metrics[f"{kind}_retrieval_recall@{match.group(2)}"] = float(value)
        return metrics
    names = metric_names(str(result.get("name")))
    return {names[key]: float(result[key]) for key in names if isinstance(result.get(key), (int, float))}


def dataset_of(result: dict, short_name) -> str:
    """The dataset name a result is filed under: CLIP_benchmark's for its wds layout, else the
    standard ``dataset`` named, else ``short_name(data)`` (the report's short data name)."""
    return wds_dataset(result.get("data")) or result.get("dataset") or short_name(str(result.get("data", "")))


def as_benchmark_result(
    result: dict, model: str, pretrained: str, short_name=str, language: str = "en"
) -> dict | None:
    """One clipkit result in CLIP_benchmark's schema, or None for a task it has none for (or a
    failed one); ``short_name``: how a data URI without a dataset name is named."""
    task = TASKS.get(str(result.get("name")))
    metrics = benchmark_metrics(result) if task and not result.get("failed") else {}
    if not metrics:
        return None
    dataset = dataset_of(result, short_name)
    if wds_dataset(result.get("data")):
        dataset = f"wds/{dataset}"  # as CLIP_benchmark names a dataset read from its wds layout
    return {
        "dataset": dataset,
        "model": model,
        "pretrained": pretrained,
        "task": task,
        "metrics": metrics,
        "language": language,
    }


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@+-]+", "_", text).strip("_") or "x"


def write_results(report: dict, json_path: Path, short_name=str) -> list[Path]:
    """Write each zero-shot / linear-probe / retrieval result of ``report`` as a CLIP_benchmark result
    file beside ``json_path``: ``<stem>-clip_benchmark-<dataset>-<task>.json`` (a second result of the
    same dataset and task gets ``-2``, ...). ``model``: the report's model (its recipe name);
    ``pretrained``: the evaluated export."""
    json_path = Path(json_path)
    model = str(report.get("model") or "clipkit")
    pretrained = str(report.get("export") or "?")
    written: list[Path] = []
    for result in report.get("results", []):
        converted = as_benchmark_result(result, model, pretrained, short_name)
        if converted is None:
            continue
        dataset = converted["dataset"].removeprefix("wds/")
        stem = f"{json_path.stem}-clip_benchmark-{slug(dataset)}-{converted['task']}"
        path, count = json_path.with_name(f"{stem}.json"), 1
        while path in written:
            count += 1
            path = json_path.with_name(f"{stem}-{count}.json")
        atomic_write_text(path, json.dumps(converted, indent=2) + "\n")
        written.append(path)
    return written


def is_benchmark_result(value: Any) -> bool:
    """Whether a loaded JSON value is a CLIP_benchmark result (its schema's keys, metrics a mapping)."""
    return (
        isinstance(value, dict)
        and all(k in value for k in SCHEMA_KEYS)
        and isinstance(value["metrics"], dict)
    )


def read_result(path: Path) -> dict:
    """A CLIP_benchmark result file as a clipkit result row: ``name`` (clipkit's task), ``dataset``
    (``wds/`` dropped), clipkit's metric names (``top1``, ``i2t_R@1``, ...), ``model``, ``pretrained``."""
    from clipkit.artifacts.files import read_json, require

    path = Path(path)
    what = "CLIP_benchmark result"
    value = read_json(path, what)
    if not is_benchmark_result(value):
        raise ClipkitError(f"{path}: not a CLIP_benchmark result (needs keys {', '.join(SCHEMA_KEYS)})")
    for key in ("task", "dataset"):
        require(value[key], key, str, path, what)
    names = {task: name for name, task in TASKS.items()}
    name = names.get(value["task"], value["task"])
    row: dict[str, Any] = {"name": name, "dataset": str(value["dataset"]).removeprefix("wds/")}
    back = {cb: key for key, cb in metric_names(name).items()}
    for key, metric in value["metrics"].items():
        match = re.fullmatch(r"(image|text)_retrieval_recall@(\d+)", key)
        if match:
            key = f"{'t2i' if match.group(1) == 'image' else 'i2t'}_R@{match.group(2)}"
        if isinstance(metric, (int, float)) and metric == metric:  # NaN: CLIP_benchmark's acc5 on < 5 classes
            row[back.get(key, key)] = float(metric)
    row.update(model=value["model"], pretrained=value["pretrained"], language=value.get("language", "en"))
    return row


def benchmark_files(directory: Path) -> list[Path]:
    """The CLIP_benchmark result files directly in ``directory`` (sorted)."""
    from clipkit.artifacts.files import read_json

    found = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            if is_benchmark_result(read_json(path, "JSON file")):
                found.append(path)
        except ClipkitError:
            continue  # not a result file; others in the folder may be
    return found


def read_as_report(path: Path) -> dict | None:
    """A CLIP_benchmark result file, or a folder of them, as a clipkit report (``results`` rows);
    None when ``path`` holds none."""
    path = Path(path)
    files = [path] if path.is_file() else benchmark_files(path) if path.is_dir() else []
    if not files:
        return None
    return {"export": str(path), "source": "CLIP_benchmark", "results": [read_result(file) for file in files]}
