"""``loss.tiled`` and ``loss.tile_size``: the recipe's switch for the tiled path.

They live in the loss slot (they describe how the loss is computed) but are read by the host, never
passed to the loss factory:

    loss.tiled:     auto (default) | true | false
        auto  — tiled when the contrastive batch exceeds ``AUTO_ABOVE`` and both the similarity and
                the loss have a tiled form (the full path otherwise);
        true  — always tiled; a similarity or loss without a tiled form is refused (naming why);
        false — always the full N×N logits.
    loss.tile_size: rows and columns per tile (default 1024); memory per tile ≈ a few tile² floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clipkit.errors import ClipkitError

#: Keys of the loss slot that the host reads and the loss factory never sees.
HOST_KEYS = ("tiled", "tile_size")
MODES = ("auto", "true", "false")
DEFAULT_TILE_SIZE = 1024
#: ``auto`` tiles above this contrastive batch: the full fp32 logits would then take 2·N² floats
#: (≥ 512 MiB for both directions), and the tiled path costs about the same time.
AUTO_ABOVE = 8192


@dataclass(frozen=True)
class Tiling:
    """The resolved switch: mode one of :data:`MODES`, tile_size ≥ 1."""

    mode: str = "auto"
    tile_size: int = DEFAULT_TILE_SIZE

    def applies(self, batch_size: int, refusal: str | None) -> bool:
        """Whether a contrastive batch of ``batch_size`` runs tiled; ``refusal`` is why the recipe's
        similarity or loss cannot (None when both can). Raises when ``tiled: true`` meets a refusal."""
        if self.mode == "false":
            return False
        if refusal is not None:
            if self.mode == "true":
                raise ClipkitError(f"loss.tiled: true, but {refusal}; set loss.tiled=false (or auto)")
            return False
        return self.mode == "true" or batch_size > AUTO_ABOVE


def for_runtime(tiling: Tiling, distributed: Any) -> Tiling:
    """``tiling`` for the run's strategy: ZeRO-3 partitions the similarity's parameters outside its
    module's forward, where the tiled backward re-scores tiles, so ``true`` is refused there and
    ``auto`` stays on the full path."""
    if getattr(distributed, "strategy", "ddp") != "deepspeed" or getattr(distributed, "zero_stage", 0) != 3:
        return tiling
    if tiling.mode == "true":
        raise ClipkitError(
            "loss.tiled: true is not supported under DeepSpeed ZeRO-3 (the tiled backward re-scores tiles "
            "outside the similarity's forward, where ZeRO-3 has partitioned its parameters); "
            "use zero_stage 1/2 or loss.tiled=false"
        )
    return Tiling("false", tiling.tile_size)


def _mode(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value.lower() in MODES:
        return value.lower()
    return None


def errors(config: Any) -> list[str]:
    """Problems with the host keys of the loss slot ``config``, as 'loss.key: message'."""
    if not isinstance(config, dict):
        return []
    found = []
    if "tiled" in config and _mode(config["tiled"]) is None:
        found.append(f"loss.tiled: must be auto, true or false, got {config['tiled']!r}")
    size = config.get("tile_size", DEFAULT_TILE_SIZE)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        found.append(f"loss.tile_size: must be an integer >= 1 (rows and columns per tile), got {size!r}")
    return found


def split(config: dict) -> tuple[dict, Tiling]:
    """The loss slot without the host keys (what the factory receives), and its :class:`Tiling`."""
    problems = errors(config)
    if problems:
        raise ClipkitError("; ".join(problems))
    factory_config = {k: v for k, v in config.items() if k not in HOST_KEYS}
    tiling = Tiling(_mode(config.get("tiled", "auto")), int(config.get("tile_size", DEFAULT_TILE_SIZE)))
    return factory_config, tiling


def refusal_of_factories(recipe: dict, registry) -> str | None:
    """Why the recipe's similarity or loss *class* has no tiled form (read before building), or None."""
    from clipkit.tiled.contract import refusal

    try:
        loss = registry.factory("loss", recipe["loss"]["name"])
        similarity = registry.factory("similarity", recipe["similarity"]["name"])
    except Exception:  # unknown names are reported by the slot checks
        return None
    return refusal(loss, similarity)


def validation_errors(recipe: dict, registry) -> list[str]:
    """``loss.tiled: true`` with a similarity or loss that cannot be tiled, named at validation."""
    config = recipe.get("loss")
    if not isinstance(config, dict) or errors(config) or _mode(config.get("tiled", "auto")) != "true":
        return []
    reason = refusal_of_factories(recipe, registry)
    return [f"loss.tiled: true, but {reason}; set loss.tiled=false (or auto)"] if reason else []


def explain(recipe: dict, registry, batch_size: int) -> str:
    """One line for ``clipkit validate``: what ``loss.tiled`` does for this recipe and batch."""
    config = recipe.get("loss") if isinstance(recipe.get("loss"), dict) else {}
    _, tiling = split(config)
    reason = refusal_of_factories(recipe, registry)
    full_gib = 2 * batch_size**2 * 4 / 2**30  # i2t and t2i in fp32
    if tiling.mode == "false":
        verdict = "full N×N logits"
    elif reason is not None:
        verdict = f"full N×N logits ({reason})"
    elif tiling.mode == "true" or batch_size > AUTO_ABOVE:
        side = tiling.tile_size  # a similarity may cap it (kme: one block of its kernels)
        verdict = f"tiled, tiles of at most {side}×{side} recomputed in backward (exact)"
    else:
        verdict = f"full N×N logits (auto tiles above a batch of {AUTO_ABOVE})"
    return (
        f"# loss.tiled: {tiling.mode} — contrastive batch {batch_size}: {verdict}; "
        f"the full logits would take {full_gib:.3g} GiB (fp32, both directions); "
        f"set loss.tiled=true|false|auto, loss.tile_size=N"
    )


def logit_bytes(recipe: dict, rows: int, global_size: int, bytes_per_logit: int) -> int:
    """The memory estimate's logits term (clipkit.train.memory_fit): ``bytes_per_logit · rows · G``
    on the full path; tiled, a few tiles (the tile's logits, its softmax and gradient, the surrogate)
    plus per-row reduction states — O(tile² + G), no N². ``auto`` is assumed to tile above
    :data:`AUTO_ABOVE` (a recipe whose plugins cannot is then underestimated by the full term)."""
    config = recipe.get("loss") if isinstance(recipe.get("loss"), dict) else {}
    if errors(config):
        return bytes_per_logit * rows * global_size
    _, tiling = split(config)
    tiled = tiling.mode == "true" or (tiling.mode == "auto" and global_size > AUTO_ABOVE)
    if not tiled:
        return bytes_per_logit * rows * global_size
    tile = min(tiling.tile_size, global_size)
    return bytes_per_logit * tile * tile + 64 * global_size
