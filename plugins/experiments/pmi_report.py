"""The PMI-fidelity report: pmi_fidelity.json, a Markdown table and scatter plots of learned
similarity against true PMI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: What each paper claims about PMI fidelity, and on which data process (the reports' headline).
PAPERS_MEASURES = (
    "Each paper's own measure. Seed 000 (WPSE, §5.1 and Thm 5.1): the *uniform* error "
    "sup |s − PMI − C| with the best constant C — a bilinear similarity of dimension d cannot fit a "
    "PMI matrix of rank > d + 1, a kernel similarity of point sets can reach any ε when the PMI is "
    "Lipschitz on a compact support (its Assumption C.2; no synthetic experiment in the paper). "
    "Seed 003 (KME-CLIP, Thm 3): the *population InfoNCE* gap to its minimum, which is small when "
    "exp PMI is approximated, on the latent-variable model of its Assumption 2 — this task "
    "(its sharper K-mixture claim: `clipkit experiment kme-mixture`). Pearson r and RMSE are "
    "clipkit's own summaries, not a paper's.",
    "",
)


def markdown_table(report: dict[str, Any]) -> str:
    """The ranked results as a Markdown table (plus the reference numbers)."""
    config, reference = report["config"], report["reference"]
    lines = [
        f"PMI fidelity at embed_dim = {config['embed_dim']} ({config['steps']} steps, batch "
        f"{config['batch_size']}, seed {config['seed']}; "
        f"K = {report['distribution']['num_latent']} latents).",
        "",
        *PAPERS_MEASURES,
        "| rank | similarity | M | Pearson r ↑ | RMSE (nats) ↓ | sup error (nats; seed 000) ↓ "
        "| InfoNCE gap ↓ (rank; seed 003) | held-out InfoNCE | params |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['rank']} | {r['label']} | {r['points']} | {r['pearson']:.4f} | {r['rmse']:.4f} | "
            f"{r['sup_error']:.4f} | "
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
    from clipkit.artifacts.io import atomic_path, atomic_write_text

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
