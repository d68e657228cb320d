"""`clipkit export`: a run -> ``model.safetensors`` + self-describing ``clipkit.json``.

The JSON names every plugin by its registered name with its arguments, the plugin's
distribution and version, the preprocessing, the tokenizer and the fixed random-feature
seed evaluation uses, plus the resolved recipe — enough to rebuild the model with no
access to the run — and the sha256 of the weights (``files``), checked on load unless
``--no-verify``. ``clipkit eval`` reads only this directory; every way it can be damaged is
reported as an :class:`~clipkit.errors.ArtifactError` naming the file.

Every path an export names stays inside it (:func:`clipkit.integrity.contained`: resolved, symlinks
followed): a ``files`` entry or a plugin file argument leading out (``../../etc/passwd``) is refused
by name before anything is read. Files a plugin needs (a WordPiece ``vocab.txt``; the tokenizer's
``export_files``) are copied into the export and checksummed with the weights.
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
from clipkit.artifacts import one_line, read_json_object, read_yaml_mapping
from clipkit.errors import ArtifactError, ClipkitError
from clipkit.integrity import describe_files, policy, reading_artifact, verify_files, warn_unverified
from clipkit.io import Kept, OutputKind, atomic_directory, claim_output_directory, tensor_bytes
from clipkit.manager import plugin_distribution
from clipkit.model import ContrastiveModel, build_model
from clipkit.recipe import SLOTS, get_path, section, validate, validate_or_raise
from clipkit.registry import KINDS, Registry
from clipkit.train.checkpoint import STATE, latest_checkpoint, load_checkpoint

FORMAT = "clipkit-export/1"
WEIGHTS = "model.safetensors"
METADATA = "clipkit.json"
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
    is one :class:`~clipkit.io.DiskFullError` line, nothing left behind). An existing ``out_dir``
    is replaced only when it is empty or an export (``overwrite``: whatever it holds)."""
    from safetensors.torch import save_model

    claim_output_directory(out_dir, EXPORT_OUTPUT, overwrite=overwrite)
    carried = getattr(model.tokenizer, "export_files", dict)()  # e.g. a WordPiece vocab.txt
    if carried:  # the export holds its own copies: loading reads nothing outside it
        recipe = copy.deepcopy(recipe)
        recipe["model"]["tokenizer"].update({argument: f"tokenizer-{argument}" for argument in carried})
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


