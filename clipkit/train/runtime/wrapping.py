"""Which modules FSDP2 shards as one unit (each ``fully_shard`` call gathers its parameters once
per forward and backward, and frees them after).

Per-block wrapping: each tower's blocks are units of their own, so at most about one block's full
parameters are held at a time (plus the one being prefetched); each tower is a unit for what its
blocks leave (embeddings, heads, final norms); the step module is the root for what is left.

- An encoder plugin declares its blocks with a method ``sharding_blocks()`` returning its
  sub-modules to shard one by one (an empty list: the tower is one unit).
- Otherwise the default: the members of the tower's outermost ``nn.ModuleList``s (transformer
  layers, ResNet stages kept in a list) — the repeated blocks of most architectures.

The similarity's own parameters (a temperature, a bandwidth: a few numbers) are never sharded:
they stay plain tensors, identical on every process, so the loss can use them outside any forward
(exact accumulation's loss pass, the tiled backward, the logged ``logit_scale``), and their
gradients are averaged across processes as DDP would (:class:`~clipkit.train.runtime.fsdp2.FSDP2Strategy`).
"""

from __future__ import annotations

from torch import nn

from clipkit.contract.types import optional_member

TOWERS = ("image_encoder", "text_encoder")


def towers(model: nn.Module) -> list[nn.Module]:
    """The model's towers present (two_view has one; a shared tower is listed once)."""
    found: list[nn.Module] = []
    for name in TOWERS:
        tower = getattr(model, name, None)
        if isinstance(tower, nn.Module) and all(tower is not seen for seen in found):
            found.append(tower)
    return found


def blocks(tower: nn.Module) -> list[nn.Module]:
    """The tower's blocks: what its ``sharding_blocks()`` declares, else the default (above)."""
    declared = optional_member(tower, "sharding_blocks")
    if callable(declared):
        chosen = list(declared())
        for block in chosen:
            if not isinstance(block, nn.Module) or all(block is not m for m in tower.modules()):
                raise TypeError(
                    f"{type(tower).__name__}.sharding_blocks() must return sub-modules of the encoder"
                )
        return chosen
    return default_blocks(tower)


def default_blocks(tower: nn.Module) -> list[nn.Module]:
    """Members of the outermost ``nn.ModuleList``s under ``tower`` that own parameters."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                found.extend(m for m in child if any(True for _ in m.parameters()))
            else:
                visit(child)

    visit(tower)
    return found


def units(model: nn.Module) -> list[nn.Module]:
    """Modules to ``fully_shard``, innermost first (FSDP2 needs children before parents); the root
    (the step module holding ``model``'s children) is not listed."""
    chosen: list[nn.Module] = []
    for tower in towers(model):
        chosen += blocks(tower)
        chosen.append(tower)
    return chosen


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters left unsharded (plain and identical on every process): the similarity's."""
    similarity = getattr(model, "similarity", None)
    return list(similarity.parameters()) if isinstance(similarity, nn.Module) else []
