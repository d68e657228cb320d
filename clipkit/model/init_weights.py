"""Recipe-driven starting weights and locked towers: ``model.init`` and ``model.frozen``.

``model.init``: where training starts from, instead of a random initialisation —
  a path (a clipkit export, an open_clip or Hugging Face CLIP directory, an OpenAI-layout
  ``.safetensors`` state dict: anything :func:`clipkit.plugins.interop.load_model` reads), or
  ``{path: ..., include: [patterns], exclude: [patterns], strict: true}``.
  Patterns are shell-style (``fnmatch``) on clipkit's parameter names, e.g. ``image_encoder.*``.
  Strict (the default): the selected source weights and the model's selected weights must name the
  same keys, or the error lists every missing and unexpected key; shapes must always agree. The
  MLP activation (``quick_gelu``) of the source's towers must match the recipe's, because the
  weights cannot load into a tower that would compute something else.
  A resumed run (``--resume``) continues from its checkpoint; ``model.init`` is not re-applied.

``model.frozen``: towers to lock (``[image_encoder]`` = LiT: locked image tower, text trained; or
  ``[text_encoder]``). A locked tower's parameters do not require grad (the optimizer never changes
  them) and it stays in eval mode (no BatchNorm statistics updates, no dropout). When its inputs are
  not augmented (text always; images with the deterministic eval crop and no flips or colour
  changes), its output for a sample is computed once and cached (:class:`FrozenOutputCache`).
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from clipkit.config.recipe import section
from clipkit.errors import ClipkitError

TOWERS = ("image_encoder", "text_encoder")
#: Cached sample outputs per frozen module; beyond this the cache stops growing (then it only serves
#: hits), so memory is bounded (the text tower of a 16k-caption set at [1, 512] fp32: 32 MB).
MAX_CACHED = 200_000


def prepare_model(model, recipe: dict, registry, *, resume: bool = False) -> None:
    """Apply ``model.init`` (not when resuming: the checkpoint has the weights, and the source may be
    gone), then ``model.frozen`` and its output caches (called once by build_trainer)."""
    config = section(recipe, "model")
    if config.init and not resume:
        init_from(model, config.init, registry)
    frozen = list(config.frozen or [])
    for name in frozen:
        if name not in TOWERS or getattr(model, name, None) is None:
            raise ClipkitError(
                f"model.frozen: {name!r} is not a tower of this model (towers: {', '.join(TOWERS)})"
            )
    model.frozen_towers = tuple(frozen)
    for name in frozen:
        getattr(model, name).requires_grad_(False)
    model.train(model.training)  # puts the locked towers in eval mode
    data, train = section(recipe, "data"), section(recipe, "train")
    if train.compile != "none":
        return  # compiled towers are separate modules; caching is skipped rather than half-applied
    for name in TOWERS:
        tower = getattr(model, name, None)
        if tower is None or (name == "image_encoder" and augmented(data)):
            continue
        if name in frozen:
            FrozenOutputCache.attach(tower)
        elif getattr(tower, "frozen", False) and isinstance(getattr(tower, "backbone", None), nn.Module):
            # A tower that locks its own backbone (bert / minilm_l6 with frozen=true): only the
            # projection trains, so the backbone's output for a sample never changes.
            FrozenOutputCache.attach(tower.backbone)


def augmented(data) -> bool:
    """Whether training images differ between epochs (then their features cannot be cached)."""
    return (
        tuple(data.crop_scale) != (1.0, 1.0)
        or bool(data.hflip)
        or float(data.color_jitter) > 0
        or float(data.grayscale) > 0
        or data.augment == "batched"
    )


# ----------------------------------------------------------------------------- model.init


def init_options(init: Any) -> dict:
    """``model.init`` as {path, include, exclude, strict, quick_gelu} (``quick_gelu``: the activation
    a bare state dict was trained with, which its tensors cannot say)."""
    if isinstance(init, str | Path):
        init = {"path": str(init)}
    if not isinstance(init, dict) or not init.get("path"):
        raise ClipkitError(
            "model.init: give a path, or {path: ..., include: [...], exclude: [...], strict: true}"
        )
    unknown = set(init) - {"path", "include", "exclude", "strict", "quick_gelu"}
    if unknown:
        raise ClipkitError(
            f"model.init: unknown keys {sorted(unknown)} (path, include, exclude, strict, quick_gelu)"
        )
    return {
        "path": Path(init["path"]).expanduser(),
        "include": list(init.get("include") or ["*"]),
        "exclude": list(init.get("exclude") or []),
        "strict": bool(init.get("strict", True)),
        "quick_gelu": None if init.get("quick_gelu") is None else bool(init["quick_gelu"]),
    }


def selected(keys, include: list[str], exclude: list[str]) -> list[str]:
    """The keys matching an ``include`` pattern and no ``exclude`` pattern, in order."""
    return [
        key
        for key in keys
        if any(fnmatch.fnmatchcase(key, p) for p in include)
        and not any(fnmatch.fnmatchcase(key, p) for p in exclude)
    ]


def init_from(model: nn.Module, init: Any, registry) -> list[str]:
    """Copy the source's selected weights into ``model`` (in place); returns the keys copied."""
    from clipkit.artifacts.reader import load_model

    options = init_options(init)
    where = f"model.init ({options['path']})"
    try:
        source, _ = load_model(options["path"], registry, options={"quick_gelu": options["quick_gelu"]})
    except ClipkitError as error:
        raise ClipkitError(f"{where}: {error}") from None
    check_activations(model, source, where)
    theirs = source.state_dict()
    ours = model.state_dict()
    wanted = selected(theirs, options["include"], options["exclude"])
    targets = set(selected(ours, options["include"], options["exclude"]))
    missing = sorted(targets - set(wanted))
    unexpected = sorted(set(wanted) - set(ours))
    if options["strict"] and (missing or unexpected):
        parts = [
            f"missing in the source: {missing}" if missing else "",
            f"not in the model: {unexpected}" if unexpected else "",
        ]
        raise ClipkitError(
            f"{where} does not fit the recipe's model ({'; '.join(p for p in parts if p)}). Match the "
            "architecture, or narrow the keys with model.init.include / exclude, or set "
            "model.init.strict=false"
        )
    copied = [key for key in wanted if key in ours]
    shapes = [
        f"{k}: {tuple(theirs[k].shape)} vs {tuple(ours[k].shape)}"
        for k in copied
        if theirs[k].shape != ours[k].shape
    ]
    if shapes:
        raise ClipkitError(f"{where}: shapes differ (source vs recipe): {shapes}")
    with torch.no_grad():
        for key in copied:
            ours[key].copy_(theirs[key])
    return copied


