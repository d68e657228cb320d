"""The fused tiled-loss kernels (clipkit/tiled/fused.py, issue 37) on CUDA at their default tiles,
against the full N×N path in float64 on the same (rounded) rows: loss, metrics and the gradients of
both sides, the scale and the bias; the global and the local-loss form; d = 128 and 768 (d split in
the backward), N not a multiple of any tile.

Tolerances (max |difference| / max(1, max |reference|); NaN/inf never pass):
- fp32 rows, IEEE dots: 2e-5 (fp32 rounding of sums over N·d ≈ 1e6 terms, tiled);
- bf16 rows: values 1e-4 (bf16 products exact in fp32, fp32 sums), gradients 2e-2 (G rounded to bf16
  before the G·B GEMM, bf16 gradients returned).
"""

from __future__ import annotations

import pytest
import torch

from clipkit.contract.testing import full_context
from clipkit.contract.types import Logits, PointSet
from clipkit.plugins.losses.baseline_losses import (
    DebiasedContrastiveLoss,
    DecoupledContrastiveLoss,
    SigLIPLoss,
)
from clipkit.plugins.losses.cloob import InfoLOOB
from clipkit.plugins.losses.infonce import InfoNCE
from clipkit.plugins.similarities.dot import DotSimilarity
from clipkit.tiled import fused
from clipkit.tiled.contract import tiled_global_loss, tiled_local_loss

pytestmark = pytest.mark.gpu
ON_GPU = torch.cuda.is_available()  # False only in the CPU debug mode (CLIPKIT_GPU_TESTS_ON_CPU=1)
DEVICE = "cuda" if ON_GPU else "cpu"
#: (N, d) on a GPU, and the CPU-debug sizes (the Triton interpreter is slow).
SHAPES = {"d128": (3001, 128), "d768": (1500, 768)} if ON_GPU else {"d128": (21, 24), "d768": (19, 40)}
PRECISIONS = {"fp32": (torch.float32, 2e-5, 2e-5), "bf16": (torch.bfloat16, 1e-4, 2e-2)}
LOSSES = {
    "infonce": InfoNCE,
    "siglip": SigLIPLoss,
    "infoloob": InfoLOOB,
    "dcl": DecoupledContrastiveLoss,
    "debiased": lambda: DebiasedContrastiveLoss(tau_plus=0.1, temperature=0.1),
}


def kernels_or_skip() -> None:
    if not fused.available():
        pytest.skip("triton is not installed")
    if not ON_GPU and not fused.interpreting():
        pytest.skip("the CPU debug mode runs the kernels under TRITON_INTERPRET=1")


def _rows(n: int, d: int, dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(n, 1, d, generator=generator), dim=-1)
    return x.to(DEVICE, dtype).requires_grad_()


def _close(what, want, got, tolerance):
    want, got = want.detach().double().cpu(), got.detach().double().cpu()
    assert torch.isfinite(want).all() and torch.isfinite(got).all(), f"{what}: not finite"
    scale = max(1.0, float(want.abs().max()))
    error = float((want - got).abs().max())
    assert error <= tolerance * scale, f"{what}: max |difference| {error:.3g} (scale {scale:.3g})"


def _compare(loss_name: str, shape: str, precision: str, local: tuple[int, int] | None) -> None:
    kernels_or_skip()
    (n, d), (dtype, value_tol, grad_tol) = SHAPES[shape], PRECISIONS[precision]
    x, y = _rows(n, d, dtype, 1), _rows(n, d, dtype, 2)
    similarity = DotSimilarity(init_scale=10.0, bias=-2.0).to(DEVICE)
    reference = DotSimilarity(init_scale=10.0, bias=-2.0).to(DEVICE).double()
    x64, y64 = (t.detach().double().requires_grad_() for t in (x, y))
    outputs = []
    for sim, (p, q), fused_path in ((similarity, (x, y), True), (reference, (x64, y64), False)):
        a, b = PointSet(p), PointSet(q)
        loss = LOSSES[loss_name]()
        if local is None:
            ctx = full_context(n, frozenset(), a, b)
            out = (tiled_global_loss(loss, sim, a, b, ctx, tile_size=1024, fused=True) if fused_path
                   else loss(sim(a, b), torch.arange(n, device=DEVICE), ctx))  # fmt: skip
        else:
            offset, rows = local
            la, lb = a.rows(offset, offset + rows), b.rows(offset, offset + rows)
            ctx = full_context(rows, frozenset(), a, b)
            if fused_path:
                out = tiled_local_loss(loss, sim, la, b, a, lb, offset, ctx, tile_size=1024, fused=True)
            else:
                logits = Logits(sim(la, b).i2t, sim(a, lb).t2i)
                out = loss(logits, offset + torch.arange(rows, device=DEVICE), ctx)
        grads = torch.autograd.grad(out.loss, [p, q, sim.log_scale, sim.bias])
        outputs.append((out, grads))
    (got, got_grads), (want, want_grads) = outputs
    _close("loss", want.loss, got.loss, value_tol)
    for name, w, g in zip(("x", "y", "log_scale", "bias"), want_grads, got_grads, strict=True):
        _close(f"gradient {name}", w, g, grad_tol)


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_fused_kernels_against_float64(loss, precision):
    _compare(loss, "d128", precision, None)


@pytest.mark.parametrize("loss", ["infonce", "siglip"])
def test_fused_kernels_wide_rows_split_d(loss):
    _compare(loss, "d768", "bf16", None)


@pytest.mark.parametrize("loss", ["infonce", "siglip"])
def test_fused_kernels_local_rows(loss):
    n = SHAPES["d128"][0]
    _compare(loss, "d128", "bf16", (n // 3, n // 3))
