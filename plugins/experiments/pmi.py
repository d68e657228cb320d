"""PMI fidelity: how well does a learned similarity approximate the true pointwise mutual information?

METHODS.md §8 ("PMI fidelity"). The InfoNCE-optimal similarity is the pointwise mutual information
up to a constant, g*(x, y) = log p(x, y)/(p(x)p(y)) + C (seed 000 §4.1, Prop. 4.1, which METHODS §8
calls Thm 4.1; seed 003 Thm 1), so on a synthetic pair distribution whose PMI is known in closed
form we can train tiny encoders with each registered similarity and measure the distance between
the learned similarity and PMI.

The data source is the latent-variable model of seed 003 (Assumption 2): a latent z ∈ {0..K−1}
with prior π, and x | z, y | z independent isotropic Gaussians. Then

    exp PMI(x, y) = Σ_z p(z|x) p(z|y) / π_z,

a K-term sum of products (seed 003 §3.1: linear in the posteriors). CLIP's s·u·v must approximate
its logarithm with d-dimensional unit vectors; KME-CLIP's log Σ_ij w_i w'_j k(u_i, v_j) can match
it with M ≥ K well-separated points weighted by the posteriors, up to an error that vanishes as
the bandwidth γ grows (seed 003 Thms 4–5); WPSE's kernel mean approximates PMI itself (seed 000
Thm 5.1). The benchmark measures which gets closest at small d.

Entry point: :func:`run_pmi_benchmark` (CLI: ``clipkit experiment pmi-fidelity``).
"""

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

from clipkit.types import Logits, LossContext, PointSet

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


# --------------------------------------------------------------------------------------------
# The pair distribution
# --------------------------------------------------------------------------------------------


