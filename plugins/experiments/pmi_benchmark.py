"""The PMI-fidelity runner: train tiny towers per similarity on the PMI task through clipkit's one
loop, score each against the true PMI on held-out batches, rank them (METHODS §8)."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from clipkit.plugins.experiments.pmi_distribution import LatentPairDistribution
from clipkit.plugins.experiments.pmi_metrics import infonce, infonce_gap, pmi_fidelity
from clipkit.plugins.experiments.pmi_report import write_report
from clipkit.plugins.experiments.pmi_stream import study_stream

#: Keys of a benchmark entry that configure the benchmark, not the similarity factory.
ENTRY_KEYS = ("label", "points", "weighted")

#: The similarities the default benchmark compares (METHODS §1–3). ``points`` None = the run's
#: ``points`` argument; ``dot`` is CLIP (one vector per input).
DEFAULT_SIMILARITIES: tuple[dict[str, Any], ...] = (
    {"name": "dot", "label": "dot (CLIP)", "points": 1, "weighted": False},
    {"name": "cosine_mean", "label": "cosine_mean", "weighted": False},
    {"name": "wpse", "label": "wpse gaussian", "kernel": "gaussian", "weighted": True},
    {"name": "wpse", "label": "wpse imq", "kernel": "imq", "weighted": True},
    {"name": "kme", "label": "kme", "weighted": True},
)

#: Offset between the training and held-out data streams' seeds (distinct samples, same seed).
HELD_OUT_SEED_OFFSET = 1_000_003


@dataclass
class BenchmarkEntry:
    """One similarity of the benchmark: registry config + how its encoders look."""

    label: str
    config: dict[str, Any]  # {"name": registered similarity, **factory kwargs}
    points: int
    weighted: bool


@dataclass
class Training:
    """The settings every entry trains with (one task, one seed, one budget)."""

    embed_dim: int
    steps: int
    batch_size: int
    seed: int
    hidden: int
    lr: float


def parse_entries(similarities: Sequence[dict | str] | None, points: int) -> list[BenchmarkEntry]:
    """Benchmark entries from dicts {"name", factory kwargs..., "label"?, "points"?, "weighted"?}
    or bare registered names. Labels must be unique (they key the results)."""
    entries = []
    for item in DEFAULT_SIMILARITIES if similarities is None else similarities:
        spec = {"name": item} if isinstance(item, str) else dict(item)
        if "name" not in spec:
            raise ValueError(f"a benchmark similarity needs a registered 'name', got {item!r}")
        config = {k: v for k, v in spec.items() if k not in ENTRY_KEYS}
        extra = ", ".join(f"{k}={v}" for k, v in config.items() if k != "name")
        label = spec.get("label") or (f"{spec['name']} ({extra})" if extra else spec["name"])
        entry_points = spec.get("points")
        entries.append(
            BenchmarkEntry(
                str(label),
                config,
                int(points if entry_points is None else entry_points),
                bool(spec.get("weighted", True)),
            )
        )
    labels = [entry.label for entry in entries]
    if len(set(labels)) != len(labels):
        raise ValueError(f"benchmark labels must be unique (give a 'label'), got {labels}")
    return entries


def run_pmi_benchmark(
    similarities: Sequence[dict | str] | None = None,
    *,
    embed_dim: int = 4,
    points: int = 8,
    steps: int = 300,
    batch_size: int = 128,
    seed: int = 0,
    out_dir: Path | str | None = None,
    distribution: LatentPairDistribution | None = None,
    hidden: int = 64,
    lr: float = 3e-3,
    eval_batches: int = 4,
    registry=None,
    num_threads: int | None = 1,
) -> dict[str, Any]:
    """Train a pair of tiny encoders per similarity on :class:`LatentPairDistribution` samples
    with symmetric InfoNCE, then score each against the true PMI on held-out batches.

    similarities: entries for :func:`parse_entries` (None: :data:`DEFAULT_SIMILARITIES`: dot,
                  cosine_mean, wpse gaussian, wpse imq, kme). Any registered similarity name
                  works, built through the registry like a recipe's ``similarity`` slot.
    embed_dim:    d, the dimension of every point (the "small dimension").
    points:       M, points per input for entries that do not fix their own (the default ``dot``
                  entry fixes 1: CLIP).
    steps, batch_size, lr: Adam steps on fresh joint samples of ``batch_size`` pairs.
    eval_batches: held-out batches of ``batch_size`` pairs (a fresh stream) the metrics use.
    seed:         seeds the data streams, WPSE's random features and the encoders' init; every
                  entry sees the same training and held-out samples. Same seed, same numbers.
    distribution: the task (default ``LatentPairDistribution()``: K = 8, dx = dy = 8, its own
                  fixed seed, so ``seed`` varies the training run, not the task).
    out_dir:      if given, writes pmi_fidelity.json, pmi_fidelity.md, pmi_fidelity.png there.
    registry:     default :func:`clipkit.contract.registry.default_registry`.
    num_threads:  torch CPU threads while training (restored after; None = leave as is). One is the
                  default: at these sizes thread synchronisation costs more than it saves (several
                  times slower on a busy machine), and one thread gives the same bits everywhere.

    Returns {"config", "distribution", "reference", "results": [per entry, ranked], "ranking",
    "ranking_by_infonce_gap"}. Ranking: Pearson correlation with the true PMI (descending), ties
    broken by RMSE; each result also carries ``rank_infonce_gap`` (lowest held-out InfoNCE gap
    first: the population-loss view of seed 003 Thm 3).
    """
    from clipkit.contract.registry import default_registry

    registry = default_registry() if registry is None else registry
    distribution = LatentPairDistribution() if distribution is None else distribution
    entries = parse_entries(similarities, points)
    training = Training(embed_dim, steps, batch_size, seed, hidden, lr)
    held_out = _held_out_batches(distribution, eval_batches, batch_size, seed)
    true_pmi = [distribution.pmi(x, y) for x, y in held_out]
    reference = _reference(distribution, true_pmi, batch_size, seed)
    results, scatters = [], {}
    for entry in entries:
        with torch.random.fork_rng(devices=[]), _torch_threads(num_threads):
            torch.manual_seed(seed)  # same init stream for every entry, independent of order
            result, scatters[entry.label] = _train_and_score(
                entry, registry, distribution, held_out, true_pmi, training
            )
        results.append(result)
    _rank(results)
    config = {"similarities": [_entry_config(entry) for entry in entries], "embed_dim": embed_dim,
              "points": points, "steps": steps, "batch_size": batch_size, "seed": seed, "hidden": hidden,
              "lr": lr, "eval_batches": eval_batches}  # fmt: skip
    report = {
        "config": config,
        "distribution": distribution.config,
        "reference": reference,
        "results": results,
        "ranking": [r["label"] for r in results],
        "ranking_by_infonce_gap": [r["label"] for r in sorted(results, key=lambda r: r["rank_infonce_gap"])],
    }
    if out_dir is not None:
        write_report(report, scatters, Path(out_dir))
    return report


def _reference(
    distribution: LatentPairDistribution, true_pmi: list[Tensor], batch_size: int, seed: int
) -> dict[str, float]:
    """The numbers every entry is read against: the true PMI's own loss, a constant's, I(X; Y)."""
    every_pmi = torch.cat(true_pmi)
    return {
        "infonce_true_pmi": _mean(float(infonce(pmi)) for pmi in true_pmi),
        "infonce_log_batch": math.log(batch_size),  # the loss of a constant similarity
        "mutual_information": distribution.mutual_information(20_000, torch.Generator().manual_seed(seed)),
        "pmi_std": pmi_fidelity(torch.zeros_like(every_pmi), every_pmi)["true_std"],
    }


def _rank(results: list[dict[str, Any]]) -> None:
    """Sort ``results`` by Pearson (ties: RMSE) and number them; also rank by the InfoNCE gap."""
    for rank, result in enumerate(sorted(results, key=lambda r: r["infonce_gap"]), start=1):
        result["rank_infonce_gap"] = rank  # a second view: the population-loss criterion (seed 003 Thm 3)
    results.sort(key=lambda r: (-r["pearson"], r["rmse"]))
    for rank, result in enumerate(results, start=1):
        result["rank"] = rank


def _entry_config(entry: BenchmarkEntry) -> dict[str, Any]:
    return {**entry.config, "label": entry.label, "points": entry.points, "weighted": entry.weighted}


@contextlib.contextmanager
def _torch_threads(count: int | None):
    """Run the block with ``count`` torch CPU threads, restoring the previous number after."""
    if count is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train_study_model(recipe: dict, registry) -> tuple[Any, list[float]]:
    """Train ``recipe`` through clipkit's one loop in a scratch run directory; returns the plain
    trained model and the per-step training losses (from the run's metrics.jsonl)."""
    import tempfile

    from clipkit.app.api import train_in_process

    with tempfile.TemporaryDirectory(prefix="clipkit-pmi-") as run_dir:
        model = train_in_process(recipe, Path(run_dir), registry)
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return model, [float(json.loads(line)["loss"]) for line in lines]


def _held_out_batches(
    distribution: LatentPairDistribution, count: int, batch_size: int, seed: int
) -> list[tuple[Tensor, Tensor]]:
    """``count`` fresh joint batches (x [B, dx], y [B, dy]) from a stream distinct from training's."""
    generator = torch.Generator().manual_seed(seed + HELD_OUT_SEED_OFFSET)
    return [distribution.sample_pairs(batch_size, generator)[:2] for _ in range(count)]


def entry_recipe(entry: BenchmarkEntry, distribution: LatentPairDistribution, training: Training) -> dict:
    """The recipe one entry trains: ``point_set_mlp`` towers on the ``pmi_pairs`` stream, InfoNCE."""
    x_dim, y_dim = distribution.means_x.shape[1], distribution.means_y.shape[1]
    tower = {"name": "point_set_mlp", "points": entry.points, "weighted": entry.weighted}
    tower["hidden"] = training.hidden
    steps = training.steps
    return {
        "name": f"pmi-fidelity/{entry.label}",
        "seed": training.seed,
        "data": {"stream": study_stream(distribution), "batch_size": training.batch_size},
        "model": {
            "pair": "vectors",
            "embed_dim": training.embed_dim,
            "image_encoder": {**tower, "in_dim": x_dim},
            "text_encoder": {**tower, "in_dim": y_dim},
        },
        "similarity": entry.config,
        "loss": {"name": "infonce"},
        "optimizer": {"name": "adam", "lr": training.lr},
        "schedule": {"name": "constant"},
        "train": {"steps": steps, "log_every": 1, "checkpoint_every": steps, "keep_checkpoints": 1},
    }


def _held_out_logits(model, held_out: list[tuple[Tensor, Tensor]], seed: int) -> tuple[list, nn.ModuleList]:
    """The trained similarity's logits on each held-out batch, and the modules that made them."""
    encode_x, encode_y, similarity = model.image_encoder, model.text_encoder, model.similarity
    modules = nn.ModuleList([encode_x, encode_y, similarity])
    modules.eval()
    learned = []
    with torch.no_grad():
        for x, y in held_out:
            # A fixed feature seed makes the similarity one deterministic function (WPSE evaluation, §2).
            logits = similarity(encode_x(x), encode_y(y), generator=torch.Generator().manual_seed(seed))
            learned.append(logits)
    return learned, modules


def _train_and_score(
    entry: BenchmarkEntry,
    registry,
    distribution: LatentPairDistribution,
    held_out: list[tuple[Tensor, Tensor]],
    true_pmi: list[Tensor],
    training: Training,
) -> tuple[dict[str, Any], tuple[Tensor, Tensor]]:
    """Train one entry; returns (metrics, (learned, true) flattened held-out values for plots)."""
    started = time.perf_counter()
    model, losses = train_study_model(entry_recipe(entry, distribution, training), registry)
    train_seconds = time.perf_counter() - started
    learned, modules = _held_out_logits(model, held_out, training.seed)
    fidelity = pmi_fidelity(torch.cat([l.i2t for l in learned]), torch.cat(true_pmi))  # noqa: E741
    held_out_loss = _mean(float(infonce(l.i2t, l.t2i)) for l in learned)  # noqa: E741
    gap = _mean(infonce_gap(l, pmi) for l, pmi in zip(learned, true_pmi, strict=True))  # noqa: E741
    tail = losses[-max(1, training.steps // 10) :]
    similarity = model.similarity
    result = {
        "label": entry.label,
        "name": entry.config["name"],
        "points": entry.points,
        "weighted": entry.weighted,
        "pearson": fidelity["pearson"],
        "rmse": fidelity["rmse"],
        "sup_error": fidelity["sup_error"],
        "shift": fidelity["shift"],
        "infonce": held_out_loss,
        "infonce_gap": gap,
        "train_loss": _mean(tail),
        "parameters": sum(p.numel() for p in modules.parameters()),
        "train_seconds": train_seconds,
        "similarity_metrics": {k: float(v) for k, v in getattr(similarity, "metrics", dict)().items()},
    }
    learned_flat = torch.cat([l.i2t.flatten() for l in learned]).double() + fidelity["shift"]  # noqa: E741
    return result, (learned_flat, torch.cat([p.flatten() for p in true_pmi]))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
