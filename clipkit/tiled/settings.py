"""``train.tiled`` and ``train.tile_size``: whether the loss runs tile by tile — a training setting.

    train.tiled:     auto (default) | true | false
        auto  — tiled when the contrastive batch exceeds ``AUTO_ABOVE`` and both the similarity and
                the loss have a tiled form (the full path otherwise);
        true  — always tiled; a similarity or loss without a tiled form is refused (naming why);
        false — always the full N×N logits.
    train.tile_size: rows and columns per tile (default 1024; a similarity may cap it); memory per
                tile ≈ a few tile² floats.

How the loss is computed is the host's business, like precision or accumulation, so the switch lives
in ``train``. Older recipes said ``loss.tiled`` / ``loss.tile_size``: read for this release with a
one-line deprecation warning (:func:`deprecation_warning`), never passed to the loss factory.

One rule decides, :func:`decide`: ``clipkit validate`` (its errors and its explanation), the memory
estimate (clipkit.train.memory_fit) and the build (clipkit.train.build) all ask it.
This module imports no torch: recipe validation reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clipkit.errors import ClipkitError

KEYS = ("tiled", "tile_size")
#: Keys of the loss slot that older recipes used for these settings (deprecated alias, this release).
DEPRECATED_LOSS_KEYS = KEYS
MODES = ("auto", "true", "false")
DEFAULT_TILE_SIZE = 1024
#: ``auto`` tiles above this contrastive batch: the full fp32 logits would then take 2·N² floats
#: (≥ 512 MiB for both directions), and the tiled path costs about the same time.
AUTO_ABOVE = 8192


@dataclass(frozen=True)
class Tiling:
    """The recipe's switch: mode one of :data:`MODES`, tile_size ≥ 1."""

    mode: str = "auto"
    tile_size: int = DEFAULT_TILE_SIZE


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` concluded for one contrastive batch: ``tile_size`` when the loss runs
    tiled (None: the full N×N logits) and why, in words for ``clipkit validate``."""

    tile_size: int | None
    why: str

    @property
    def tiled(self) -> bool:
        return self.tile_size is not None


def decide(tiling: Tiling, batch_size: int, refusal: str | None, *, strict: bool = True) -> Decision:
    """The one rule: does a contrastive batch of ``batch_size`` run tiled?

    ``refusal`` is why the recipe's similarity, loss or distributed strategy cannot run tiled (None
    when all can). ``tiled: true`` meeting a refusal raises (``strict``) — else it is reported in
    ``why`` and the full path is chosen.
    """
    if tiling.mode == "false":
        return Decision(None, "full N×N logits")
    if refusal is not None:
        if tiling.mode == "true" and strict:
            raise ClipkitError(f"train.tiled: true, but {refusal}; set train.tiled=false (or auto)")
        return Decision(None, f"full N×N logits ({refusal})")
    if tiling.mode == "true" or batch_size > AUTO_ABOVE:
        side = tiling.tile_size  # a similarity may cap it (kme: one block of its kernels)
        return Decision(side, f"tiled, tiles of at most {side}×{side} recomputed in backward (exact)")
    return Decision(None, f"full N×N logits (auto tiles above a batch of {AUTO_ABOVE})")


def _mode(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value.lower() in MODES:
        return value.lower()
    return None


def _section(recipe: dict, name: str) -> dict:
    value = recipe.get(name) if isinstance(recipe, dict) else None
    return value if isinstance(value, dict) else {}


def _sources(recipe: dict) -> list[tuple[str, dict]]:
    """Where the recipe sets the switch: ("train", section) and/or the deprecated ("loss", slot)."""
    found = []
    for place in ("train", "loss"):
        config = _section(recipe, place)
        if any(key in config for key in KEYS):
            found.append((place, config))
    return found


def errors(recipe: dict) -> list[str]:
    """Problems with ``train.tiled`` / ``train.tile_size`` (or their deprecated ``loss.`` spelling),
    as 'key.path: message'."""
    found = []
    sources = _sources(recipe)
    if len(sources) > 1:
        return [
            "loss.tiled: deprecated spelling of train.tiled, and the recipe sets both; "
            "keep train.tiled / train.tile_size only"
        ]
    for place, config in sources:
        if "tiled" in config and _mode(config["tiled"]) is None:
            found.append(f"{place}.tiled: must be auto, true or false, got {config['tiled']!r}")
        size = config.get("tile_size", DEFAULT_TILE_SIZE)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            found.append(
                f"{place}.tile_size: must be an integer >= 1 (rows and columns per tile), got {size!r}"
            )
    return found


def tiling_of(recipe: dict) -> Tiling:
    """The recipe's :class:`Tiling` (``train.tiled``, or the deprecated ``loss.tiled``)."""
    problems = errors(recipe)
    if problems:
        raise ClipkitError("; ".join(problems))
    sources = _sources(recipe)
    config = sources[0][1] if sources else {}
    return Tiling(_mode(config.get("tiled", "auto")), int(config.get("tile_size", DEFAULT_TILE_SIZE)))


def loss_factory_config(loss_config: dict) -> dict:
    """The loss slot as its factory receives it: without the deprecated ``tiled`` / ``tile_size``."""
    return {key: value for key, value in loss_config.items() if key not in DEPRECATED_LOSS_KEYS}


def deprecation_warning(recipe: dict) -> str | None:
    """One line when the recipe uses the deprecated ``loss.tiled`` / ``loss.tile_size``, else None."""
    used = [key for key in DEPRECATED_LOSS_KEYS if key in _section(recipe, "loss")]
    if not used:
        return None
    old = " and ".join(f"loss.{key}" for key in used)
    new = " and ".join(f"train.{key}" for key in used)
    verb = "are" if len(used) > 1 else "is"
    return f"warning: {old} {verb} deprecated and will be removed after this release; write {new} instead"


def plugin_refusal(recipe: dict, registry) -> str | None:
    """Why the recipe's similarity or loss *class* has no tiled form (read before building), or None."""
    from clipkit.tiled.contract import refusal

    try:
        loss = registry.factory("loss", recipe["loss"]["name"])
        similarity = registry.factory("similarity", recipe["similarity"]["name"])
    except Exception:  # unknown names are reported by the slot checks
        return None
    return refusal(loss, similarity)


def strategy_refusal(distributed: Any) -> str | None:
    """Why the recipe's ``train.distributed`` (a mapping) cannot run the tiled loss, or None: ZeRO-3
    partitions the similarity's parameters outside its module's forward, where the tiled backward
    re-scores tiles. (:attr:`clipkit.train.runtime.Runtime.tiling_refusal` asks this too.)"""
    if not isinstance(distributed, dict):
        return None  # a malformed train.distributed is reported by its own check
    if distributed.get("strategy", "ddp") == "deepspeed" and distributed.get("zero_stage", 2) == 3:
        return (
            "DeepSpeed ZeRO-3 partitions the similarity's parameters outside its forward, where the tiled "
            "backward re-scores tiles (use zero_stage 1/2)"
        )
    return None


def recipe_refusal(recipe: dict, registry) -> str | None:
    """Why this recipe cannot run tiled — its plugins or its distributed strategy — or None."""
    return plugin_refusal(recipe, registry) or strategy_refusal(_section(recipe, "train").get("distributed"))


def validation_errors(recipe: dict, registry) -> list[str]:
    """The setting's own problems, and ``train.tiled: true`` with something that cannot be tiled."""
    problems = errors(recipe)
    if problems or tiling_of(recipe).mode != "true":
        return problems
    try:
        decide(tiling_of(recipe), 0, recipe_refusal(recipe, registry))
    except ClipkitError as error:
        return [str(error)]
    return []


def explain(recipe: dict, registry, batch_size: int) -> str:
    """One line for ``clipkit validate``: what ``train.tiled`` does for this recipe and batch."""
    tiling = tiling_of(recipe)
    decision = decide(tiling, batch_size, recipe_refusal(recipe, registry), strict=False)
    full_gib = 2 * batch_size**2 * 4 / 2**30  # i2t and t2i in fp32
    return (
        f"# train.tiled: {tiling.mode} — contrastive batch {batch_size}: {decision.why}; "
        f"the full logits would take {full_gib:.3g} GiB (fp32, both directions); "
        f"set train.tiled=true|false|auto, train.tile_size=N"
    )


def logit_bytes(
    recipe: dict, rows: int, global_size: int, bytes_per_logit: int, refusal: str | None = None
) -> int:
    """The memory estimate's logits term (clipkit.train.memory_fit): ``bytes_per_logit · rows · G``
    on the full path; tiled, a few tiles (the tile's logits, its softmax and gradient, the surrogate)
    plus per-row reduction states — O(tile² + G), no N². ``refusal``: why the recipe cannot tile
    (:func:`recipe_refusal`; None when it can or is not known)."""
    if errors(recipe):
        return bytes_per_logit * rows * global_size
    decision = decide(tiling_of(recipe), global_size, refusal, strict=False)
    if not decision.tiled:
        return bytes_per_logit * rows * global_size
    tile = min(decision.tile_size, global_size)
    return bytes_per_logit * tile * tile + 64 * global_size