def export_run(
    run_dir: Path,
    out_dir: Path,
    registry: Registry,
    checkpoint: Path | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Export the newest (or a given) checkpoint of a run. ``out_dir`` is checked first (see
    :func:`write_export`); it is never the run directory, a folder holding it or its checkpoints."""
    run_dir = Path(run_dir)
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
        raise ClipkitError(f"{run_dir}: no checkpoint to export (checkpoints/step-*.pt)")
    recipe = read_yaml_mapping(
        recipe_path, "the run's recipe", "restore it from the run's clipkit.json or a backup"
    )
    validate_or_raise(recipe, registry)
    model = build_model(recipe, registry)
    weights = load_checkpoint(path)["model"]
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:  # a checkpoint of another model than recipe.yaml describes
        raise ArtifactError(
            f"{Path(path) / STATE}: its weights do not fit the model of {recipe_path} ({one_line(error)})"
        ) from error
    kept = f"the run is intact: export it again with `clipkit export {run_dir} {out_dir}`"
    return write_export(model, recipe, out_dir, registry, overwrite=overwrite, kept=kept)


#: Keys of clipkit.json that loading reads, with their JSON types.
REQUIRED = {"format": str, "plugins": dict, "recipe": dict, "model": dict, "preprocessing": dict}
REDO = "export the run again (clipkit export RUN OUT)"


def read_metadata(export_dir: Path) -> dict[str, Any]:
    """``clipkit.json``, with every key loading needs present and of the right type."""
    path = Path(export_dir) / METADATA
    if not path.is_file():
        raise ArtifactError(f"{export_dir} is not a clipkit export: {METADATA} is missing")
    metadata = read_json_object(path, "the export's metadata", REDO)
    if metadata.get("format") != FORMAT:
        raise ArtifactError(
            f"{path}: unsupported export format {metadata.get('format')!r} (expected {FORMAT}); {REDO}"
        )
    for key, kind in REQUIRED.items():
        if not isinstance(metadata.get(key), kind):
            found = "missing" if key not in metadata else f"a {type(metadata[key]).__name__}"
            raise ArtifactError(f"{path}: `{key}` is {found}, expected a JSON {kind.__name__}; {REDO}")
    for slot, info in metadata["plugins"].items():
        if not (
            isinstance(info, dict) and isinstance(info.get("kind"), str) and isinstance(info.get("name"), str)
        ):
            raise ArtifactError(f"{path}: plugins.{slot} lacks its `kind` and `name`; {REDO}")
        if info["kind"] not in KINDS:
            raise ArtifactError(
                f"{path}: plugins.{slot} names an unknown plugin kind {info['kind']!r} "
                f"(known kinds: {', '.join(sorted(KINDS))}); {REDO}"
            )
    return metadata


def verify_export(export_dir: Path, metadata: dict[str, Any]) -> None:
    """The weights against the checksums in ``clipkit.json``. Only an export with no ``files`` key
    (written before checksums existed) loads unverified, with a one-line warning each time; a
    ``files`` map without ``model.safetensors`` (``files: {}``) is refused."""
    if not policy().verify:
        return
    path = Path(export_dir) / METADATA
    if "files" not in metadata:
        warn_unverified(path, "the weights are")
        return
    verify_files(export_dir, metadata["files"], where=path, what="export", required=[WEIGHTS])


def load_export(export_dir: Path, registry: Registry) -> tuple[ContrastiveModel, dict[str, Any]]:
    """Rebuild the model from ``clipkit.json`` and load its weights (strict), in eval mode."""
    metadata = read_metadata(export_dir)
    recipe = metadata["recipe"]
    missing = [
        f"{slot}: {info['kind']} {info['name']!r} (from {info.get('distribution')} {info.get('version')})"
        for slot, info in metadata["plugins"].items()
        if info["name"] not in registry.names(info["kind"])
    ]
    if missing:
        raise ClipkitError(f"{export_dir} needs plugins that are not installed: " + "; ".join(missing))
    weights = Path(export_dir) / WEIGHTS
    if not weights.is_file():
        raise ArtifactError(f"{weights}: missing; the export is incomplete — {REDO}")
    verify_export(export_dir, metadata)
    errors = validate(recipe, registry)
    if errors:
        listed = "; ".join(errors[:3]) + (f" (+{len(errors) - 3} more)" if len(errors) > 3 else "")
        raise ArtifactError(
            f"{Path(export_dir) / METADATA}: its recipe is invalid (edited?): {listed}; {REDO}"
        )
    with reading_artifact(export_dir, Path(export_dir) / METADATA):  # plugin files: inside the export
        model = build_model(recipe, registry)
    load_weights(model, weights)
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


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """``model.safetensors`` into ``model``: unreadable files, missing or extra tensors, other shapes
    or dtypes are named errors (``load_state_dict`` would silently cast another dtype)."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    expected = model.state_dict()
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if key not in expected:
                    continue  # load_model reports unexpected tensors below
                found = handle.get_slice(key)
                shape, dtype = list(found.get_shape()), found.get_dtype()
                want = expected[key]
                if shape != list(want.shape) or dtype != SAFETENSORS_DTYPES.get(want.dtype):
                    raise ArtifactError(
                        f"{path}: tensor {key!r} is {dtype} {shape}, the model needs "
                        f"{SAFETENSORS_DTYPES.get(want.dtype)} {list(want.shape)}; {REDO}"
                    )
        load_model(model, str(path), strict=True)
    except ArtifactError:
        raise
    except Exception as error:  # SafetensorError (bad header, truncated), RuntimeError (missing keys)
        raise ArtifactError(f"{path}: cannot load the weights ({one_line(error)}); {REDO}") from error


SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