def activation_kinds(tower: nn.Module) -> set[str]:
    """Class names of the tower's activation modules (any plugin's: read by name, so the host
    needs no encoder import)."""
    return {
        type(module).__name__
        for module in tower.modules()
        if any(hint in type(module).__name__ for hint in ("GELU", "ReLU", "SiLU", "Tanh", "Sigmoid"))
    }


def check_activations(model: nn.Module, source: nn.Module, where: str) -> None:
    """Refuse weights trained with one activation (e.g. QuickGELU) going into a tower with another
    (exact GELU): the same weights would compute a different function."""
    for name in TOWERS:
        ours, theirs = getattr(model, name, None), getattr(source, name, None)
        if ours is None or theirs is None:
            continue
        mine, other = activation_kinds(ours), activation_kinds(theirs)
        if mine and other and mine != other:
            wanted = "true" if "QuickGELU" in other else "false"
            raise ClipkitError(
                f"{where}: the source's {name} uses {'QuickGELU' if wanted == 'true' else 'exact GELU'} "
                f"({', '.join(sorted(other))}), the recipe's does not ({', '.join(sorted(mine))}): set "
                f"model.{name}.quick_gelu={wanted} (encoders vit, text_transformer)"
            )


# ----------------------------------------------------------------------------- frozen-output cache


def row_keys(x: Tensor) -> list[bytes]:
    """A digest of each row's exact content (dtype, shape and bytes): equal inputs, equal keys.

    SHA-256 over the row's memory in place: CPUs hash it in hardware (SHA-NI), about 2x BLAKE2b's
    speed here, and no copy is made (a batch of 64 images at 224 px: ~27 ms instead of ~76 ms,
    measured once on these cores)."""
    rows = x.detach().cpu().contiguous()
    header = f"{rows.dtype}{tuple(rows.shape[1:])}".encode()
    flat = rows.reshape(len(rows), -1).view(torch.uint8).numpy()
    keys = []
    for row in flat:
        digest = hashlib.sha256(header)
        digest.update(row.data)
        keys.append(digest.digest())
    return keys


class FrozenOutputCache:
    """Caches a locked module's per-sample outputs by the exact content of each input row.

    The module must be deterministic (eval mode, frozen) and compute each row from that row alone
    (true of encoders in eval mode); its outputs are a Tensor [B, ...] or a NamedTuple such as
    PointSet whose tensors are [B, ...]. Only rows never seen before are computed (as one smaller
    batch, without autograd); the batch is then assembled from the cache.
    """

    def __init__(self, forward: Callable, max_entries: int = MAX_CACHED) -> None:
        self.forward = forward
        self.max_entries = max_entries
        self.store: dict[bytes, Any] = {}
        self.computed = 0  # rows actually encoded (for tests and benchmarks)

    @classmethod
    def attach(cls, module: nn.Module, max_entries: int = MAX_CACHED) -> FrozenOutputCache:
        """Route ``module``'s forward through a cache (an instance attribute: state-dict keys and the
        module tree stay as they are)."""
        cache = cls(module.forward, max_entries)
        module.forward = cache
        module.output_cache = cache
        return cache

    def __call__(self, x: Tensor, *args, **kwargs):
        if args or kwargs or not isinstance(x, Tensor) or torch.is_grad_enabled() and x.requires_grad:
            return self.forward(x, *args, **kwargs)
        keys = row_keys(x)
        new = [i for i, key in enumerate(keys) if key not in self.store]
        if new:
            with torch.no_grad():
                out = self.forward(x[new] if len(new) < len(keys) else x)
            self.computed += len(new)
            fresh = {keys[i]: row_of(out, j) for j, i in enumerate(new)}
            if len(self.store) + len(fresh) > self.max_entries:
                return out if len(new) == len(keys) else stack([fresh.get(k) or self.store[k] for k in keys])
            self.store.update(fresh)
        return stack([self.store[key] for key in keys])


def row_of(out, j: int):
    """Row ``j`` of a Tensor, or (the NamedTuple's type, row ``j`` of each tensor field, other
    fields as they are); kept unvalidated, since a single row is not a valid batch."""
    if isinstance(out, Tensor):
        return out[j].detach()
    return (type(out), tuple(v[j].detach() if isinstance(v, Tensor) else v for v in out))


def stack(rows: list):
    """Inverse of :func:`row_of` over a batch of rows."""
    first = rows[0]
    if isinstance(first, Tensor):
        return torch.stack(rows)
    kind = first[0]
    fields = zip(*(row[1] for row in rows), strict=True)
    return kind(*(torch.stack(list(v)) if isinstance(v[0], Tensor) else v[0] for v in fields))
