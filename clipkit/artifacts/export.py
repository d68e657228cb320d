"""`clipkit export`: a run -> ``model.safetensors`` + self-describing ``clipkit.json`` (the writer;
reading an export is :mod:`clipkit.artifacts.reader`'s, which imports no training code).

The JSON names every plugin by its registered name with its arguments, the plugin's
distribution and version, the preprocessing, the tokenizer and the fixed random-feature
seed evaluation uses, plus the resolved recipe — enough to rebuild the model with no
access to the run — and the sha256 of the weights (``files``), checked on load unless
``--no-verify``. ``clipkit eval`` reads only this directory; every way it can be damaged is
reported as an :class:`~clipkit.errors.ArtifactError` naming the file.

Every path an export names stays inside it (:func:`clipkit.artifacts.integrity.contained`: resolved, symlinks
followed): a ``files`` entry or a plugin file argument leading out (``../../etc/passwd``) is refused
by name before anything is read. Files a plugin needs (a WordPiece ``vocab.txt``; the tokenizer's
``export_files``) are copied into the export as ``tokenizer-<argument>`` and checksummed with the
weights; the exported recipe names the copy, except for the arguments the tokenizer lists in
``named_files`` (a packaged vocabulary's name, e.g. ``minilm``, which the tokenizer resolves to the
carried copy while an export is read), so an export reads without the package.
"""

from __future__ import annotations

import copy
import json
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

from clipkit import __version__
from clipkit.artifacts.files import one_line, read_yaml_mapping
from clipkit.artifacts.integrity import describe_files
from clipkit.artifacts.io import Kept, OutputKind, atomic_directory, claim_output_directory, tensor_bytes
from clipkit.artifacts.reader import FORMAT, METADATA, MODEL_SLOTS, WEIGHTS
from clipkit.config.dotted import get_path
from clipkit.config.recipe import SLOTS, section, validate_or_raise
from clipkit.contract.manager import plugin_distribution
from clipkit.contract.registry import Registry
from clipkit.errors import ArtifactError, ClipkitError
from clipkit.model import ContrastiveModel, build_model, parameters_not_initialised
from clipkit.train.checkpoint import STATE, latest_checkpoint, load_checkpoint

#: What an export directory holds: its files and the reports `clipkit eval` writes beside them. A
#: directory of only these is replaced by a new export; one with anything else needs --overwrite.
EXPORT_OUTPUT = OutputKind(
    # recipe.yaml: what `clipkit convert --to clipkit` writes beside the export (a run's own recipe.yaml
    # is protected separately: an export is never written over its run).
    "export",
    (
        WEIGHTS,
        METADATA,
        "tokenizer-*",
        "recipe.yaml",
        "eval.json",
        "eval.md",
        "eval-*.png",
        "eval-*.json",
        "eval-*.md",
        "eval-index.lock",
    ),  # eval-*: `clipkit eval`'s reports, their eval-index.json and its lock
    marker=METADATA,
)


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
            # The eval transform's rule, in open_clip's terms (its preprocess_cfg) and torchvision's.
            "resize_mode": "shortest",
            "crop": "center",
            "equivalent": "torchvision Resize(image_size, BICUBIC, antialias=True) + CenterCrop(image_size) "
            "+ ToTensor() + Normalize(mean, std) on a PIL RGB image",
            "mean": list(model.mean),
            "std": list(model.std),
        },
        "tokenizer": plugins.get("model.tokenizer"),
        "eval_seed": int(recipe.get("eval_seed", 0)),
        "recipe": recipe,
    }


