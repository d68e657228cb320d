"""`clipkit export`: a run -> ``model.safetensors`` + self-describing ``clipkit.json``.

The JSON names every plugin by its registered name with its arguments, the plugin's
distribution and version, the preprocessing, the tokenizer and the fixed random-feature
seed evaluation uses, plus the resolved recipe — enough to rebuild the model with no
access to the run. ``clipkit eval`` reads only this directory.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch

from clipkit import __version__
from clipkit.errors import ClipkitError
from clipkit.io import atomic_directory
from clipkit.manager import plugin_distribution
from clipkit.model import ContrastiveModel, build_model
from clipkit.recipe import SLOTS, get_path, section, validate_or_raise
from clipkit.registry import Registry
from clipkit.train.checkpoint import latest_checkpoint, load_checkpoint

FORMAT = "clipkit-export/1"
WEIGHTS = "model.safetensors"
METADATA = "clipkit.json"
MODEL_SLOTS = ("model.image_encoder", "model.text_encoder", "model.tokenizer", "similarity")


def describe(recipe: dict, registry: Registry) -> dict[str, Any]:
    """The self-describing metadata of an export."""
    model = section(recipe, "model")
    plugins = {}
    for slot in SLOTS:
        if slot.path not in MODEL_SLOTS:
            continue
        config = get_path(recipe, slot.path)
        if config is None:
            continue
        entry = registry.get(slot.kind, config["name"])
        distribution, version = plugin_distribution(registry.pm, registry.pm.get_plugin(entry.plugin))
        plugins[slot.path] = {
            "kind": slot.kind,
            "name": entry.name,
            "kwargs": {k: v for k, v in config.items() if k != "name"},
            "plugin": entry.plugin,
            "distribution": distribution,
            "version": version,
        }
    return {
        "format": FORMAT,
        "clipkit_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "plugins": plugins,
        "model": {"embed_dim": model.embed_dim, "image_size": model.image_size, "pair": model.pair},
        "preprocessing": {
            "image_size": model.image_size,
            "resize": "bicubic",
            "mean": list(model.mean),
            "std": list(model.std),
        },
        "tokenizer": plugins.get("model.tokenizer"),
        "eval_seed": int(recipe.get("eval_seed", 0)),
        "recipe": recipe,
    }


def write_export(model: ContrastiveModel, recipe: dict, out_dir: Path, registry: Registry) -> Path:
    """Write weights + metadata into ``out_dir`` atomically (a complete export or none)."""
    from safetensors.torch import save_model

    metadata = describe(recipe, registry)
    with atomic_directory(out_dir) as building:
        # save_model records tied weights instead of refusing them (save_file raises on shared memory).
        save_model(model, str(building / WEIGHTS), metadata={"format": FORMAT})
        (building / METADATA).write_text(json.dumps(metadata, indent=2, default=str) + "\n", encoding="utf-8")
    return Path(out_dir)


def export_run(run_dir: Path, out_dir: Path, registry: Registry, checkpoint: Path | None = None) -> Path:
    """Export the newest (or a given) checkpoint of a run."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    recipe_path = run_dir / "recipe.yaml"
    if not recipe_path.is_file():
        raise ClipkitError(f"{run_dir} is not a clipkit run: recipe.yaml is missing")
    path = checkpoint or latest_checkpoint(run_dir)
    if path is None:
        raise ClipkitError(f"{run_dir}: no checkpoint to export (checkpoints/step-*.pt)")
    recipe = OmegaConf.to_container(OmegaConf.load(recipe_path))
    validate_or_raise(recipe, registry)
    model = build_model(recipe, registry)
    model.load_state_dict(load_checkpoint(path)["model"])
    return write_export(model, recipe, out_dir, registry)


def read_metadata(export_dir: Path) -> dict[str, Any]:
    path = Path(export_dir) / METADATA
    if not path.is_file():
        raise ClipkitError(f"{export_dir} is not a clipkit export: {METADATA} is missing")
    metadata = json.loads(path.read_text(encoding="utf-8"))
    if metadata.get("format") != FORMAT:
        raise ClipkitError(
            f"{path}: unsupported export format {metadata.get('format')!r} (expected {FORMAT})"
        )
    return metadata


def load_export(export_dir: Path, registry: Registry) -> tuple[ContrastiveModel, dict[str, Any]]:
    """Rebuild the model from ``clipkit.json`` and load its weights (strict), in eval mode."""
    from safetensors.torch import load_model

    metadata = read_metadata(export_dir)
    recipe = metadata["recipe"]
    missing = [
        f"{slot}: {info['kind']} {info['name']!r} (from {info['distribution']} {info['version']})"
        for slot, info in metadata["plugins"].items()
        if info["name"] not in registry.names(info["kind"])
    ]
    if missing:
        raise ClipkitError(f"{export_dir} needs plugins that are not installed: " + "; ".join(missing))
    model = build_model(recipe, registry)
    load_model(model, str(Path(export_dir) / WEIGHTS), strict=True)
    return model.eval(), metadata


def load_model(
    path: Path, registry: Registry, *, options: dict | None = None
) -> tuple[ContrastiveModel, dict]:
    """Any model clipkit reads -> (model in eval mode, export-style metadata): a clipkit export as
    it is, any other layout through the ``read_model`` hook (the built-in interop plugin reads
    open_clip and Hugging Face CLIP directories and OpenAI-layout ``.safetensors`` state dicts)."""
    path = Path(path)
    if not path.exists():
        raise ClipkitError(f"{path} does not exist")
    if (path / METADATA).is_file():
        return load_export(path, registry)
    found = registry.pm.hook.read_model(path=path, registry=registry, options=dict(options or {}))
    if found is None:
        raise ClipkitError(
            f"{path} is not a clipkit export ({METADATA} is missing) and no plugin reads it as a model "
            "(built in: open_clip directories, Hugging Face CLIPModel directories, OpenAI-layout "
            ".safetensors state dicts)"
        )
    return found
