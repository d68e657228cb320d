"""Reading a clipkit export: ``clipkit.json`` (metadata), ``model.safetensors`` (weights) and their
checksums — apart from the writer (:mod:`clipkit.artifacts.export`), so that evaluation, ``clipkit.load`` and
``model.init`` never import training code (tests/test_architecture.py checks).

Every way an export can be damaged is an :class:`~clipkit.errors.ArtifactError` naming the file;
every path it names stays inside it (:func:`clipkit.artifacts.integrity.reading_artifact`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from clipkit.artifacts.files import one_line, read_json_object
from clipkit.artifacts.integrity import policy, reading_artifact, verify_files, warn_unverified
from clipkit.config.dotted import get_path
from clipkit.config.recipe import validate
from clipkit.contract.registry import KINDS, Registry
from clipkit.errors import ArtifactError, ClipkitError
from clipkit.model import ContrastiveModel, build_model, parameters_not_initialised

FORMAT = "clipkit-export/1"
WEIGHTS = "model.safetensors"
METADATA = "clipkit.json"
#: Keys of clipkit.json that loading reads, with their JSON types.
REQUIRED = {"format": str, "plugins": dict, "recipe": dict, "model": dict, "preprocessing": dict}
REDO = "export the run again (clipkit export RUN OUT)"
#: The recipe slots clipkit.json's ``plugins`` describes (each one the recipe sets), in the writer's
#: order: the recipe decides the model that is built, ``plugins`` what is shown and checked as installed.
MODEL_SLOTS = ("model.image_encoder", "model.text_encoder", "model.tokenizer", "similarity")


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
    check_plugins_match_recipe(path, metadata)
    return metadata


def check_plugins_match_recipe(path: Path, metadata: dict[str, Any]) -> None:
    """``plugins`` names the plugins of the stored recipe, slot by slot. The recipe decides the model
    that is built; an edited ``plugins.similarity.name`` would otherwise load and describe the export
    (eval reports, the installed-plugins check) as a model it is not."""
    recipe, plugins = metadata["recipe"], metadata["plugins"]
    for slot in dict.fromkeys([*plugins, *MODEL_SLOTS]):  # every listed slot, and every model slot
        config = get_path(recipe, slot)
        in_recipe = config.get("name") if isinstance(config, dict) else None
        listed = plugins[slot]["name"] if slot in plugins else None
        if listed != in_recipe:
            raise ArtifactError(
                f"{path}: plugins.{slot}.name is {listed!r} but its recipe's {slot}.name is "
                f"{in_recipe!r} (edited?); {REDO}"
            )


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
    # Every parameter is loaded below (strictly): their random initial values are not drawn.
    with reading_artifact(export_dir, Path(export_dir) / METADATA), parameters_not_initialised():
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
