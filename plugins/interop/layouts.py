"""Interop with the CLIP weights researchers already have: open_clip and Hugging Face.

Layouts (:func:`detect`):
  ``clipkit``     an export directory (``clipkit.json`` + ``model.safetensors``);
  ``open_clip``   an open_clip checkpoint directory (``open_clip_config.json`` +
                  ``open_clip_model.safetensors``);
  ``state_dict``  one ``.safetensors`` file in OpenAI/open_clip key layout (no config);
  ``hf``          a Hugging Face ``CLIPModel`` directory (``config.json`` + ``model.safetensors``, or
                  a sharded checkpoint: ``model.safetensors.index.json`` + its shards).

Everything goes through a :class:`~clipkit.plugins.interop.spec.ClipSpec` and a clipkit-layout state dict.
Neither open_clip nor transformers is imported, and no pickle is ever loaded (``.bin``/``.pt``
files are refused; OpenAI's TorchScript ``.pt`` files are out of scope — use a safetensors copy).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from clipkit.artifacts.files import one_line
from clipkit.errors import ClipkitError
from clipkit.plugins.interop.keys import clipkit_to_hf, clipkit_to_open_clip
from clipkit.plugins.interop.spec import CLIP_VOCAB_SIZE, ClipSpec, TextSpec, VisionSpec

if TYPE_CHECKING:
    from clipkit.contract.registry import Registry
    from clipkit.model import ContrastiveModel

LAYOUTS = ("clipkit", "open_clip", "state_dict", "hf")
#: Registered encoder names whose towers convert (their classes are checked too, see spec_of_model).
CONVERTIBLE = {
    "encoder": "vit*, text_transformer*, clip_text (output cls/eos, no weight head), clip_resnet, rn*",
    "tokenizer": "clip_bpe",
    "similarity": "dot (no bias)",
}


def foreign_layouts(path: Path) -> dict[str, bool]:
    """The foreign checkpoint layouts whose config ``path`` holds -> whether their safetensors
    weights are beside it (open_clip first: the order a folder holding both is read in)."""
    from clipkit.plugins.interop import hf, open_clip

    found = {}
    if (path / open_clip.CONFIG).is_file():
        found["open_clip"] = (path / open_clip.WEIGHTS).is_file()
    if hf.is_hf_clip(path):
        found["hf"] = hf.has_weights(path)  # model.safetensors, or a sharded checkpoint's index
    return found


def foreign_layout(path: Path) -> str | None:
    """The layout :func:`detect` reads in a directory of foreign weights. A model published on the
    Hugging Face Hub by open_clip holds both layouts side by side (the same weights twice): the
    first whose weights file is there is read, and one line says which when both could be."""
    found = foreign_layouts(path)
    complete = [layout for layout, has_weights in found.items() if has_weights]
    if len(complete) > 1:
        print(
            f"note: {path} holds an open_clip checkpoint and a Hugging Face CLIPModel; reading the "
            f"{complete[0]} one",
            file=sys.stderr,
        )
    # None complete: the first found, whose reader names the missing weights file.
    return (complete or list(found) or [None])[0]


def detect(path: Path) -> str:
    """Which layout ``path`` holds (raises ClipkitError naming what it looked for)."""
    from clipkit.plugins.interop import open_clip

    path = Path(path)
    if path.is_file():
        if path.suffix == ".safetensors":
            return "state_dict"
        raise ClipkitError(
            f"{path}: only .safetensors state dicts are read (pickled .pt/.bin files are never loaded; "
            "OpenAI's TorchScript .pt files are out of scope: use a safetensors copy of the weights)"
        )
    if not path.is_dir():
        raise ClipkitError(f"{path} does not exist")
    if (path / "clipkit.json").is_file():
        return "clipkit"
    layout = foreign_layout(path)
    if layout is not None:
        return layout
    raise ClipkitError(
        f"{path} is not a clipkit export: clipkit.json is missing (nor is it an open_clip directory with "
        f"{open_clip.CONFIG} or a Hugging Face CLIPModel directory with config.json)"
    )


def read(path: Path, registry: Registry | None = None, *, quick_gelu: bool | None = None):
    """Any layout -> (ClipSpec, clipkit-layout state dict). ``quick_gelu`` only matters for a bare
    state dict, whose tensors cannot say which activation trained them (None: from the evidence, see
    :func:`clipkit.plugins.interop.open_clip.activation`, or refused)."""
    from clipkit.plugins.interop import hf, open_clip

    layout = detect(path)
    readers = {
        "state_dict": lambda: open_clip.read_state_dict(Path(path), quick_gelu),
        "open_clip": lambda: open_clip.read_dir(Path(path)),
        "hf": lambda: hf.read_dir(Path(path)),
    }
    if layout in readers:
        try:
            spec, state = readers[layout]()
        except ClipkitError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as error:
            # A foreign file's config or tensors of the wrong kind: one line naming the file.
            raise ClipkitError(
                f"{path}: not a plain CLIP model in the {layout} layout "
                f"({type(error).__name__}: {one_line(error)})"
            ) from None
    else:
        from clipkit.artifacts.reader import load_export
        from clipkit.contract.registry import default_registry

        model, metadata = load_export(Path(path), registry or default_registry())
        spec = spec_of_model(model, metadata, str(path))
        state = {k: v for k, v in model.state_dict().items()}
    spec.extra["converted_from"] = f"{layout}:{path}"
    return spec, state


# ----------------------------------------------------------------------------- clipkit side


def encoder_configs(spec: ClipSpec) -> tuple[dict, dict]:
    """The ``model.image_encoder`` / ``model.text_encoder`` recipe entries that hold ``spec``."""
    vision, text = spec.vision, spec.text
    if vision.kind == "resnet":
        image = {
            "name": "clip_resnet",
            "layers": list(vision.layers),
            "width": vision.width,
            "heads": vision.heads,
        }
    else:
        image = dict(name="vit", patch_size=vision.patch_size, width=vision.width, layers=vision.layers,
                     heads=vision.heads, mlp_ratio=vision.mlp_ratio, quick_gelu=spec.quick_gelu)  # fmt: skip
    text_config = dict(name="text_transformer", width=text.width, layers=text.layers, heads=text.heads,
                       mlp_ratio=text.mlp_ratio, quick_gelu=spec.quick_gelu)  # fmt: skip
    return image, text_config


def recipe_for(spec: ClipSpec, state: dict, registry: Registry) -> dict:
    """A validated clipkit recipe (the ``clip`` recipe's training settings) whose model is ``spec``."""
    from clipkit.config.recipe import load_recipe, validate_or_raise

    if spec.text.vocab_size != CLIP_VOCAB_SIZE:
        raise ClipkitError(
            f"text vocab_size {spec.text.vocab_size} is not CLIP BPE's {CLIP_VOCAB_SIZE}: clipkit has no "
            "tokenizer for it"
        )
    recipe = load_recipe("clip", [], registry=registry)
    image, text = encoder_configs(spec)
    recipe["model"].update(
        embed_dim=spec.embed_dim,
        image_size=spec.vision.image_size,
        mean=list(spec.mean),
        std=list(spec.std),
        image_encoder=image,
        text_encoder=text,
        tokenizer={"name": "clip_bpe", "context_length": spec.text.context_length},
    )
    scale = (
        math.exp(float(state["similarity.log_scale"].reshape(())))
        if "similarity.log_scale" in state
        else 100.0
    )
    recipe["similarity"] = {"name": "dot", "init_scale": scale, "max_scale": 100.0}
    if spec.extra.get("converted_from"):
        recipe["notes"] = f"converted by `clipkit convert` from {spec.extra['converted_from']}"
    return validate_or_raise(recipe, registry)


def build(spec: ClipSpec, state: dict, registry: Registry) -> tuple[ContrastiveModel, dict]:
    """A clipkit model holding ``state`` (strict: every key must match), in eval mode, + its recipe."""
    from clipkit.model import build_model, parameters_not_initialised

    recipe = recipe_for(spec, state, registry)
    with parameters_not_initialised():  # every parameter is loaded (strictly) below
        model = build_model(recipe, registry)
    layout, _, source = spec.extra.get("converted_from", "").partition(":")
    weights = spec.extra.get("weights") or source
    where = f"the tensors of {weights}" if weights else "converted weights"
    load_strict(model, state, where, in_file(layout, spec.vision.kind))
    return model.eval(), recipe


#: The foreign layouts' key maps, clipkit -> the file's keys (:func:`in_file`).
TO_FILE = {
    "hf": lambda state, vision_kind: clipkit_to_hf(state),
    "open_clip": clipkit_to_open_clip,
    "state_dict": clipkit_to_open_clip,
}


def in_file(layout: str, vision_kind: str):
    """``(clipkit key, tensor) -> {key in the file: tensor as the file holds it}`` for weights read
    from ``layout``: a mismatch is named by the keys a user finds in their file (one clipkit
    ``in_proj`` is three Hugging Face ``q/k/v_proj``). A key the map cannot translate (or another
    layout) stays clipkit's."""
    to_file = TO_FILE.get(layout)

    def keys(key: str, tensor) -> dict:
        if to_file is None:
            return {key: tensor}
        try:
            return to_file({key: tensor}, vision_kind)
        except (ClipkitError, RuntimeError, ValueError):  # no counterpart, a shape q/k/v cannot split
            return {key: tensor}

    return keys


def load_strict(model, state: dict, where: str, file_keys=None) -> None:
    """``load_state_dict`` that names every missing/unexpected key and shape mismatch, by the keys of
    the file ``where`` names (``file_keys``: :func:`in_file`) with clipkit's beside them."""
    keys = KeyNames(file_keys or (lambda key, tensor: {key: tensor}))
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    both = [k for k in own if k in state]
    shapes = [k for k in both if tuple(state[k].shape) != tuple(own[k].shape)]
    dtypes = [k for k in both if state[k].is_floating_point() != own[k].is_floating_point()]
    if not (missing or unexpected or shapes or dtypes):
        model.load_state_dict(state, strict=True)
        return
    shape, dtype = (lambda t: tuple(t.shape)), (lambda t: t.dtype)
    parts = [
        ("missing", ", ".join(keys.named(k, own[k]) for k in missing)),
        ("unexpected", ", ".join(keys.named(k, state[k]) for k in unexpected)),
        ("shape mismatches", "; ".join(keys.compared(k, state[k], own[k], shape) for k in shapes)),
        ("dtype mismatches (integer weights in floating slots)",
         "; ".join(keys.compared(k, state[k], own[k], dtype) for k in dtypes)),
    ]  # fmt: skip
    raise ClipkitError(f"{where} do not fit the model: " + "; ".join(f"{a} {b}" for a, b in parts if b))


class KeyNames:
    """Names a clipkit key by the key(s) the weights file holds it under, clipkit's in brackets:
    ``text_model.final_layer_norm.weight (clipkit's text_encoder.ln_final.weight)``."""

    def __init__(self, file_keys) -> None:
        self.file_keys = file_keys

    def named(self, key: str, tensor) -> str:
        found = list(self.file_keys(key, tensor))
        return key if found == [key] else f"{', '.join(found)} (clipkit's {key})"

    def compared(self, key: str, theirs, ours, what) -> str:
        """``FILE_KEY (clipkit's KEY): what(file's) vs what(model's)``, as the file holds the tensor
        (open_clip's projections transposed). A key the file splits (Hugging Face's q/k/v of one
        ``in_proj``) is compared as clipkit holds it: the file's parts cannot be recovered from the
        concatenation."""
        in_file, wanted = self.file_keys(key, theirs), self.file_keys(key, ours)
        if len(wanted) == 1 and list(in_file) == list(wanted):
            ((file_key, mine),) = wanted.items()
            return f"{self.named(key, ours)}: {what(in_file[file_key])} vs {what(mine)}"
        return f"{self.named(key, ours)}: {what(theirs)} vs {what(ours)}"


def read_foreign(path: Path, registry: Registry, options: dict) -> tuple[ContrastiveModel, dict] | None:
    """The ``read_model`` hook: an open_clip / Hugging Face directory or an OpenAI-layout
    state dict, converted in memory; None for a path in none of these layouts (an export is the
    host's). Pickles are refused here, with the reason."""
    from clipkit.artifacts.export import describe
    from clipkit.plugins.interop import hf, open_clip

    path = Path(path)
    recognised = path.is_file() or (path / open_clip.CONFIG).is_file() or hf.is_hf_clip(path)
    if not recognised or (path / "clipkit.json").is_file():
        return None
    spec, state = read(path, registry, quick_gelu=options.get("quick_gelu"))
    model, recipe = build(spec, state, registry)
    return model, describe(recipe, registry)


def load_model(
    path: Path, registry: Registry | None = None, *, quick_gelu: bool | None = None
) -> tuple[ContrastiveModel, dict]:
    """Any layout -> (clipkit model in eval mode, export-style metadata). Exports load as they are
    (any plugins); other layouts are converted in memory."""
    from clipkit.artifacts.export import describe
    from clipkit.artifacts.reader import load_export
    from clipkit.contract.registry import default_registry

    registry = registry or default_registry()
    if (Path(path) / "clipkit.json").is_file():  # an export (else read() detects the layout, once)
        return load_export(Path(path), registry)
    spec, state = read(path, registry, quick_gelu=quick_gelu)
    model, recipe = build(spec, state, registry)
    return model, describe(recipe, registry)


#: Written beside a converted export: the `clip` recipe with this model, ready for
#: ``clipkit train OUT/recipe.yaml model.init=OUT data.shards=...`` (fine-tuning the converted model).
RECIPE = "recipe.yaml"


def write_export(
    spec: ClipSpec, state: dict, out: Path, registry: Registry, *, overwrite: bool = False
) -> Path:
    from clipkit.artifacts.export import write_export as write
    from clipkit.config.recipe import save_recipe

    model, recipe = build(spec, state, registry)
    out = write(model, recipe, Path(out), registry, overwrite=overwrite)
    trainable = {k: v for k, v in recipe.items() if k not in ("name", "overrides")}
    save_recipe(trainable, out / RECIPE)
    return out


def spec_of_model(model: ContrastiveModel, metadata: dict, where: str) -> ClipSpec:
    """The plain-CLIP shape of a clipkit model, or ClipkitError naming the plugin that has none."""
    from clipkit.plugins.encoders.clip_resnet import ModifiedResNet
    from clipkit.plugins.encoders.text_transformer import TextTransformer
    from clipkit.plugins.encoders.vit import QuickGELU, VisionTransformer
    from clipkit.plugins.similarities.dot import DotSimilarity
    from clipkit.plugins.tokenizers.clip_bpe import ClipBPETokenizer

    plugins = metadata.get("plugins", {})

    def refuse(slot: str, why: str):
        name = plugins.get(slot, {}).get("name", "?")
        return ClipkitError(f"{where}: {slot} {name!r} has no plain-CLIP counterpart ({why})")

    image, text = model.image_encoder, model.text_encoder
    if isinstance(image, VisionTransformer):
        if image.output != "cls" or image.weight_head is not None:
            raise refuse("model.image_encoder", "only output='cls' without a weight head converts")
        blocks = image.transformer.blocks
        width = image.conv1.out_channels
        vision = VisionSpec(
            "vit", width, len(blocks), blocks[0].attn.heads, image.image_size,
            patch_size=image.conv1.kernel_size[0], mlp_ratio=blocks[0].mlp[0].out_features / width,
        )  # fmt: skip
        image_quick = isinstance(blocks[0].mlp[1], QuickGELU)
    elif isinstance(image, ModifiedResNet):
        if image.output != "cls":
            raise refuse("model.image_encoder", "only output='cls' converts")
        layers = tuple(len(stage) for stage in image.stages())
        vision = VisionSpec(
            "resnet", image.conv3.out_channels, layers, image.attnpool.heads, image.image_size
        )
        image_quick = None
    else:
        raise refuse("model.image_encoder", "plain CLIP image towers are ViT and modified ResNet")
    if model.pair != "image_text" or not isinstance(text, TextTransformer):
        raise refuse("model.text_encoder", "plain CLIP's text tower is the causal text Transformer")
    if text.output != "eos" or text.weight_head is not None:
        raise refuse("model.text_encoder", "only output='eos' without a weight head converts")
    if not isinstance(model.tokenizer, ClipBPETokenizer):
        raise refuse("model.tokenizer", "plain CLIP uses CLIP BPE (clip_bpe)")
    similarity = model.similarity
    if not isinstance(similarity, DotSimilarity) or similarity.bias is not None:
        raise refuse("similarity", "plain CLIP scores exp(logit_scale)·<x, y>, 'dot' without bias")
    if "similarity.log_scale" not in dict(similarity.named_parameters(prefix="similarity")):
        raise refuse("similarity", "a fixed (learn_scale=false) scale is not a CLIP logit_scale parameter")
    text_blocks = text.transformer.blocks
    text_quick = isinstance(text_blocks[0].mlp[1], QuickGELU)
    if image_quick is not None and image_quick != text_quick:
        raise refuse("model.image_encoder", "the towers use different activations (quick_gelu); CLIP has one")
    text_spec = TextSpec(
        width=text.token_embedding.embedding_dim,
        layers=len(text_blocks),
        heads=text_blocks[0].attn.heads,
        context_length=text.context_length,
        vocab_size=text.vocab_size,
        mlp_ratio=text_blocks[0].mlp[0].out_features / text.token_embedding.embedding_dim,
    )
    preprocessing = metadata.get("preprocessing", {})
    return ClipSpec(
        embed_dim=text.proj.out_features,
        vision=vision,
        text=text_spec,
        quick_gelu=text_quick,
        mean=tuple(preprocessing.get("mean", model.transform.mean)),
        std=tuple(preprocessing.get("std", model.transform.std)),
    )


def convert(
    src: Path,
    out: Path,
    to: str,
    registry: Registry | None = None,
    *,
    quick_gelu: bool | None = None,
    overwrite: bool = False,
):
    """Convert the model at ``src`` (any layout) to ``out`` in layout ``to``; returns ``out``.

    ``out`` is checked before anything is read (:func:`claim_output`): new, empty or an earlier
    output of layout ``to``, or anything with ``overwrite``; never ``src`` or a folder holding it."""
    from clipkit.contract.registry import default_registry
    from clipkit.plugins.interop import hf, open_clip

    if to not in LAYOUTS:
        raise ClipkitError(f"--to must be one of {', '.join(LAYOUTS)}, got {to!r}")
    claim_output(Path(src), Path(out), to, overwrite)
    registry = registry or default_registry()
    spec, state = read(Path(src), registry, quick_gelu=quick_gelu)
    if to != "clipkit":
        build(spec, state, registry)  # the weights must fit the architecture before anything is written
    if to == "clipkit":
        return write_export(spec, state, out, registry, overwrite=overwrite)
    writer = {"open_clip": open_clip.write_dir, "state_dict": open_clip.write_state_dict, "hf": hf.write_dir}[
        to
    ]
    return writer(spec, state, out)


def claim_output(src: Path, out: Path, to: str, overwrite: bool) -> None:
    """Refuse (ClipkitError) an ``out`` that holds what clipkit did not write for layout ``to``
    (``clipkit.artifacts.io.claim_output_directory``; for ``state_dict``, an existing file), and ``src``
    itself or a folder holding it, ``overwrite`` or not."""
    from clipkit.artifacts.export import EXPORT_OUTPUT
    from clipkit.artifacts.io import OVERWRITE_REMEDY, Kept, claim_output_directory
    from clipkit.plugins.interop import hf, open_clip

    kept = [Kept(src, "the model being converted", inside=False)]
    if to == "state_dict":
        claim_output_file(src, out, overwrite)
        return
    kind = {"clipkit": EXPORT_OUTPUT, "open_clip": open_clip.DIRECTORY_OUTPUT, "hf": hf.DIRECTORY_OUTPUT}[to]
    claim_output_directory(out, kind, overwrite=overwrite, protect=kept, remedy=OVERWRITE_REMEDY)


def claim_output_file(src: Path, out: Path, overwrite: bool) -> None:
    """A state dict file is written over an existing file only with ``overwrite``; never over ``src``."""
    if out.resolve() == src.resolve() or (out.exists() and not out.is_file()):
        raise ClipkitError(f"{out} is the model being converted or not a file: pick another output path")
    if out.exists() and not overwrite:
        raise ClipkitError(
            f"{out} already exists: pick another output path, or pass --overwrite to replace the file"
        )
