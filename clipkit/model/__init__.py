"""The model a recipe builds: towers + similarity (+ tokenizer and preprocessing).

Everything is built from registered names through :func:`build_slot`, which passes the
host-supplied arguments (``embed_dim``, ``vocab_size``, ...) only to factories whose
signature names them — the same rule :func:`clipkit.config.recipe.validate` checks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from clipkit.config.recipe import SLOTS, section
from clipkit.contract.built import check_built
from clipkit.contract.registry import Registry
from clipkit.contract.types import PointSet, PointSetError
from clipkit.data.image_modes import parse_background
from clipkit.data.transforms import ImageTransform
from clipkit.errors import ClipkitError, PluginError, SlotArgumentError

INJECTED = {slot.path: slot.injected for slot in SLOTS}

#: torch.nn.init's random initialisers (what the towers' ``reset_parameters`` draw their weights with).
RANDOM_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "orthogonal_",
    "sparse_",
)


def _parameters_left_alone(initialise):
    @functools.wraps(initialise)
    def initialise_unless_parameter(tensor, *args, **kwargs):
        if isinstance(tensor, nn.Parameter):
            return tensor
        return initialise(tensor, *args, **kwargs)

    return initialise_unless_parameter


@contextlib.contextmanager
def parameters_not_initialised() -> Iterator[None]:
    """Build modules without drawing random initial values for their *parameters*, for a model
    whose every parameter is loaded (strictly) right after: reading an export. Drawing a ViT-B/16
    CLIP's 150 M initial weights was two thirds of reading its export (benchmarks/load_export.py). Only
    :data:`RANDOM_INITS` called on an ``nn.Parameter`` are skipped: buffers (persistent or not, a
    plugin's seeded random features among them), deterministic initialisers and everything else
    ``__init__`` computes run as before. Patches ``torch.nn.init`` for the duration (not for
    models built concurrently in other threads)."""
    saved = {name: getattr(nn.init, name) for name in RANDOM_INITS}
    try:
        for name, initialise in saved.items():
            setattr(nn.init, name, _parameters_left_alone(initialise))
        yield
    finally:
        for name, initialise in saved.items():
            setattr(nn.init, name, initialise)


def build_slot(registry: Registry, kind: str, config: dict, where: str, /, *args: Any, **available: Any):
    """Call the factory registered as ``config['name']`` with the slot's arguments.

    ``args`` are positional host arguments (the optimizer's ``named_parameters``);
    ``available`` are host keyword arguments, passed only when the factory names them.
    """
    entry = registry.get(kind, config["name"], where=where)
    parameters = inspect.signature(entry.factory).parameters
    kwargs = {k: v for k, v in config.items() if k != "name"}
    kwargs.update({k: v for k, v in available.items() if k in parameters})
    try:
        built = entry.factory(*args, **kwargs)
    except ValueError as error:
        # A factory refusing its arguments (the convention for plugins): one line naming the slot,
        # e.g. an encoder whose image size the recipe cannot give it, not a traceback.
        raise SlotArgumentError(f"{where} ({config['name']}): {error}") from error
    except ClipkitError:
        raise
    except (MemoryError, RuntimeError) as error:
        if not is_allocation_failure(error):
            raise factory_failure(registry, entry, where, error) from error
        numbers = {k: v for k, v in kwargs.items() if isinstance(v, int) and not isinstance(v, bool)}
        sizes = ", ".join(f"{k}={v}" for k, v in numbers.items())
        raise ClipkitError(
            f"{where}: {config['name']} cannot be built, its weights need more memory than there is "
            f"({sizes or 'its arguments'}); check the sizes in the recipe (model.image_size, "
            "model.embed_dim, the encoder's width and depth)"
        ) from None
    except Exception as error:
        raise factory_failure(registry, entry, where, error) from error
    check_built(kind, built, f"{where} ({entry.name}, {registry.origin(entry)})")
    return built


def factory_failure(registry: Registry, entry: Any, where: str, error: Exception) -> PluginError:
    """The one line for a factory that raised something other than a refusal of its arguments
    (a plugin bug): the slot, the plugin and its distribution, and the exception
    (``clipkit --debug`` prints the traceback)."""
    lines = str(error).strip().splitlines() or [""]
    return PluginError(
        f"{where} ({entry.name}, {registry.origin(entry)}): the factory raised "
        f"{type(error).__name__}: {lines[0]}".rstrip(": ")
    )


def is_allocation_failure(error: BaseException) -> bool:
    """A tensor allocation that failed for lack of memory (CPU or GPU), not a bug."""
    text = str(error).lower()
    return isinstance(error, MemoryError) or "can't allocate memory" in text or "out of memory" in text


class ContrastiveModel(nn.Module):
    """Two towers and the similarity that compares their point sets.

    pair = "image_text": batch["image"] [B,3,S,S] vs batch["text"] [B,L].
    pair = "two_view":   batch["image"] vs batch["image2"], one shared image encoder
                         (SimCLR-style single-modality training through the same loop).
    pair = "vectors":    batch["x"] [B, dx] through the image tower vs batch["y"] [B, dy] through
                         the text tower, no tokenizer (synthetic studies on a registered stream).
    """

    def __init__(
        self,
        image_encoder,
        text_encoder,
        similarity,
        tokenizer,
        transform: ImageTransform,
        pair: str,
        eval_seed: int = 0,
    ):
        super().__init__()
        self.image_encoder = image_encoder
        self.text_encoder = text_encoder
        self.similarity = similarity
        self.tokenizer = tokenizer
        self.transform = transform
        self.pair = pair
        self.eval_seed = eval_seed  # fixes random features (WPSE) at evaluation and in exports
        self.frozen_towers: tuple[str, ...] = ()  # model.frozen (clipkit.model.init_weights)
        # Who built each tower, for errors about what it returns (build_model names the plugin).
        self.tower_labels = {"image_encoder": "model.image_encoder", "text_encoder": "model.text_encoder"}
        self.similarity_label = "the similarity"  # likewise, for a width the similarity cannot compare

    def train(self, mode: bool = True) -> ContrastiveModel:
        """Locked towers (``model.frozen``) stay in eval mode: no BatchNorm updates, no dropout."""
        super().train(mode)
        for name in self.frozen_towers:
            getattr(self, name).eval()
        return self

    def encode_image(self, images: torch.Tensor) -> PointSet:
        """[B, 3, S, S] -> PointSet [B, M_x, d]."""
        return self.run_tower("image_encoder", images)

    def encode_text(self, tokens: torch.Tensor) -> PointSet:
        """[B, L] token ids -> PointSet [B, M_y, d]."""
        if self.text_encoder is None:
            raise RuntimeError("this model has no text encoder (model.pair = two_view)")
        return self.run_tower("text_encoder", tokens)

    def run_tower(self, name: str, inputs: torch.Tensor) -> PointSet:
        """The tower ``name`` on ``inputs``, its output checked (:func:`check_tower_output`). A
        PointSet the tower could not even build (points [B, d], weights of another shape) is one line
        naming the slot and plugin too: PointSet's own ValueError was a traceback inside the plugin."""
        who = self.tower_labels[name]
        try:
            output = getattr(self, name)(inputs)
        except PointSetError as error:
            raise PluginError(
                f"{who}: forward built an invalid PointSet: {error}; {POINT_SET_SHAPES}"
            ) from error
        return check_tower_output(output, inputs, who)

    def forward(self, batch: dict[str, Any]) -> tuple[PointSet, PointSet]:
        """The two sides of each positive pair for this batch: (PointSet [B, M_a, d], PointSet [B, M_b, d]).

        Training calls this inside :class:`clipkit.train.step.TrainingStep`'s forward, which runs the
        whole step (gather, similarity, loss) in the one module DDP / DeepSpeed wrap.
        """
        if self.pair == "two_view":
            return self.encode_image(batch["image"]), self.encode_image(batch["image2"])
        if self.pair == "vectors":
            a, b = self.run_tower("image_encoder", batch["x"]), self.run_tower("text_encoder", batch["y"])
        else:
            a, b = self.encode_image(batch["image"]), self.encode_text(batch["text"])
        check_widths(a, b, self.tower_labels, self.similarity_label)
        return a, b


#: What a tower's PointSet holds, for the errors about one it built wrong.
POINT_SET_SHAPES = (
    "a PointSet holds points [B, M, d] (weights and mask [B, M]); "
    "a plain embedding [B, d] is PointSet(x[:, None])"
)


def check_widths(a: PointSet, b: PointSet, labels: dict[str, str], similarity: str) -> None:
    """Refuse (:class:`PluginError`) point sets of two widths from the two towers: every similarity
    compares points of one width (products, kernels and random features of d-vectors; none of the
    built-ins projects one side), so this was a matmul error deep inside the similarity instead.
    ``labels`` name the towers' slots and plugins, ``similarity`` the similarity's."""
    if a.dim == b.dim:
        return
    image, text = labels["image_encoder"], labels["text_encoder"]
    raise PluginError(
        f"{image} returns points of width {a.dim} but {text} returns width {b.dim}; {similarity} compares "
        "points of one width: make both towers return model.embed_dim (passed to a factory whose "
        "signature names embed_dim)"
    )


def check_tower_output(output: Any, inputs: torch.Tensor, who: str) -> PointSet:
    """``output`` of a tower run on ``inputs``, refused (:class:`PluginError` naming ``who``: the slot
    and plugin) unless it is a :class:`PointSet` with one set per input. A plain tensor or a batch of
    another size would otherwise fail deep in the similarity or the loss, or be scored against the
    wrong rows."""
    from clipkit.contract.built import describe

    if not isinstance(output, PointSet):
        raise PluginError(
            f"{who}: forward returned {describe(output)}, not a PointSet (clipkit.contract.types.PointSet: "
            "points [B, M, d]; a plain embedding [B, d] is PointSet(x[:, None]))"
        )
    if output.points.shape[0] != inputs.shape[0]:
        raise PluginError(
            f"{who}: forward returned {output.points.shape[0]} point sets for a batch of {inputs.shape[0]} "
            f"(points {tuple(output.points.shape)}; one set per input is expected)"
        )
    return output


def slot_label(registry: Registry, kind: str, config: dict, where: str) -> str:
    """``model.image_encoder (my_vit, plugin 'x' (dist 0.1))``: the slot and who registered it."""
    entry = registry.get(kind, config["name"], where=where)
    return f"{where} ({entry.name}, {registry.origin(entry)})"


def batched_input_size(recipe: dict) -> int:
    """Side of the uint8 images the loader emits under ``data.augment: batched`` (S·8/7 default,
    the usual 256 for 224, so random crops have room)."""
    model, data = section(recipe, "model"), section(recipe, "data")
    return int(data.batched_input_size) or round(model.image_size * 8 / 7)


def build_transform(recipe: dict, *, train: bool) -> ImageTransform:
    """The recipe's preprocessing; without ``train`` only the deterministic eval path."""
    model, data = section(recipe, "model"), section(recipe, "data")
    common = {"image_size": model.image_size, "mean": tuple(model.mean), "std": tuple(model.std),
              "background": parse_background(data.background, "data.background")}  # fmt: skip
    if not train:
        return ImageTransform(**common)
    return ImageTransform(
        **common,
        crop_scale=tuple(data.crop_scale),
        crop_ratio=tuple(data.crop_ratio),
        hflip=bool(data.hflip),
        color_jitter=float(data.color_jitter),
        grayscale=float(data.grayscale),
    )


def build_model(recipe: dict, registry: Registry, *, adapters: bool = True) -> ContrastiveModel:
    """Build the towers, tokenizer and similarity named by a validated recipe, with the recipe's
    LoRA adapters (``model.lora``) unless ``adapters`` is false (training adds them after the
    initial weights load into the plain towers)."""
    model = section(recipe, "model")
    tokenizer = None
    text_encoder = None
    if model.pair == "image_text":
        tokenizer = build_slot(registry, "tokenizer", model.tokenizer, "model.tokenizer")
        text_encoder = build_slot(
            registry,
            "encoder",
            model.text_encoder,
            "model.text_encoder",
            embed_dim=model.embed_dim,
            vocab_size=tokenizer.vocab_size,
            context_length=tokenizer.context_length,
        )
    elif model.pair == "vectors":
        text_encoder = build_slot(
            registry, "encoder", model.text_encoder, "model.text_encoder", embed_dim=model.embed_dim
        )
    image_encoder = build_slot(
        registry,
        "encoder",
        model.image_encoder,
        "model.image_encoder",
        embed_dim=model.embed_dim,
        image_size=model.image_size,
        input_mean=tuple(model.mean),  # how the images are normalised (a pretrained tower maps them)
        input_std=tuple(model.std),
    )
    similarity = build_slot(
        registry, "similarity", recipe["similarity"], "similarity", embed_dim=model.embed_dim
    )
    transform = build_transform(recipe, train=False)
    eval_seed = int(recipe.get("eval_seed", 0))
    built = ContrastiveModel(
        image_encoder, text_encoder, similarity, tokenizer, transform, model.pair, eval_seed
    )
    built.tower_labels = {
        "image_encoder": slot_label(registry, "encoder", model.image_encoder, "model.image_encoder")
    }
    if text_encoder is not None:
        built.tower_labels["text_encoder"] = slot_label(
            registry, "encoder", model.text_encoder, "model.text_encoder"
        )
    built.similarity_label = "the similarity " + slot_label(
        registry, "similarity", recipe["similarity"], "similarity"
    ).removeprefix("similarity ")
    if adapters and model.lora:
        from clipkit.model.lora import add_adapters

        add_adapters(built, recipe)
    return built
