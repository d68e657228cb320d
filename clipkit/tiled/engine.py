"""The tiled sweep: row and column reductions of a similarity matrix that is never materialised.

A *matrix* is ``L[i, j] = score(A_i, B_j)`` for the feature rows ``A`` [Na, ...] and ``B`` [Nb, ...]
a pairwise similarity hands out (:mod:`clipkit.tiled.contract`). A *reduction* runs over the rows of
one direction: ``"i2t"`` reduces each row i of L over j (image anchors), ``"t2i"`` each column j over
i (text anchors). Every reduction of one matrix is computed in one sweep over ``tile × tile`` blocks,
so the peak memory is O((Na + Nb)·D + tile²) instead of O(Na·Nb).

The backward pass recomputes each tile (the FlashAttention / Inf-CL pattern) instead of storing
it: for the tile's logits it builds the surrogate Σ_r g_r·(∂ reduction_r / ∂L)·L, whose gradient
through the similarity's own ``score`` is the exact gradient, and back-propagates it to the tile's
feature rows and the similarity's parameters. Nothing of size N² is kept between tiles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

DIRECTIONS = ("i2t", "t2i")

#: Features of one side: a tuple of tensors whose first dimension is the batch (rows).
Features = tuple[Tensor, ...]
#: The similarity's tile scorer: (features of some A rows, features of some B rows) -> [ta, tb] logits.
Scorer = Callable[[Features, Features], Tensor]


@dataclass(frozen=True)
class Tile:
    """One block of a direction's logits, oriented as that direction's rows × candidates.

    rows:     [tr] long, global indices of the direction's anchors in this tile.
    cols:     [tc] long, global indices of the candidates in this tile.
    positive: [tr, tc] bool, True where cols == the row's target (its positive).
    """

    rows: Tensor
    cols: Tensor
    positive: Tensor


@dataclass(frozen=True, eq=False)
class LogSumExp:
    """[rows] lse_j (L_rj + offset_rj) over the direction's candidates j, differentiable.

    exclude_positive: leave each row's positive out (InfoLOOB, DCL, debiased contrastive).
    offset: ``offset(tile) -> [tr, tc]`` (or broadcastable) constant log-weights added to the logits
        before the lse, e.g. ``lambda t: log_w[t.cols]`` for per-candidate weights; no gradient.
    """

    direction: str
    exclude_positive: bool = False
    offset: Callable[[Tile], Tensor] | None = None


@dataclass(frozen=True, eq=False)
class RowSum:
    """[rows] Σ_j fn(L_rj, tile) over the direction's candidates, differentiable through ``fn``.

    fn: ``fn(logits [tr, tc], tile) -> [tr, tc]`` elementwise terms (SigLIP's pairwise sigmoid,
        soft-target weights times logits, label smoothing's mean logit).
    """

    direction: str
    fn: Callable[[Tensor, Tile], Tensor]


@dataclass(frozen=True, eq=False)
class ArgMax:
    """[rows] long, the candidate index of each row's largest logit (first one on ties, as
    ``torch.argmax``); not differentiable (accuracy metrics)."""

    direction: str


@dataclass(frozen=True, eq=False)
class Max:
    """[rows] each row's largest logit; not differentiable (NUCLR's running offset b)."""

    direction: str


Reduction = LogSumExp | RowSum | ArgMax | Max


@dataclass(frozen=True)
class Sweep:
    """One matrix and the reductions over it.

    features_a, features_b: the A rows (i2t anchors) and B rows (t2i anchors).
    targets: direction -> [rows] long, each row's positive among that direction's candidates.
    parameters: the similarity's tensors ``score`` reads that need a gradient.
    """

    score: Scorer
    features_a: Features
    features_b: Features
    targets: dict[str, Tensor]
    parameters: tuple[Tensor, ...]
    reductions: tuple[Reduction, ...]
    tile_size: int

    @property
    def rows_a(self) -> int:
        return self.features_a[0].shape[0]

    @property
    def rows_b(self) -> int:
        return self.features_b[0].shape[0]


def run_sweep(sweep: Sweep) -> list[Tensor]:
    """The reductions' values, in order (differentiable w.r.t. the features and parameters)."""
    inputs = (*sweep.features_a, *sweep.features_b, *sweep.parameters)
    return list(_SweepFunction.apply(sweep, *inputs))


def blocks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _take(features: Features, rows: slice) -> Features:
    return tuple(f[rows] for f in features)


