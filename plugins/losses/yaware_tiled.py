"""y-Aware InfoNCE, SimCLR and SupCon on tiled logits (``loss.tiled``; METHODS §5).

Over the 2N views F (:meth:`clipkit.tiled.TiledLogits.views`), with the target weights w_ik =
K(y_{i mod N}, y_{k mod N}) (0 on self-pairs) computed per tile from the meta-data:

    ℓ_i = lse_{k≠i} F_ik − S_i / W_i,   S_i = Σ_{k≠i} w_ik F_ik,   W_i = Σ_{k≠i} w_ik,

so the loss is mean_i ℓ_i — the paper's "rows" normalisation, in one sweep. The official code's
"code" normalisation divides by column sums of w weighted by each row's lse (two sweeps); it is
refused here with a message (use the full path).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from clipkit.errors import ClipkitError
from clipkit.plugins.losses.yaware import delta_codes, parse_kernel, rbf_pairs, rbf_values
from clipkit.tiled import ArgMax, LogSumExp, RowSum, TiledLogits
from clipkit.types import LossContext, LossOutput


def tile_kernel(meta: Mapping[str, Any], spec, size: int) -> Callable[[Tensor, Tensor], Tensor]:
    """(rows [tr], cols [tc] view indices in [0, 2N)) -> [tr, tc] float64 sample kernel of their samples."""
    spec = parse_kernel(spec)
    if isinstance(spec, str):  # same_sample: SimCLR
        return lambda rows, cols: ((rows % size).unsqueeze(1) == (cols % size).unsqueeze(0)).double()
    factors = []
    for factor in spec:
        if factor.key not in meta:
            raise ValueError(
                f"meta-data key {factor.key!r} required by the kernel is missing; got {sorted(meta)}"
            )
        values = meta[factor.key]
        if len(values) != size:
            raise ValueError(f"meta[{factor.key!r}] has {len(values)} values, expected {size}")
        if factor.type == "rbf":
            factors.append(("rbf", rbf_values(values, factor.key), factor.sigma))
        else:
            factors.append(("delta", delta_codes(values, factor.key), None))

    def kernel(rows: Tensor, cols: Tensor) -> Tensor:
        r, c = (rows % size).cpu(), (cols % size).cpu()
        out = torch.ones(len(r), len(c), dtype=torch.float64)
        for kind, values, sigma in factors:
            if kind == "rbf":
                out = out * rbf_pairs(values[r], values[c], sigma)
            else:
                out = out * (values[r].unsqueeze(1) == values[c].unsqueeze(0)).double()
        return out.to(rows.device)

    return kernel


def yaware_infonce_tiled(loss, logits: TiledLogits, ctx: LossContext) -> LossOutput:
    """:class:`clipkit.plugins.losses.yaware.YAwareInfoNCE` (and its SimCLR / SupCon forms) from tiles."""
    if loss.normalisation != "rows":
        raise ClipkitError(
            f"loss.tiled: y-Aware's normalisation {loss.normalisation!r} needs two sweeps and is not tiled; "
            "use normalisation=rows or loss.tiled=false"
        )
    size = logits.num_rows("i2t")
    meta = {} if isinstance(loss.kernel, str) else ctx.meta
    kernel = tile_kernel(meta, loss.kernel, size)
    views = logits.views()

    def weights(values: Tensor, tile) -> Tensor:
        return kernel(tile.rows, tile.cols).to(values.dtype).masked_fill(tile.positive, 0.0)

    lse, weighted, totals = views.reduce(
        LogSumExp("i2t", exclude_positive=True),
        RowSum("i2t", lambda values, tile: weights(values, tile) * values),
        RowSum("i2t", lambda values, tile: weights(values, tile)),
    )
    value = (lse - weighted / totals.detach()).mean()
    (best,) = logits.reduce(ArgMax("i2t"))
    return LossOutput(value, {"acc_i2t": (best == logits.targets("i2t")).float().mean()})