class LatentPairDistribution:
    """z ~ Categorical(π) over K values; x | z ~ N(μx_z, σx² I_dx), y | z ~ N(μy_z, σy² I_dy),
    x ⟂ y | z (seed 003 Assumption 2). Its PMI is closed form (:meth:`pmi`).

    num_latent: K.
    x_dim, y_dim: dx, dy.
    prior:      [K] positive probabilities (normalised here), or None for Zipf π_z ∝ 1/(z+1)
                (non-uniform, so the 1/π_z in exp PMI matters).
    separation: the component means are drawn μ ~ N(0, separation² I) (seeded by ``seed``).
    noise_x, noise_y: σx, σy; separation/noise sets how soft the posteriors p(z|x) are, hence the
                range of the PMI (well-separated components push PMI of mismatched pairs to −∞).
    seed:       seeds the means; the distribution is a pure function of its arguments.

    Parameters are stored in float64; samples are float32 (what encoders train on).
    """

    def __init__(
        self,
        num_latent: int = 8,
        x_dim: int = 8,
        y_dim: int = 8,
        *,
        prior: Sequence[float] | None = None,
        separation: float = 1.0,
        noise_x: float = 1.0,
        noise_y: float = 1.0,
        seed: int = 0,
    ) -> None:
        if num_latent < 1 or x_dim < 1 or y_dim < 1:
            raise ValueError("num_latent, x_dim and y_dim must be >= 1")
        if not (separation > 0 and noise_x > 0 and noise_y > 0):
            raise ValueError("separation, noise_x and noise_y must be > 0")
        if prior is None:
            prior_tensor = 1.0 / torch.arange(1, num_latent + 1, dtype=torch.float64)
        else:
            prior_tensor = torch.as_tensor(list(prior), dtype=torch.float64)
            if prior_tensor.shape != (num_latent,) or not bool((prior_tensor > 0).all()):
                raise ValueError(f"prior must be {num_latent} positive numbers, got {list(prior)}")
        self.prior = prior_tensor / prior_tensor.sum()  # π [K]
        generator = torch.Generator().manual_seed(seed)
        self.means_x = separation * torch.randn(num_latent, x_dim, generator=generator, dtype=torch.float64)
        self.means_y = separation * torch.randn(num_latent, y_dim, generator=generator, dtype=torch.float64)
        self.noise_x, self.noise_y = float(noise_x), float(noise_y)
        self.config = {
            "num_latent": num_latent,
            "x_dim": x_dim,
            "y_dim": y_dim,
            "prior": [float(p) for p in self.prior],
            "separation": float(separation),
            "noise_x": self.noise_x,
            "noise_y": self.noise_y,
            "seed": seed,
        }

    @property
    def num_latent(self) -> int:
        return self.prior.shape[0]

    def sample_latent(self, n: int, generator: torch.Generator) -> Tensor:
        """[n] long latent values z ~ π."""
        return torch.multinomial(self.prior, n, replacement=True, generator=generator)

    def sample_x(self, z: Tensor, generator: torch.Generator) -> Tensor:
        """[n] latents -> [n, dx] float32 x ~ p(x|z)."""
        noise = torch.randn(z.shape[0], self.means_x.shape[1], generator=generator, dtype=torch.float64)
        return (self.means_x[z] + self.noise_x * noise).float()

    def sample_y(self, z: Tensor, generator: torch.Generator) -> Tensor:
        """[n] latents -> [n, dy] float32 y ~ p(y|z)."""
        noise = torch.randn(z.shape[0], self.means_y.shape[1], generator=generator, dtype=torch.float64)
        return (self.means_y[z] + self.noise_y * noise).float()

    def sample_pairs(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """n pairs from the joint p(x, y) -> (x [n, dx], y [n, dy], z [n])."""
        z = self.sample_latent(n, generator)
        return self.sample_x(z, generator), self.sample_y(z, generator), z

    def sample_independent(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """n pairs from the product of marginals p(x)p(y) -> (x [n, dx], y [n, dy])."""
        x = self.sample_x(self.sample_latent(n, generator), generator)
        y = self.sample_y(self.sample_latent(n, generator), generator)
        return x, y

    def log_posterior_x(self, x: Tensor) -> Tensor:
        """[N, dx] -> [N, K] float64 log p(z|x). The Gaussian normalisers are the same for every z
        (shared isotropic σx), so they cancel in the softmax."""
        return _log_posterior(x, self.means_x, self.noise_x, self.prior)

    def log_posterior_y(self, y: Tensor) -> Tensor:
        """[N, dy] -> [N, K] float64 log p(z|y)."""
        return _log_posterior(y, self.means_y, self.noise_y, self.prior)

    def pmi(self, x: Tensor, y: Tensor, *, block_size: int = 1024) -> Tensor:
        """x [Na, dx], y [Nb, dy] -> [Na, Nb] float64 PMI(x_a, y_b) = log p(x, y)/(p(x) p(y))
        = lse_z( log p(z|x) + log p(z|y) − log π_z ), row blocks of ``block_size`` (memory
        O(block·Nb·K))."""
        log_x, log_y = self.log_posterior_x(x), self.log_posterior_y(y)
        log_y = log_y - self.prior.log()  # fold 1/π_z into one side
        rows = [
            torch.logsumexp(log_x[start : start + block_size, None, :] + log_y[None, :, :], dim=-1)
            for start in range(0, log_x.shape[0], block_size)
        ]
        return torch.cat(rows) if rows else log_x.new_zeros(0, log_y.shape[0])

    def pmi_paired(self, x: Tensor, y: Tensor) -> Tensor:
        """x [N, dx], y [N, dy] -> [N] float64 PMI(x_i, y_i) (the diagonal of :meth:`pmi`)."""
        log_x, log_y = self.log_posterior_x(x), self.log_posterior_y(y)
        return torch.logsumexp(log_x + log_y - self.prior.log(), dim=-1)

    def mutual_information(self, n: int, generator: torch.Generator) -> float:
        """Monte Carlo I(X; Y) = E_{p(x,y)} PMI(x, y) over n joint pairs (nats; ≤ H(Z))."""
        x, y, _ = self.sample_pairs(n, generator)
        return float(self.pmi_paired(x, y).mean())


def _log_posterior(v: Tensor, means: Tensor, noise: float, prior: Tensor) -> Tensor:
    """[N, D] points, [K, D] means -> [N, K] log p(z|v) for v | z ~ N(means_z, noise² I)."""
    # Exact differences, not cdist's |v|² + |μ|² − 2v·μ shortcut (cancellation far from the means).
    squared = (v.to(torch.float64)[:, None, :] - means[None, :, :]).square().sum(dim=-1)  # [N, K]
    return torch.log_softmax(prior.log() - squared / (2 * noise**2), dim=-1)


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def pmi_fidelity(learned: Tensor, true: Tensor) -> dict[str, float]:
    """Distance between a learned similarity and the true PMI on the same pairs.

    learned, true: same shape (e.g. [N, N] logits and PMI of a held-out batch). The similarity is
    defined up to a constant (InfoNCE cannot see one), so ``learned`` is first shifted by the
    best constant c = mean(true − learned) (the least-squares shift).
    Returns pearson (correlation, shift- and scale-free), rmse (after the shift; in nats),
    shift (c), and true_std (the PMI's standard deviation: the RMSE of the best constant predictor).
    """
    if learned.shape != true.shape:
        raise ValueError(f"learned {tuple(learned.shape)} and true {tuple(true.shape)} differ in shape")
    a, b = learned.detach().double().flatten(), true.detach().double().flatten()
    if a.numel() < 2 or not bool(torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ValueError("pmi_fidelity needs at least 2 finite values on both sides")
    shift = (b - a).mean()
    residual = a + shift - b
    a_centered, b_centered = a - a.mean(), b - b.mean()
    denominator = a_centered.norm() * b_centered.norm()
    pearson = float((a_centered @ b_centered) / denominator) if float(denominator) > 0 else 0.0
    return {
        "pearson": pearson,
        "rmse": float(residual.square().mean().sqrt()),
        "shift": float(shift),
        "true_std": float(b_centered.square().mean().sqrt()),
    }


def infonce(i2t: Tensor, t2i: Tensor | None = None) -> Tensor:
    """Symmetric CLIP loss (METHODS §1) of [N, N] logits whose positives are the diagonal:
    ½ [ mean_a CE(L[a, :], a) + mean_b CE(L_t2i[b, :], b) ], t2i = i2t.T unless given — the
    registered ``infonce`` loss itself, so the study scores with what it trains with."""
    from clipkit.plugins.losses.infonce import InfoNCE

    logits = Logits(i2t=i2t, t2i=i2t.t() if t2i is None else t2i)
    return InfoNCE()(logits, torch.arange(i2t.shape[0], device=i2t.device), LossContext()).loss


def infonce_gap(learned: Tensor | Logits, true_pmi: Tensor) -> float:
    """InfoNCE(learned logits) − InfoNCE(true PMI logits) on the same held-out batch (≥ 0 in
    expectation: PMI + const minimises the expected InfoNCE at every batch size)."""
    learned_loss = infonce(learned.i2t, learned.t2i) if isinstance(learned, Logits) else infonce(learned)
    return float(learned_loss.double() - infonce(true_pmi.double()))


# --------------------------------------------------------------------------------------------
# Tiny encoders
# --------------------------------------------------------------------------------------------


class PointSetMLP(nn.Module):
    """A vector [B, in_dim] -> PointSet of M unit points in R^d (and M positive weights).

    Two hidden GELU layers of width ``hidden``; the output layer emits M·d point coordinates
    (each row L2-normalised) plus, if ``weighted``, M weights w = softplus(·) + 1e-6 (the floor
    keeps log w finite for KME's log-weights, METHODS §3).
    """

    def __init__(self, in_dim: int, embed_dim: int, points: int, *, weighted: bool, hidden: int = 64):
        super().__init__()
        if points < 1 or embed_dim < 1:
            raise ValueError("points and embed_dim must be >= 1")
        self.embed_dim, self.points, self.weighted = embed_dim, points, weighted
        outputs = points * embed_dim + (points if weighted else 0)
        self.body = nn.Sequential(
            nn.Linear(in_dim, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, outputs),
        )

    def forward(self, x: Tensor) -> PointSet:
        """[B, in_dim] -> PointSet(points [B, M, d], weights [B, M] or None)."""
        out = self.body(x)
        count = self.points * self.embed_dim
        points = nn.functional.normalize(out[:, :count].view(-1, self.points, self.embed_dim), dim=-1)
        weights = nn.functional.softplus(out[:, count:]) + 1e-6 if self.weighted else None
        return PointSet(points, weights)


@dataclass
class BenchmarkEntry:
    """One similarity of the benchmark: registry config + how its encoders look."""

    label: str
    config: dict[str, Any]  # {"name": registered similarity, **factory kwargs}
    points: int
    weighted: bool


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


def point_set_mlp(*, embed_dim: int, in_dim: int, points: int = 8, weighted: bool = False, hidden: int = 64):
    """The ``point_set_mlp`` encoder: :class:`PointSetMLP` for ``model.pair: vectors`` recipes."""
    return PointSetMLP(in_dim, embed_dim, points, weighted=weighted, hidden=hidden)


class LatentPairStream:
    """The ``pmi_pairs`` stream: every batch is ``batch_size`` fresh joint samples of a
    :class:`LatentPairDistribution` (``batch["x"]`` [B, dx], ``batch["y"]`` [B, dy]).

    seed:               the sample stream (the run's seed; rank r > 0 draws from its own stream).
    distribution_seed:  the task's means (LatentPairDistribution's ``seed``); the other keys are
                        the distribution's own arguments.
    samples_per_epoch:  the nominal epoch (sample ids are counted modulo it; nothing repeats).

    ``position`` is the number of batches drawn; ``restore`` replays that many, so a resumed run
    sees the batches an uninterrupted one would.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        num_latent: int = 8,
        x_dim: int = 8,
        y_dim: int = 8,
        prior: list | None = None,
        separation: float = 1.0,
        noise_x: float = 1.0,
        noise_y: float = 1.0,
        distribution_seed: int = 0,
        samples_per_epoch: int = 65_536,
    ) -> None:
        self.distribution = LatentPairDistribution(
            num_latent, x_dim, y_dim, prior=prior, separation=separation, noise_x=noise_x,
            noise_y=noise_y, seed=distribution_seed,
        )  # fmt: skip
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.num_samples = samples_per_epoch
        self._restart(0)

    def _restart(self, batches: int) -> None:
        # Rank 0 draws from ``seed`` itself, so one process sees the stream the study documents.
        self.generator = torch.Generator().manual_seed(self.seed + 7_919 * self.rank)
        self.drawn = 0
        for _ in range(batches):
            next(self)

    @property
    def epoch(self) -> int:
        return self.drawn * self.batch_size * self.world_size // self.num_samples

    @property
    def batch_in_epoch(self) -> int:
        per_epoch = max(1, self.num_samples // (self.batch_size * self.world_size))
        return self.drawn % per_epoch

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, Tensor]:
        x, y, _ = self.distribution.sample_pairs(self.batch_size, self.generator)
        first = (self.drawn * self.world_size + self.rank) * self.batch_size
        self.drawn += 1
        index = torch.arange(first, first + self.batch_size) % self.num_samples
        return {"x": x, "y": y, "index": index}

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "batches": self.drawn}

    def restore(self, position: dict[str, int]) -> None:
        self._restart(int(position["batches"]))


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------


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
    registry:     default :func:`clipkit.registry.default_registry`.
    num_threads:  torch CPU threads while training (restored after; None = leave as is). One is the
                  default: at these sizes thread synchronisation costs more than it saves (several
                  times slower on a busy machine), and one thread gives the same bits everywhere.

    Returns {"config", "distribution", "reference", "results": [per entry, ranked], "ranking",
    "ranking_by_infonce_gap"}. Ranking: Pearson correlation with the true PMI (descending), ties
    broken by RMSE; each result also carries ``rank_infonce_gap`` (lowest held-out InfoNCE gap
    first: the population-loss view of seed 003 Thm 3).
    """
    from clipkit.registry import default_registry

    registry = default_registry() if registry is None else registry
    distribution = LatentPairDistribution() if distribution is None else distribution
    entries = parse_entries(similarities, points)
    held_out = _held_out_batches(distribution, eval_batches, batch_size, seed)
    true_pmi = [distribution.pmi(x, y) for x, y in held_out]
    reference = {
        "infonce_true_pmi": _mean(float(infonce(pmi)) for pmi in true_pmi),
        "infonce_log_batch": math.log(batch_size),  # the loss of a constant similarity
        "mutual_information": distribution.mutual_information(20_000, torch.Generator().manual_seed(seed)),
        "pmi_std": pmi_fidelity(torch.zeros_like(torch.cat(true_pmi)), torch.cat(true_pmi))["true_std"],
    }
    results = []
    for entry in entries:
        with torch.random.fork_rng(devices=[]), _torch_threads(num_threads):
            torch.manual_seed(seed)  # same init stream for every entry, independent of order
            result, scatter = _train_and_score(
                entry,
                registry,
                distribution,
                held_out,
                true_pmi,
                embed_dim=embed_dim,
                steps=steps,
                batch_size=batch_size,
                seed=seed,
                hidden=hidden,
                lr=lr,
            )
        result["_scatter"] = scatter
        results.append(result)
    for rank, result in enumerate(sorted(results, key=lambda r: r["infonce_gap"]), start=1):
        result["rank_infonce_gap"] = rank  # a second view: the population-loss criterion (seed 003 Thm 3)
    results.sort(key=lambda r: (-r["pearson"], r["rmse"]))
    for rank, result in enumerate(results, start=1):
        result["rank"] = rank
    scatters = {r["label"]: r.pop("_scatter") for r in results}
    report = {
        "config": {
            "similarities": [
                {**e.config, "label": e.label, "points": e.points, "weighted": e.weighted} for e in entries
            ],
            "embed_dim": embed_dim,
            "points": points,
            "steps": steps,
            "batch_size": batch_size,
            "seed": seed,
            "hidden": hidden,
            "lr": lr,
            "eval_batches": eval_batches,
        },
        "distribution": distribution.config,
        "reference": reference,
        "results": results,
        "ranking": [r["label"] for r in results],
        "ranking_by_infonce_gap": [r["label"] for r in sorted(results, key=lambda r: r["rank_infonce_gap"])],
    }
    if out_dir is not None:
        write_report(report, scatters, Path(out_dir))
    return report


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


def study_stream(distribution: LatentPairDistribution) -> dict[str, Any]:
    """The recipe's ``data.stream`` that samples ``distribution`` (its config, seed renamed)."""
    config = dict(distribution.config)
    distribution_seed = config.pop("seed")
    return {"name": "pmi_pairs", **config, "distribution_seed": distribution_seed}


def train_study_model(recipe: dict, registry) -> tuple[Any, list[float]]:
    """Train ``recipe`` through clipkit's one loop in a scratch run directory; returns the plain
    trained model and the per-step training losses (from the run's metrics.jsonl)."""
    import tempfile

    from clipkit.api import train_in_process

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


def _train_and_score(
    entry: BenchmarkEntry,
    registry,
    distribution: LatentPairDistribution,
    held_out: list[tuple[Tensor, Tensor]],
    true_pmi: list[Tensor],
    *,
    embed_dim: int,
    steps: int,
    batch_size: int,
    seed: int,
    hidden: int,
    lr: float,
) -> tuple[dict[str, Any], tuple[Tensor, Tensor]]:
    """Train one entry; returns (metrics, (learned, true) flattened held-out values for plots)."""
    x_dim, y_dim = distribution.means_x.shape[1], distribution.means_y.shape[1]
    tower = {"name": "point_set_mlp", "points": entry.points, "weighted": entry.weighted, "hidden": hidden}
    recipe = {
        "name": f"pmi-fidelity/{entry.label}",
        "seed": seed,
        "data": {"stream": study_stream(distribution), "batch_size": batch_size},
        "model": {
            "pair": "vectors",
            "embed_dim": embed_dim,
            "image_encoder": {**tower, "in_dim": x_dim},
            "text_encoder": {**tower, "in_dim": y_dim},
        },
        "similarity": entry.config,
        "loss": {"name": "infonce"},
        "optimizer": {"name": "adam", "lr": lr},
        "schedule": {"name": "constant"},
        "train": {"steps": steps, "log_every": 1, "checkpoint_every": steps, "keep_checkpoints": 1},
    }
    started = time.perf_counter()
    model, losses = train_study_model(recipe, registry)
    train_seconds = time.perf_counter() - started
    encode_x, encode_y, similarity = model.image_encoder, model.text_encoder, model.similarity
    modules = nn.ModuleList([encode_x, encode_y, similarity])
    modules.eval()
    learned = []
    with torch.no_grad():
        for x, y in held_out:
            # A fixed feature seed makes the similarity one deterministic function (WPSE evaluation, §2).
            logits = similarity(encode_x(x), encode_y(y), generator=torch.Generator().manual_seed(seed))
            learned.append(logits)
    fidelity = pmi_fidelity(torch.cat([l.i2t for l in learned]), torch.cat(true_pmi))  # noqa: E741
    held_out_loss = _mean(float(infonce(l.i2t, l.t2i)) for l in learned)  # noqa: E741
    gap = _mean(infonce_gap(l, pmi) for l, pmi in zip(learned, true_pmi, strict=True))  # noqa: E741
    tail = losses[-max(1, steps // 10) :]
    result = {
        "label": entry.label,
        "name": entry.config["name"],
        "points": entry.points,
        "weighted": entry.weighted,
        "pearson": fidelity["pearson"],
        "rmse": fidelity["rmse"],
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


# --------------------------------------------------------------------------------------------
# Report files
# --------------------------------------------------------------------------------------------


def markdown_table(report: dict[str, Any]) -> str:
    """The ranked results as a Markdown table (plus the reference numbers)."""
    config, reference = report["config"], report["reference"]
    lines = [
        f"PMI fidelity at embed_dim = {config['embed_dim']} ({config['steps']} steps, batch "
        f"{config['batch_size']}, seed {config['seed']}; "
        f"K = {report['distribution']['num_latent']} latents).",
        "",
        "| rank | similarity | M | Pearson r ↑ | RMSE (nats) ↓ | InfoNCE gap ↓ (rank) | held-out InfoNCE "
        "| params |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['rank']} | {r['label']} | {r['points']} | {r['pearson']:.4f} | {r['rmse']:.4f} | "
            f"{r['infonce_gap']:.4f} ({r['rank_infonce_gap']}) | {r['infonce']:.4f} | {r['parameters']} |"
        )
    lines += [
        "",
        f"Reference: InfoNCE of the true PMI {reference['infonce_true_pmi']:.4f}, of a constant similarity "
        f"log B = {reference['infonce_log_batch']:.4f}; std of the true PMI (RMSE of the best constant) "
        f"{reference['pmi_std']:.4f}; I(X; Y) ≈ {reference['mutual_information']:.4f} nats.",
        "",
    ]
    return "\n".join(lines)


def write_report(report: dict[str, Any], scatters: dict[str, tuple[Tensor, Tensor]], out_dir: Path) -> None:
    """pmi_fidelity.json, pmi_fidelity.md, pmi_fidelity.png in ``out_dir``, each written atomically."""
    from clipkit.io import atomic_path, atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "pmi_fidelity.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(out_dir / "pmi_fidelity.md", markdown_table(report))
    with atomic_path(out_dir / "pmi_fidelity.png") as temporary:
        _plot_scatters(report, scatters, temporary)


def _plot_scatters(report: dict[str, Any], scatters: dict[str, tuple[Tensor, Tensor]], path: Path) -> None:
    """One panel per similarity: learned (shifted by its best constant) against true PMI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(report["results"])
    columns = min(count, 3)
    rows = math.ceil(count / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 4 * rows), squeeze=False)
    for axis in axes.flat[count:]:
        axis.set_visible(False)
    every = torch.Generator().manual_seed(0)
    for axis, result in zip(axes.flat, report["results"], strict=False):
        learned, true = scatters[result["label"]]
        keep = torch.randperm(true.numel(), generator=every)[:4000]  # a readable, deterministic subsample
        axis.scatter(true[keep].numpy(), learned[keep].numpy(), s=2, alpha=0.3)
        low, high = float(true.min()), float(true.max())
        axis.plot([low, high], [low, high], color="black", linewidth=1)
        axis.set_title(
            f"#{result['rank']} {result['label']}\nr = {result['pearson']:.3f}, RMSE = {result['rmse']:.3f}",
            fontsize=10,
        )
        axis.set_xlabel("true PMI")
        axis.set_ylabel("learned similarity + best constant")
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=80)
    plt.close(figure)