def _direction_tile(sweep: Sweep, direction: str, rows_a: slice, rows_b: slice, device) -> Tile:
    """The Tile of ``direction`` for the matrix block (rows_a, rows_b)."""
    rows, cols = (rows_a, rows_b) if direction == "i2t" else (rows_b, rows_a)
    row_ids = torch.arange(rows.start, rows.stop, device=device)
    col_ids = torch.arange(cols.start, cols.stop, device=device)
    positive = sweep.targets[direction][rows].unsqueeze(1) == col_ids.unsqueeze(0)
    return Tile(row_ids, col_ids, positive)


def _oriented(logits: Tensor, direction: str) -> Tensor:
    return logits if direction == "i2t" else logits.t()


def _lse_values(reduction: LogSumExp, logits: Tensor, tile: Tile) -> Tensor:
    """[tr, tc] the values the lse runs over (the positive at −inf when excluded)."""
    values = logits if reduction.offset is None else logits + reduction.offset(tile)
    if reduction.exclude_positive:
        values = values.masked_fill(tile.positive, float("-inf"))
    return values


def _rows_of(sweep: Sweep, direction: str) -> int:
    return sweep.rows_a if direction == "i2t" else sweep.rows_b


class _SweepFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sweep: Sweep, *inputs: Tensor):
        reference = sweep.features_a[0]
        states = [_initial_state(sweep, r, reference) for r in sweep.reductions]
        with torch.no_grad():
            for rows_a in blocks(sweep.rows_a, sweep.tile_size):
                fa = _take(sweep.features_a, rows_a)
                for rows_b in blocks(sweep.rows_b, sweep.tile_size):
                    logits = sweep.score(fa, _take(sweep.features_b, rows_b))
                    for index, reduction in enumerate(sweep.reductions):
                        tile = _direction_tile(sweep, reduction.direction, rows_a, rows_b, logits.device)
                        _accumulate(reduction, states[index], _oriented(logits, reduction.direction), tile)
        outputs = tuple(_finish(r, s) for r, s in zip(sweep.reductions, states, strict=True))
        ctx.sweep = sweep
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: its tiles are skipped
        ctx.save_for_backward(*inputs, *outputs)
        indices = [o for r, o in zip(sweep.reductions, outputs, strict=True) if isinstance(r, ArgMax | Max)]
        ctx.mark_non_differentiable(*indices)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs: Tensor | None):
        sweep: Sweep = ctx.sweep
        saved = ctx.saved_tensors
        count_a, count_b = len(sweep.features_a), len(sweep.features_b)
        split = len(saved) - len(sweep.reductions)
        inputs, outputs = saved[:split], saved[split:]
        features_a, features_b = inputs[:count_a], inputs[count_a : count_a + count_b]
        live = [
            (reduction, output, grad)
            for reduction, output, grad in zip(sweep.reductions, outputs, grad_outputs, strict=True)
            if grad is not None and not isinstance(reduction, ArgMax | Max)
        ]
        grads = [torch.zeros_like(t) if _wants_grad(t, ctx, i) else None for i, t in enumerate(inputs)]
        if not live:
            return (None, *grads)
        for rows_a in blocks(sweep.rows_a, sweep.tile_size):
            for rows_b in blocks(sweep.rows_b, sweep.tile_size):
                _backward_tile(sweep, live, features_a, features_b, rows_a, rows_b, grads)
        return (None, *grads)


def _wants_grad(tensor: Tensor, ctx, index: int) -> bool:
    return ctx.needs_input_grad[index + 1] and tensor.is_floating_point()


def _leaves(features: Features, rows: slice, grads: Sequence[Tensor | None]) -> Features:
    """The tile's feature rows, cut from the graph; those whose input wants a gradient require one."""
    return tuple(
        f[rows].detach().requires_grad_(grad is not None) for f, grad in zip(features, grads, strict=True)
    )


