"""`clipkit experiment ...`: studies that need no dataset, registered through ``register_commands``.

- ``pmi-fidelity``: trains tiny encoders with each similarity on a latent-variable pair
  distribution whose PMI is known in closed form, and ranks the similarities by how well the
  learned similarity approximates PMI (METHODS §8; :mod:`clipkit.plugins.experiments.pmi`).
- ``nuclr-synthetic``: NUCLR's Appendix B experiment — solve problem (5) for ζ, compare q̃
  with the true q, and plot generalisation error against n for NUCLR, GCL and MLE
  (METHODS §6; :mod:`clipkit.plugins.experiments.nuclr_synthetic`).

Both write JSON, a Markdown table and a PNG plot into ``--out``. Torch is imported only when a
command runs, so ``clipkit --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from clipkit.app.commands import fails_cleanly
from clipkit.contract.hookspecs import hookimpl
from clipkit.errors import ClipkitError

experiment_app = typer.Typer(
    help="Synthetic studies: PMI fidelity of similarities, NUCLR's Appendix B.", no_args_is_help=True
)


@hookimpl
def register_commands(app):
    app.add_typer(experiment_app, name="experiment")


@hookimpl
def register_encoders(register):
    from clipkit.plugins.experiments import pmi_encoder

    register("point_set_mlp", pmi_encoder.point_set_mlp)  # vector -> point set, for `model.pair: vectors`


@hookimpl
def register_streams(register):
    from clipkit.plugins.experiments import pmi_stream

    register("pmi_pairs", pmi_stream.LatentPairStream)  # fresh joint samples with closed-form PMI


def similarity_specs(items: list[str]) -> list[dict | str] | None:
    """``--similarity`` values: a registered name (``kme``) or a YAML/flow mapping
    (``{name: wpse, kernel: imq, label: wpse-imq}``)."""
    if not items:
        return None
    from omegaconf import OmegaConf

    specs: list[dict | str] = []
    for item in items:
        if not item.lstrip().startswith("{"):
            specs.append(item.strip())
            continue
        try:
            specs.append(OmegaConf.to_container(OmegaConf.create(item)))
        except Exception as error:  # OmegaConf raises several parser error types
            raise ClipkitError(f"--similarity {item!r}: not a mapping ({error})") from None
    return specs


@experiment_app.command("pmi-fidelity")
@fails_cleanly
def pmi_fidelity_command(
    out: Annotated[Path, typer.Option(help="Directory for pmi_fidelity.json, .md and .png")] = Path(
        "experiments/pmi-fidelity"
    ),
    similarity: Annotated[
        list[str],
        typer.Option(help="Similarity to include: a registered name or {name: ..., kwargs} (repeatable)"),
    ] = None,
    embed_dim: Annotated[int, typer.Option(help="Point dimension d (small d is where they differ)")] = 4,
    points: Annotated[int, typer.Option(help="Points per input M for point-set similarities")] = 8,
    steps: Annotated[int, typer.Option(help="Training steps per similarity")] = 300,
    batch_size: Annotated[int, typer.Option(help="Pairs per InfoNCE batch")] = 128,
    seed: Annotated[int, typer.Option(help="First training seed (models, batches, features)")] = 0,
    seeds: Annotated[
        int, typer.Option(help="Training seeds seed … seed+N−1; N ≥ 2 reports mean ± 95 % interval")
    ] = 1,
    topics: Annotated[int, typer.Option(help="Latent topics K of the pair distribution")] = 8,
    separation: Annotated[float, typer.Option(help="Std of the topics' means (noise std is 1)")] = 1.0,
    input_dim: Annotated[int, typer.Option(help="Dimension of the inputs x and y")] = 8,
    task_seed: Annotated[int, typer.Option(help="Seed of the distribution (the task)")] = 0,
    hidden: Annotated[int, typer.Option(help="Hidden width of the tiny encoders")] = 64,
    lr: Annotated[float, typer.Option(help="Adam learning rate")] = 3e-3,
    eval_batches: Annotated[int, typer.Option(help="Held-out batches the metrics use")] = 4,
    kme_init_gamma: Annotated[
        float, typer.Option(help="KME's learnable γ start (recipe default 1/0.07)")
    ] = None,
    kme_max_gamma: Annotated[
        float, typer.Option(help="KME's γ clamp (recipe default 100, CLIP's scale clamp); ≤ 0: none")
    ] = None,
):
    """Rank similarities by how well they learn the true PMI of a synthetic pair distribution."""
    from clipkit.app.commands import registry
    from clipkit.plugins.experiments.pmi import LatentPairDistribution, run_pmi_benchmark
    from clipkit.plugins.experiments.pmi_study import run_pmi_study, study_table, with_kme_gamma

    specs = with_kme_gamma(similarity_specs(similarity or []), kme_init_gamma, kme_max_gamma)
    options = dict(
        embed_dim=embed_dim,
        points=points,
        steps=steps,
        batch_size=batch_size,
        hidden=hidden,
        lr=lr,
        eval_batches=eval_batches,
        registry=registry(),
    )
    try:
        if seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds}")
        if seeds > 1:
            study = run_pmi_study(
                specs,
                seeds=tuple(range(seed, seed + seeds)),
                topics=topics,
                separation=separation,
                input_dim=input_dim,
                task_seed=task_seed,
                out_dir=out,
                **options,
            )
            typer.echo(study_table(study))
            typer.echo(f"wrote {out}/pmi_study.json, .md, .png ({len(study['summary'])} similarities)")
            return
        distribution = LatentPairDistribution(
            topics, input_dim, input_dim, separation=separation, seed=task_seed
        )
        report = run_pmi_benchmark(specs, seed=seed, out_dir=out, distribution=distribution, **options)
    except ValueError as error:  # bad sizes or similarity specs
        raise ClipkitError(f"pmi-fidelity: {error}") from None
    typer.echo((out / "pmi_fidelity.md").read_text(encoding="utf-8"))
    typer.echo(f"wrote {out}/pmi_fidelity.json, .md, .png ({len(report['results'])} similarities)")


@experiment_app.command("nuclr-synthetic")
@fails_cleanly
def nuclr_synthetic_command(
    out: Annotated[Path, typer.Option(help="Directory for nuclr_synthetic.json, .md and .png")] = Path(
        "experiments/nuclr-synthetic"
    ),
    n: Annotated[list[int], typer.Option(help="Dataset sizes n (repeatable; default 50 … 3200)")] = None,
    seeds: Annotated[int, typer.Option(help="Independent samples per n (mean ± std)")] = 5,
    steps: Annotated[int, typer.Option(help="Gradient-descent steps when solving problem (5) for ζ")] = 500,
    tau: Annotated[float, typer.Option(help="Temperature τ of p(a|o) ∝ exp(o·a/τ)")] = 0.2,
):
    """NUCLR Appendix B: learned popularity q̃ vs the true q, and generalisation error vs n."""
    from clipkit.plugins.experiments.nuclr_synthetic import DEFAULT_NS, run_nuclr_experiment

    try:
        run_nuclr_experiment(out, ns=tuple(n or DEFAULT_NS), seeds=tuple(range(seeds)), tau=tau, steps=steps)
    except ValueError as error:  # bad sizes, seeds or temperature
        raise ClipkitError(f"nuclr-synthetic: {error}") from None
    typer.echo((out / "nuclr_synthetic.md").read_text(encoding="utf-8"))
    typer.echo(f"wrote {out}/nuclr_synthetic.json, .md, .png")


@experiment_app.command("kme-mixture")
@fails_cleanly
def kme_mixture_command(
    out: Annotated[Path, typer.Option(help="Directory for kme_mixture.json, .md and .png")] = Path(
        "experiments/kme-mixture"
    ),
    classes: Annotated[list[int], typer.Option(help="Classes K (repeatable; default 4 8 16 32)")] = None,
    seeds: Annotated[int, typer.Option(help="Training seeds 0 … N−1 per K and similarity (≥ 2 for CIs)")] = 3,
    budget: Annotated[int, typer.Option(help="Learned floats per datapoint, equal for every similarity")] = 8,
    points: Annotated[
        int, typer.Option(help="Points M per datapoint for wpse and kme (M·d + M = budget)")
    ] = 2,
    steps: Annotated[int, typer.Option(help="Adam steps per run")] = 1000,
    batch_size: Annotated[int, typer.Option(help="Joint pairs per InfoNCE batch")] = 256,
    lr: Annotated[float, typer.Option(help="Adam learning rate")] = 0.02,
):
    """Seed 003 §4.2: PMI approximation error of dot (CLIP), wpse and kme vs K on the K-mixture model."""
    import time

    from clipkit.app.commands import registry
    from clipkit.plugins.experiments.kme_mixture import MixtureTraining, run_mixture_study
    from clipkit.plugins.experiments.kme_mixture_report import markdown, write_study

    started = time.process_time()
    training = MixtureTraining(budget=budget, points=points, steps=steps, batch_size=batch_size, lr=lr)
    try:
        if seeds < 1 or steps < 1 or batch_size < 2:
            raise ValueError("--seeds and --steps must be >= 1 and --batch-size >= 2")
        study = run_mixture_study(
            classes=tuple(classes or (4, 8, 16, 32)),
            seeds=tuple(range(seeds)),
            training=training,
            registry=registry(),
            progress=lambda run: typer.echo(
                f"K = {run['classes']} {run['label']} seed {run['seed']}: sup error {run['sup_error']:.3f}, "
                f"RMS {run['rms_error']:.3f}, off-support {run['off_support']:.3f} "
                f"({run['cpu_seconds']:.0f} CPU s)"
            ),
        )
    except ValueError as error:  # bad K, budget or sizes
        raise ClipkitError(f"kme-mixture: {error}") from None
    study["cpu_seconds"] = time.process_time() - started
    write_study(study, out)
    typer.echo(markdown(study))
    typer.echo(f"wrote {out}/kme_mixture.json, .md, .png")


@experiment_app.command("cloob-ablation")
@fails_cleanly
def cloob_ablation_command(
    data: Annotated[str, typer.Option(help="Your image–caption table or shard directory (required)")],
    out: Annotated[
        Path, typer.Option(help="Directory for the runs and cloob_ablation.json, .md, .png")
    ] = Path("experiments/cloob-ablation"),
    label: Annotated[str, typer.Option(help="Column to classify zero-shot on the held-out split")] = None,
    holdout: Annotated[float, typer.Option(help="Share held out (by key hash) for evaluation")] = 0.1,
    arm: Annotated[
        list[str],
        typer.Option(help="Arms (repeatable): infonce, infoloob, infonce_hopfield, cloob; default all"),
    ] = None,
    seeds: Annotated[int, typer.Option(help="Seeds 0 … N−1 per arm (paired across arms)")] = 3,
    steps: Annotated[int, typer.Option(help="Training steps per run")] = 200,
    batch_size: Annotated[int, typer.Option(help="Contrastive batch")] = 256,
    warmup_fraction: Annotated[
        float, typer.Option(help="Warm-up as a share of the steps (paper: 20 000 / 175 584)")
    ] = None,
    beta: Annotated[float, typer.Option(help="Hopfield β, fixed (paper, CC: 8)")] = 8.0,
    inverse_tau: Annotated[float, typer.Option(help="Inverse temperature 1/τ, fixed (paper: 30)")] = 30.0,
    base: Annotated[
        str, typer.Option(help="tiny (CPU: rn_tiny, 64 px) or paper (RN50, 224 px: a GPU)")
    ] = "tiny",
    set_: Annotated[
        list[str], typer.Option("--set", help="Extra recipe override KEY=VALUE (repeatable)")
    ] = None,
):
    """Seed 001 Table 3: {InfoNCE, InfoLOOB} × {Hopfield off, on}, several seeds, on your data."""
    from clipkit.app.commands import registry
    from clipkit.plugins.experiments.cloob_ablation import (
        ARMS,
        PAPER_WARMUP_FRACTION,
        AblationSettings,
        run_ablation,
    )
    from clipkit.plugins.experiments.cloob_ablation_report import markdown

    settings = AblationSettings(
        data=data,
        label=label,
        holdout=holdout,
        steps=steps,
        batch_size=batch_size,
        warmup_fraction=PAPER_WARMUP_FRACTION if warmup_fraction is None else warmup_fraction,
        beta=beta,
        inverse_tau=inverse_tau,
        base=base,
        arms=tuple(arm or ARMS),
        seeds=tuple(range(seeds)),
        overrides=list(set_ or []),
    )
    report = run_ablation(
        settings,
        out,
        registry=registry(),
        progress=lambda run: typer.echo(f"{run['arm']} seed {run['seed']}: {run['cpu_seconds']:.0f} CPU s"),
    )
    typer.echo(markdown(report))
    typer.echo(f"wrote {out}/cloob_ablation.json, .md, .png")