def write_export(
    model: ContrastiveModel,
    recipe: dict,
    out_dir: Path,
    registry: Registry,
    *,
    overwrite: bool = False,
    kept: str = "",
) -> Path:
    """Write weights + metadata into ``out_dir`` atomically (a complete export or none; a full disk
    is one :class:`~clipkit.artifacts.io.DiskFullError` line, nothing left behind). An existing ``out_dir``
    is replaced only when it is empty or an export (``overwrite``: whatever it holds)."""
    from safetensors.torch import save_model

    claim_output_directory(out_dir, EXPORT_OUTPUT, overwrite=overwrite)
    carried = getattr(model.tokenizer, "export_files", dict)()  # e.g. a WordPiece vocab.txt
    named = getattr(model.tokenizer, "named_files", ())  # carried, but the recipe keeps the name
    renamed = [argument for argument in carried if argument not in named]
    if renamed:  # the export holds its own copies: loading reads nothing outside it
        recipe = copy.deepcopy(recipe)
        recipe["model"]["tokenizer"].update({argument: f"tokenizer-{argument}" for argument in renamed})
    metadata = describe(recipe, registry)
    needed = tensor_bytes(model.state_dict()) + len(json.dumps(metadata, default=str))
    with atomic_directory(out_dir, needed=needed, kept=kept) as building:
        # save_model records tied weights instead of refusing them (save_file raises on shared memory).
        save_model(model, str(building / WEIGHTS), metadata={"format": FORMAT})
        for argument, source in carried.items():
            shutil.copyfile(source, building / f"tokenizer-{argument}")
        metadata["files"] = describe_files(building, [WEIGHTS, *(f"tokenizer-{a}" for a in carried)])
        (building / METADATA).write_text(json.dumps(metadata, indent=2, default=str) + "\n", encoding="utf-8")
    return Path(out_dir)


def merged_model(model: ContrastiveModel, recipe: dict) -> tuple[ContrastiveModel, dict]:
    """A model with LoRA adapters folded into plain weights, and its recipe without ``model.lora``
    (the model itself when it has no adapters)."""
    from clipkit.model.lora import has_adapters, merge_adapters, without_adapters

    if not has_adapters(model):
        return model, recipe
    return merge_adapters(model), without_adapters(recipe)


def ema_weights(state: dict, where: Path) -> dict:
    """A checkpoint's model weights with its EMA average in place of the trained parameters."""
    from clipkit.train.ema import STATE_KEY, ema_state_dict

    if state.get(STATE_KEY) is None:
        raise ClipkitError(
            f"{where}: no EMA weights to export (the run had no train.ema); export without --ema"
        )
    return ema_state_dict(state["model"], state[STATE_KEY], str(where))


def export_run(
    run_dir: Path,
    out_dir: Path,
    registry: Registry,
    checkpoint: Path | None = None,
    *,
    overwrite: bool = False,
    ema: bool = False,
    keep_adapters: bool = False,
) -> Path:
    """Export the newest (or a given) checkpoint of a run. ``out_dir`` is checked first (see
    :func:`write_export`); it is never the run directory, a folder holding it or its checkpoints.
    ``ema``: the checkpoint's weight EMA (``train.ema``) instead of the live weights. LoRA adapters
    (``model.lora``) are merged into plain weights unless ``keep_adapters``."""
    run_dir = Path(run_dir)
    if checkpoint is not None and Path(checkpoint).name == STATE and Path(checkpoint).is_file():
        checkpoint = Path(checkpoint).parent  # its state.pt named: the checkpoint is its folder
    protect = [
        Kept(run_dir / "recipe.yaml", "the run's recipe"),
        Kept(run_dir / "checkpoints", "the run's checkpoints"),
    ]
    if checkpoint is not None:
        protect.append(Kept(checkpoint, "the checkpoint being exported"))
    claim_output_directory(out_dir, EXPORT_OUTPUT, overwrite=overwrite, protect=protect)
    recipe_path = run_dir / "recipe.yaml"
    if not recipe_path.is_file():
        raise ClipkitError(f"{run_dir} is not a clipkit run: recipe.yaml is missing")
    path = checkpoint or latest_checkpoint(run_dir)
    if path is None:
        raise ClipkitError(f"{run_dir}: no checkpoint to export (checkpoints/step-*)")
    recipe = read_yaml_mapping(
        recipe_path, "the run's recipe", "restore it from the run's clipkit.json or a backup"
    )
    validate_or_raise(recipe, registry)
    with parameters_not_initialised():  # every parameter is loaded from the checkpoint, strictly
        model = build_model(recipe, registry)
    state = load_checkpoint(path)
    weights = ema_weights(state, Path(path) / STATE) if ema else state["model"]
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:  # a checkpoint of another model than recipe.yaml describes
        raise ArtifactError(
            f"{Path(path) / STATE}: its weights do not fit the model of {recipe_path} ({one_line(error)})"
        ) from error
    if not keep_adapters:
        model, recipe = merged_model(model, recipe)
    again = (" --ema" if ema else "") + (" --keep-adapters" if keep_adapters else "")
    kept = f"the run is intact: export it again with `clipkit export {run_dir} {out_dir}{again}`"
    return write_export(model, recipe, out_dir, registry, overwrite=overwrite, kept=kept)