def _backward_tile(sweep, live, features_a, features_b, rows_a, rows_b, grads) -> None:
    """Add one recomputed tile's contribution to ``grads`` (features a, features b, parameters).

    The tile's logits are recomputed with a graph; their gradient dL = Σ_r g_r·∂reduction_r/∂L is
    formed directly (softmax weights for a log-sum-exp, autograd of ``fn`` for a row sum) and sent
    back through the similarity's ``score`` with one ``autograd.grad``. ``score`` reads the
    similarity's own parameters (leaves that require grad); ``autograd.grad`` returns their tile
    gradient without touching ``.grad``, and the sum over tiles is returned to autograd as this
    function's gradient for them.
    """
    count_a, count_b = len(features_a), len(features_b)
    grads_a, grads_b = grads[:count_a], grads[count_a : count_a + count_b]
    with torch.enable_grad():
        leaves_a, leaves_b = _leaves(features_a, rows_a, grads_a), _leaves(features_b, rows_b, grads_b)
        logits = sweep.score(leaves_a, leaves_b)
    upstream = torch.zeros_like(logits, requires_grad=False)
    for reduction, output, grad in live:
        tile = _direction_tile(sweep, reduction.direction, rows_a, rows_b, logits.device)
        oriented = _oriented(logits.detach(), reduction.direction)
        value, grad_value = output[tile.rows].detach(), grad[tile.rows].detach()
        _oriented(upstream, reduction.direction).add_(
            _logit_gradient(reduction, oriented, tile, value, grad_value)
        )
    pairs = [
        (tensor, grad)
        for tensor, grad in zip((*leaves_a, *leaves_b, *sweep.parameters), grads, strict=True)
        if grad is not None
    ]
    if not pairs or not logits.requires_grad:
        return
    computed = torch.autograd.grad(logits, [t for t, _ in pairs], grad_outputs=upstream, allow_unused=True)
    slots = [rows_a] * count_a + [rows_b] * count_b + [slice(None)] * (len(grads) - count_a - count_b)
    wanted = [slot for slot, grad in zip(slots, grads, strict=True) if grad is not None]
    for (_, grad), slot, value in zip(pairs, wanted, computed, strict=True):
        if value is not None:
            grad[slot] += value


def _logit_gradient(reduction, logits: Tensor, tile: Tile, output: Tensor, grad: Tensor) -> Tensor:
    """[tr, tc] grad_r · ∂reduction_r/∂L_rc for the (detached) tile logits of the direction."""
    if isinstance(reduction, LogSumExp):
        values = _lse_values(reduction, logits, tile)
        return (values - output.unsqueeze(1)).exp() * grad.unsqueeze(1)  # softmax · g (0 where excluded)
    with torch.enable_grad():
        leaf = logits.detach().requires_grad_()
        terms = reduction.fn(leaf, tile)
        if not terms.requires_grad:  # a term that does not depend on the logits (e.g. weights alone)
            return torch.zeros_like(logits)
        (value,) = torch.autograd.grad(terms, leaf, grad.unsqueeze(1).expand_as(terms), allow_unused=True)
    return torch.zeros_like(logits) if value is None else value


def _initial_state(sweep: Sweep, reduction: Reduction, reference: Tensor) -> list[Tensor]:
    rows = _rows_of(sweep, reduction.direction)
    dtype, device = _score_dtype(sweep, reference), reference.device
    if isinstance(reduction, LogSumExp):
        return [torch.full((rows,), float("-inf"), dtype=dtype, device=device)]
    if isinstance(reduction, RowSum):
        return [torch.zeros(rows, dtype=dtype, device=device)]
    return [
        torch.full((rows,), float("-inf"), dtype=dtype, device=device),
        torch.zeros(rows, dtype=torch.long, device=device),
    ]


def _score_dtype(sweep: Sweep, reference: Tensor) -> torch.dtype:
    floating = [f for f in (*sweep.features_a, *sweep.parameters) if f.is_floating_point()]
    return torch.promote_types(floating[0].dtype, floating[-1].dtype) if floating else reference.dtype


def _accumulate(reduction: Reduction, state: list[Tensor], logits: Tensor, tile: Tile) -> None:
    rows = slice(int(tile.rows[0]), int(tile.rows[-1]) + 1)
    if isinstance(reduction, LogSumExp):
        values = _lse_values(reduction, logits, tile)
        state[0][rows] = torch.logaddexp(state[0][rows], torch.logsumexp(values, dim=1).to(state[0].dtype))
    elif isinstance(reduction, RowSum):
        state[0][rows] += reduction.fn(logits, tile).sum(dim=1).to(state[0].dtype)
    else:
        best, where = logits.max(dim=1)
        better = best.to(state[0].dtype) > state[0][rows]  # strict: the earliest column wins ties
        state[0][rows] = torch.where(better, best.to(state[0].dtype), state[0][rows])
        state[1][rows] = torch.where(better, where + tile.cols[0], state[1][rows])


def _finish(reduction: Reduction, state: list[Tensor]) -> Tensor:
    return state[1] if isinstance(reduction, ArgMax) else state[0]  # Max keeps ArgMax's running value
