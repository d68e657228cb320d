"""Parameter groups of the built-in optimizers: per-tower and similarity learning rates and weight
decay, and layer-wise learning-rate decay per tower (BEiT's rule, as open_clip applies it to CLIP).

Every trainable parameter belongs to a *part*, the first component of its name: ``image_encoder``,
``text_encoder``, ``similarity`` (the logit scale and bias) or anything else (the optimizer's own
settings). Within a part:

* **learning rate** = the part's lr (``image_lr``, ``text_lr``, ``similarity_lr``; unset: ``lr``)
  × ``layer_decay ** (L + 1 - layer)`` for towers, where the tower's depth L and each parameter's
  layer come from its names (:func:`layer_ids`): parameters of block i are layer i + 1, those
  before the first block (embeddings, stem) layer 0, those after the last (final norm, projection)
  layer L + 1, whose factor is 1. ``layer_decay`` 1 (the default) gives every layer the part's lr.
* **weight decay** = the part's (``image_weight_decay``, ``text_weight_decay``; unset:
  ``weight_decay``) on matrices and kernels (ndim >= 2) only. The similarity's parameters are
  scalars and are not decayed unless ``similarity_weight_decay`` is set, which then applies to all
  of them (an explicit request).

Each group carries a ``name`` ("image_encoder/layer3/decay") so logs and tests can find it. The
schedule multiplies every group's lr by the same factor, so the ratios hold through training.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

TOWERS = {"image_encoder": "image", "text_encoder": "text"}
SIMILARITY = "similarity"
_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class GroupRule:
    """An optimizer's group settings (its own arguments; None = the optimizer's base value)."""

    lr: float
    weight_decay: float
    layer_decay: float = 1.0
    image_lr: float | None = None
    text_lr: float | None = None
    similarity_lr: float | None = None
    image_weight_decay: float | None = None
    text_weight_decay: float | None = None
    similarity_weight_decay: float | None = None
    image_layer_decay: float | None = None
    text_layer_decay: float | None = None

    @classmethod
    def of(cls, arguments: dict) -> GroupRule:
        """The rule from an optimizer factory's ``locals()`` (its other arguments ignored)."""
        names = cls.__dataclass_fields__
        return cls(**{key: value for key, value in arguments.items() if key in names})

    @property
    def uniform(self) -> bool:
        """No per-part setting and no layer decay: every parameter gets the base lr."""
        specific = [v for k, v in vars(self).items() if k.startswith(("image_", "text_", "similarity_"))]
        return self.layer_decay == 1.0 and all(value is None for value in specific)

    def part_lr(self, part: str) -> float:
        value = getattr(self, f"{TOWERS.get(part, part)}_lr", None) if part != "other" else None
        return self.lr if value is None else value

    def part_weight_decay(self, part: str) -> float | None:
        """The part's decay on matrices; for the similarity, on every parameter (None: none)."""
        if part == SIMILARITY:
            return self.similarity_weight_decay
        value = getattr(self, f"{TOWERS[part]}_weight_decay") if part in TOWERS else None
        return self.weight_decay if value is None else value

    def part_layer_decay(self, part: str) -> float:
        value = getattr(self, f"{TOWERS[part]}_layer_decay") if part in TOWERS else None
        return (self.layer_decay if value is None else value) if part in TOWERS else 1.0


def part_of(name: str) -> str:
    """``image_encoder``, ``text_encoder``, ``similarity`` or ``other``."""
    head = name.split(".", 1)[0]
    return head if head in TOWERS or head == SIMILARITY else "other"


#: Words that mark a parameter held directly by the tower (not in a sub-module) as input-side.
INPUT_SIDE = re.compile(r"embed|pos|cls|class|token|patch|stem")


def layer_ids(names: list[str]) -> tuple[dict[str, int], int]:
    """Each name's layer within one tower, and the tower's depth L (names in registration order).

    The tower's blocks are the indexed container (a ``….<i>.…`` path prefix) with the most entries
    (a transformer's ``blocks`` / ``layers``; a ResNet's largest stage). Block i is layer i + 1.
    Sub-modules registered before the blocks (patch embedding, ``ln_pre``) are layer 0, those after
    (final norm, projection) L + 1. Parameters held directly by the tower or a module around the
    blocks are listed before every sub-module whatever they do, so their name decides: an input-side
    name (embed, pos, cls, class, token, patch, stem) is layer 0, any other (``proj``) L + 1.
    Without any indexed container the tower is one layer (L = 0: every name is layer 1, factor 1).
    """
    entries: dict[str, set[int]] = defaultdict(set)
    for name in names:
        match = _INDEX.search(name)
        if match:
            entries[name[: match.start()]].add(int(match.group(1)))
    if not entries:
        return {name: 1 for name in names}, 0
    trunk = max(entries, key=lambda prefix: len(entries[prefix]))  # first of the largest on ties
    depth = max(entries[trunk]) + 1
    around = {trunk.rsplit(".", k)[0] for k in range(1, trunk.count(".") + 1)} | {""}  # modules around it
    ids, seen_block = {}, False
    for name in names:
        block = re.match(re.escape(trunk) + r"\.(\d+)\.", name)
        owner = name.rpartition(".")[0]
        if block:
            ids[name], seen_block = int(block.group(1)) + 1, True
        elif owner in around:  # a direct parameter: listed first, placed by its name
            ids[name] = 0 if INPUT_SIDE.search(name.rpartition(".")[2]) else depth + 1
        else:
            ids[name] = depth + 1 if seen_block else 0
    return ids, depth


def parameter_groups(named_parameters, rule: GroupRule) -> list[dict]:
    """The trainable parameters as optimizer groups (``params``, ``lr``, ``weight_decay``,
    ``name``), one per (part, layer, decayed or not); empty groups are left out. A uniform rule
    gives the two groups clipkit always had (decayed matrices, then the rest), so optimiser states
    of earlier checkpoints still fit."""
    if rule.uniform:
        return uniform_groups(named_parameters, rule)
    by_part: dict[str, list] = defaultdict(list)
    for name, parameter in named_parameters:
        if parameter.requires_grad:
            by_part[part_of(name)].append((name, parameter))
    groups: dict[tuple, dict] = {}
    for part, named in by_part.items():
        ids, depth = layer_ids([name for name, _ in named]) if part in TOWERS else ({}, 0)
        decay_rate = rule.part_layer_decay(part)
        for name, parameter in named:
            layer = ids.get(name, depth + 1)
            lr = rule.part_lr(part) * decay_rate ** (depth + 1 - layer)
            decay = rule.part_weight_decay(part)
            decayed = decay is not None and (part == SIMILARITY or parameter.ndim >= 2)
            key = (part, layer, decayed)
            if key not in groups:
                label = f"{part}/layer{layer}" if part in TOWERS else part
                groups[key] = {
                    "params": [],
                    "lr": lr,
                    "weight_decay": decay if decayed else 0.0,
                    "name": f"{label}/{'decay' if decayed else 'no_decay'}",
                }
            groups[key]["params"].append(parameter)
    return list(groups.values())


def uniform_groups(named_parameters, rule: GroupRule) -> list[dict]:
    """Trainable parameters split into a decayed group (ndim >= 2) and an undecayed one."""
    decay, no_decay = [], []
    for _, parameter in named_parameters:
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    groups = [
        {"params": decay, "lr": rule.lr, "weight_decay": rule.weight_decay, "name": "all/decay"},
        {"params": no_decay, "lr": rule.lr, "weight_decay": 0.0, "name": "all/no_decay"},
    ]
    return [group for group in groups if group["params"]]
