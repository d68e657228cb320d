"""What a tiled loss receives instead of :class:`clipkit.contract.types.Logits`: the similarity's features and
scorer, with row/column reductions, positives and per-direction targets — never an N×N tensor.

Directions follow :class:`~clipkit.contract.types.Logits`: ``"i2t"`` rows are image anchors scored against
text candidates, ``"t2i"`` rows are text anchors against image candidates. In the global loss both
are the rows and the columns of one matrix, reduced in one sweep; with
``train.distributed.local_loss`` each direction has its own matrix (this process's anchors against
the gathered candidates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from clipkit.tiled.engine import DIRECTIONS, Features, Reduction, Scorer, Sweep, blocks, run_sweep


@dataclass(frozen=True)
class Side:
    """One direction's matrix: anchors and candidates as feature rows, and each anchor's positive.

    anchors_a: True when the anchors are the A (image) side of ``score``.
    """

    anchors: Features
    candidates: Features
    targets: Tensor  # [rows] long, candidate index of each anchor's positive
    anchors_a: bool


class TiledLogits:
    """Reductions over the logits of both directions, computed tile by tile.

    score: the similarity's ``score_tile`` (A features, B features) -> [ta, tb] logits.
    sides: direction -> :class:`Side`. When both directions share one matrix (the global loss), the
        i2t side's candidates are the t2i side's anchors and one sweep serves both.
    parameters: the similarity's parameters that need a gradient (``score`` reads them).
    score_pairs: optional (A features, B features) -> [n] logits of row-aligned pairs.
    fused: optional :class:`clipkit.tiled.fused.FusedSweeps`: the sweeps it accepts run in the fused
        kernels, the others in the generic engine.
    """

    def __init__(self, score: Scorer, sides: dict[str, Side], parameters, tile_size: int, *, shared: bool,
                 score_pairs=None, fused=None) -> None:  # fmt: skip
        if tile_size < 1:
            raise ValueError(f"tile_size must be >= 1, got {tile_size}")
        self.score, self.sides, self.tile_size, self.shared = score, sides, int(tile_size), shared
        self.parameters = tuple(p for p in parameters if p.requires_grad)
        self._score_pairs = score_pairs
        self.fused = fused

    def num_rows(self, direction: str) -> int:
        """The number of anchors of ``direction`` (the mean's denominator of a per-row loss)."""
        return self.sides[_checked(direction)].anchors[0].shape[0]

    def num_candidates(self, direction: str) -> int:
        return self.sides[_checked(direction)].candidates[0].shape[0]

    def targets(self, direction: str) -> Tensor:
        """[rows] long, each anchor's positive among the candidates."""
        return self.sides[_checked(direction)].targets

    def positives(self, direction: str) -> Tensor:
        """[rows] L[r, targets[r]], differentiable (O(rows·tile) work, no N×N)."""
        side = self.sides[_checked(direction)]
        partners = tuple(f[side.targets] for f in side.candidates)
        a, b = (side.anchors, partners) if side.anchors_a else (partners, side.anchors)
        if self.fused is not None:  # in the kernels' precision (fp32 for 16-bit rows), as their lse
            return self.fused.score_pairs(a, b)
        if self._score_pairs is not None:
            return self._score_pairs(a, b)
        chunks = blocks(len(a[0]), self.tile_size)
        return torch.cat([self.score(_rows(a, s), _rows(b, s)).diagonal() for s in chunks])

    def reduce(self, *reductions: Reduction) -> list[Tensor]:
        """The reductions' [rows] values in order; all reductions of one matrix share one sweep."""
        for reduction in reductions:
            _checked(reduction.direction)
        if self.shared:
            return self._run(self._sweep(reductions, self.sides["i2t"]))
        results: dict[int, Tensor] = {}
        for direction in DIRECTIONS:
            chosen = [(i, r) for i, r in enumerate(reductions) if r.direction == direction]
            if not chosen:
                continue
            side = self.sides[direction]
            values = self._run(self._sweep(tuple(r for _, r in chosen), side))
            results.update({i: v for (i, _), v in zip(chosen, values, strict=True)})
        return [results[i] for i in range(len(reductions))]

    def views(self) -> TiledLogits:
        """The 2N × 2N matrix of both sides' rows against both (two-view losses, y-Aware / SupCon):
        rows 0..N−1 are the A rows, N..2N−1 the B rows, so its diagonal blocks are the in-modal
        logits and its off-diagonal blocks i2t and t2i (for a symmetric ``score``, as every built-in
        tileable similarity is). Each row's target is itself: ``exclude_positive`` drops self-pairs."""
        if not self.shared:
            raise ValueError("views() needs the global batch (not train.distributed.local_loss)")
        side = self.sides["i2t"]
        both = tuple(torch.cat([a, b]) for a, b in zip(side.anchors, side.candidates, strict=True))
        rows = torch.arange(both[0].shape[0], device=side.targets.device)
        return global_logits(self.score, both, both, rows, self.parameters, self.tile_size, self._score_pairs,
                             fused=self.fused)  # fmt: skip

    def _run(self, sweep: Sweep) -> list[Tensor]:
        """The sweep in the fused kernels when they accept it, else in the generic engine."""
        if self.fused is not None and self.fused.accepts(sweep):
            return self.fused.run(sweep)
        return run_sweep(sweep)

    def _sweep(self, reductions, side: Side) -> Sweep:
        """The sweep over ``side``'s matrix, oriented as score(A, B)."""
        if side.anchors_a:
            a, b = side.anchors, side.candidates
        else:
            a, b = side.candidates, side.anchors
        direction = "i2t" if side.anchors_a else "t2i"
        targets = {direction: side.targets}
        if self.shared:
            targets = {d: s.targets for d, s in self.sides.items()}
        return Sweep(self.score, a, b, targets, self.parameters, tuple(reductions), self.tile_size)


def _rows(features: Features, rows: slice) -> Features:
    return tuple(f[rows] for f in features)


def _checked(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    return direction


def global_logits(score: Scorer, features_a: Features, features_b: Features, targets: Tensor, parameters,
                  tile_size: int, score_pairs=None, fused=None) -> TiledLogits:  # fmt: skip
    """Every anchor against every candidate of one batch (targets [N]: the diagonal, arange(N))."""
    sides = {
        "i2t": Side(features_a, features_b, targets, anchors_a=True),
        "t2i": Side(features_b, features_a, targets, anchors_a=False),
    }
    return TiledLogits(score, sides, parameters, tile_size, shared=True, score_pairs=score_pairs, fused=fused)


def local_logits(score: Scorer, local_a: Features, all_b: Features, all_a: Features, local_b: Features,
                 targets: Tensor, parameters, tile_size: int, score_pairs=None,
                 fused=None) -> TiledLogits:  # fmt: skip
    """This process's anchors against the gathered candidates (``train.distributed.local_loss``).

    targets [n]: the local anchors' positives among the N gathered candidates (rank·n + arange(n)).
    """
    sides = {
        "i2t": Side(local_a, all_b, targets, anchors_a=True),
        "t2i": Side(local_b, all_a, targets, anchors_a=False),
    }
    return TiledLogits(
        score, sides, parameters, tile_size, shared=False, score_pairs=score_pairs, fused=fused
    )
