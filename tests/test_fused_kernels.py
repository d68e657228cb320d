"""The fused Triton kernels of the tiled engine (clipkit/tiled/fused.py, issue 37) against the full
N×N path in float64: loss, metrics and every gradient (points, pooling weights, scale, bias).

The kernels run on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, the CI's
Triton line); without either the kernel tests skip, and the selection tests still run. Sizes are
tiny because the interpreter is slow, and the kernel tiles are shrunk to 16 so that every case has
several ragged row, column and d blocks (N = 37, d = 40: 3 × 3 tiles, 3 d steps, 3 output-dim
programs in the backward). A guard makes the generic engine raise inside these tests, so a case
cannot pass by falling back to it.

Tolerances (max |difference| / max(1, max |reference|); NaN/inf never pass):
- fp64 rows: 1e-10 (the kernels compute in fp64);
- fp32 rows: 1e-5 (IEEE fp32 dots and reductions; reference in fp64 on the same values);
- bf16 rows: values 1e-4 (bf16 products are exact in fp32, sums in fp32), gradients 2e-2 (the
  backward rounds the logit gradient G to bf16 before G·B, as FlashAttention rounds P, and returns
  bf16 gradients: two roundings of 2^-9 relative).
"""

from __future__ import annotations

import copy

import pytest
import torch

from clipkit.contract.testing import check_tiled, full_context, random_points
from clipkit.contract.types import Logits, PointSet
from clipkit.errors import ClipkitError
from clipkit.plugins.losses.baseline_losses import (
    CyCLIPLoss,
    DebiasedContrastiveLoss,
    DecoupledContrastiveLoss,
    SigLIPLoss,
)
from clipkit.plugins.losses.cloob import InfoLOOB
from clipkit.plugins.losses.infonce import InfoNCE
from clipkit.plugins.losses.nuclr import NUCLRLoss, SogCLRLoss
from clipkit.plugins.similarities.dot import DotSimilarity
from clipkit.plugins.similarities.kme import KMESimilarity
from clipkit.plugins.similarities.wpse import CosineMeanSimilarity, WPSESimilarity
from clipkit.tiled import fused
from clipkit.tiled.contract import tiled_global_loss, tiled_local_loss
from clipkit.tiled.engine import ArgMax, LogSumExp, RowSum
from clipkit.tiled.logits import global_logits

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
BATCH, DIM = 20, 24


def dot(**kwargs):
    return DotSimilarity(init_scale=4.0, **kwargs)


LOSSES = {
    "infonce": InfoNCE,
    "infonce_smoothed": lambda: InfoNCE(label_smoothing=0.1),
    "siglip": SigLIPLoss,
    "infoloob": InfoLOOB,
    "dcl": DecoupledContrastiveLoss,
    "dclw": lambda: DecoupledContrastiveLoss(weighting_sigma=2.0),
    "debiased": lambda: DebiasedContrastiveLoss(tau_plus=0.1, temperature=0.25),
}
SIMILARITIES = {
    "dot": dot,
    "dot_bias": lambda: dot(bias=-2.0),
    "cosine_mean": lambda: CosineMeanSimilarity(init_scale=4.0),
    "wpse": lambda: WPSESimilarity(embed_dim=DIM, num_features=16, init_scale=4.0),
}
NUCLR_CASES = {  # SogCLR is NUCLR without ζ: NUCLR exercises every offset SogCLR has and more
    "nuclr": lambda: NUCLRLoss(
        num_samples=128, tau=0.1, gamma=0.8, freeze_epochs=0, zeta_lr=0.05, zeta_lr_schedule="constant"
    ),  # fmt: skip
}


def kernels_or_skip() -> None:
    if not fused.available():
        pytest.skip("triton is not installed")
    if not ON_GPU and not fused.interpreting():
        pytest.skip("on CPU the kernels run under TRITON_INTERPRET=1 (the CI's Triton line)")


@pytest.fixture
def kernels(monkeypatch):
    """Small ragged tiles on CPU; the generic engine raises (a case must not pass by falling back)."""
    kernels_or_skip()
    if not ON_GPU:
        monkeypatch.setattr(fused, "default_blocks", lambda dtype, dim: fused.Blocks(16, 16, 16, 16, 16, 16))

    def generic(sweep):
        raise AssertionError(f"the generic engine ran {sweep.reductions}")

    monkeypatch.setattr("clipkit.tiled.logits.run_sweep", generic)


def _close(what: str, want: torch.Tensor, got: torch.Tensor, tolerance: float) -> None:
    want, got = want.detach().double().cpu(), got.detach().double().cpu()
    assert torch.isfinite(want).all(), f"{what}: the reference is not finite"
    assert torch.isfinite(got).all(), f"{what}: the fused value is not finite"
    scale = max(1.0, float(want.abs().max()) if want.numel() else 1.0)
    error = float((want - got).abs().max()) if want.numel() else 0.0
    assert error <= tolerance * scale, f"{what}: max |difference| {error:.3g} (scale {scale:.3g})"


#: Every loss with a learnable scale and a bias; each other similarity of the family once.
FLOAT64_CASES = [(loss, "dot_bias") for loss in sorted(LOSSES)] + [
    ("infonce", "cosine_mean"),
    ("siglip", "dot"),
    ("infoloob", "wpse"),
]


@pytest.mark.parametrize(("loss", "similarity"), FLOAT64_CASES)
def test_fused_equals_full_float64(kernels, loss, similarity):
    """fp64 rows (the kernels compute in fp64): loss, metrics, gradients of points, pooling weights,
    scale and bias equal the full N×N path within 1e-10."""
    check_tiled(LOSSES[loss](), SIMILARITIES[similarity](), batch=BATCH, dim=DIM, points=2, weighted=True,
                tolerance=1e-10, fused=True, pair=_pair(torch.float64))  # fmt: skip


@pytest.mark.parametrize("loss", ["infonce", "siglip", "debiased"])
def test_fused_local_rows_equal_full_rows(kernels, loss):
    """``train.distributed.local_loss``: this process's anchors (rows 3..19) against all candidates."""
    check_tiled(LOSSES[loss](), dot(bias=-1.0), batch=BATCH, dim=DIM, local_rows=(3, 17), tolerance=1e-10,
                fused=True, pair=_pair(torch.float64))  # fmt: skip


@pytest.mark.parametrize("name", sorted(NUCLR_CASES))
def test_fused_per_sample_weighted_losses(kernels, name):
    """SogCLR / NUCLR (separable offsets ζ/τ, softmax-weighted surrogate): loss, metrics, gradients and
    the state written equal the full path, over two steps (the second reads the first's state)."""
    full_loss, fused_loss = NUCLR_CASES[name](), NUCLR_CASES[name]()
    for step in range(2):
        check_tiled(full_loss, dot(), batch=BATCH, dim=DIM, tolerance=1e-10, fused=True,
                    pair=_pair(torch.float64, seed=step))  # fmt: skip
        a, b = _pair(torch.float64, seed=10 + step)
        for loss in (full_loss, fused_loss):
            ctx = full_context(BATCH, loss.requires, a, b)
            if loss is full_loss:
                loss(dot().double()(a, b), torch.arange(BATCH), ctx)
            else:
                tiled_global_loss(loss, dot().double(), a, b, ctx, tile_size=4, fused=True)
        for key, value in full_loss.state_dict().items():
            got = fused_loss.state_dict()[key]
            unset = torch.isinf(value)  # samples not visited yet keep −inf
            assert torch.equal(unset, torch.isinf(got)), key
            _close(f"state {key}", value[~unset], got[~unset], 1e-9)


PRECISIONS = {"fp32": (torch.float32, 1e-5, 1e-5), "bf16": (torch.bfloat16, 1e-4, 2e-2)}


@pytest.mark.parametrize(
    ("loss", "precision"),
    [
        ("infonce", "fp32"),
        ("siglip", "fp32"),
        ("infonce", "bf16"),
        ("siglip", "bf16"),
        ("dclw", "bf16"),
    ],  # fmt: skip
)
def test_fused_low_precision_against_float64(kernels, loss, precision):
    """fp32 / bf16 rows (fp32 accumulation) against the float64 full path on the same rounded values,
    with a learnable scale and bias (the gradients of both are checked)."""
    dtype, value_tolerance, grad_tolerance = PRECISIONS[precision]
    a, b = _pair(dtype)
    similarity = dot(bias=-1.0).to(DEVICE)
    got = _run(LOSSES[loss](), similarity, a, b, fused_path=True)
    a64, b64 = (PointSet(x.points.detach().double().requires_grad_()) for x in (a, b))
    want = _run(LOSSES[loss](), copy.deepcopy(similarity).double(), a64, b64, fused_path=False)
    _close("loss", want[0], got[0], value_tolerance)
    for key in want[1]:
        _close(f"metric {key}", want[1][key], got[1][key], value_tolerance if "acc" not in key else 0.0)
    for name, w, g in zip(("a", "b", "log_scale", "bias"), want[2], got[2], strict=True):
        _close(f"gradient {name}", w, g, grad_tolerance)


def test_fused_argmax_takes_the_first_of_tied_columns(kernels):
    """Accuracy's argmax: duplicated candidates tie, and the earliest column wins, as torch.argmax."""
    # Points on a 1/4 grid: every product and partial sum is exact in fp64, so the tied columns
    # are equal whatever order a BLAS or the kernel sums them in (a near-tie made by rounding
    # differs by one ulp between column blocks of some BLAS builds).
    a, b = (PointSet((x.points.detach() * 4).round() / 4) for x in _pair(torch.float64))
    points = b.points.clone()
    points[3] = points[15] = 3 * a.points[0]  # row 0's best: columns 3 and 15, tied
    points[18] = points[11]
    similarity = dot().double().to(DEVICE)
    features = (similarity.embed(a),), (similarity.embed(PointSet(points)),)
    logits = _fused_logits(similarity, *features)
    best_i2t, best_t2i = logits.reduce(ArgMax("i2t"), ArgMax("t2i"))
    full = similarity(a, PointSet(points)).i2t
    assert torch.equal(best_i2t.cpu(), full.argmax(dim=1).cpu())
    assert torch.equal(best_t2i.cpu(), full.t().argmax(dim=1).cpu())
    assert int(best_i2t[0]) == 3 and not (best_i2t == 15).any()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fused_never_passes_nan_or_inf(kernels, bad):
    """A NaN or inf in one embedding makes the loss and the gradients non-finite (nothing masks it)."""
    a, b = _pair(torch.float32)
    points = b.points.detach().clone()
    points[5, 0, 3] = bad
    b = PointSet(points.requires_grad_())
    out = tiled_global_loss(InfoNCE(), dot().to(DEVICE), a, b, full_context(BATCH, frozenset(), a, b),
                            tile_size=16, fused=True)  # fmt: skip
    assert not torch.isfinite(out.loss)
    (grad,) = torch.autograd.grad(out.loss, [a.points])
    assert not torch.isfinite(grad).all()


def test_unknown_reductions_fall_back_to_the_generic_engine(monkeypatch):
    """A sweep with a reduction the kernels do not know (a lambda row sum) runs in the generic engine
    (the fused runner refuses it); one with named reductions is accepted."""
    kernels_or_skip()
    similarity = dot().double().to(DEVICE)
    a, b = _pair(torch.float64)
    logits = _fused_logits(similarity, (similarity.embed(a),), (similarity.embed(b),))
    custom = RowSum("i2t", lambda values, tile: values.square())
    (value,) = logits.reduce(custom)
    full = similarity(a, b).i2t
    _close("custom row sum", full.square().sum(dim=1), value, 1e-12)
    sweep = logits._sweep((custom,), logits.sides["i2t"])
    assert not logits.fused.accepts(sweep)
    assert logits.fused.accepts(logits._sweep((LogSumExp("i2t"), ArgMax("t2i")), logits.sides["i2t"]))


# --- selection (no kernels needed) -------------------------------------------------------------


def _features(device="cpu"):
    x = torch.randn(5, 8, device=device)
    return (x,), (x.clone(),)


def test_auto_never_selects_the_kernels_on_cpu(monkeypatch):
    """``fused=None`` (the default) on CPU tensors is the generic engine, even under the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused.fused_sweeps(InfoNCE(), dot(), *_features(), None) is None
    assert fused.fused_sweeps(InfoNCE(), dot(), *_features(), False) is None


def test_auto_can_be_switched_off(monkeypatch):
    """``CLIPKIT_FUSED_KERNELS=0`` keeps auto on the generic engine (checked without CUDA through the
    switch itself); ``fused=True`` still demands the kernels."""
    monkeypatch.setenv("CLIPKIT_FUSED_KERNELS", "0")
    assert not fused.auto_enabled()
    monkeypatch.setenv("CLIPKIT_FUSED_KERNELS", "1")
    assert fused.auto_enabled()


def test_fused_true_explains_why_not(monkeypatch):
    """``fused=True`` names the reason it cannot run: a loss or similarity that does not declare it,
    CPU tensors outside the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for loss, similarity, message in [
        (CyCLIPLoss(), dot(), "does not declare fused_reductions"),
        (InfoNCE(), KMESimilarity(init_gamma=4.0, implementation="blockwise"), "does not declare fused_form"),
    ]:
        with pytest.raises(ClipkitError, match=message):
            fused.fused_sweeps(loss, similarity, *_features(), True)
    monkeypatch.setattr(fused, "available", lambda: True)  # whether or not triton is installed here
    with pytest.raises(ClipkitError, match="need CUDA tensors"):
        fused.fused_sweeps(InfoNCE(), dot(), *_features(), True)
    monkeypatch.setattr(fused, "available", lambda: False)
    with pytest.raises(ClipkitError, match="triton package is not installed"):
        fused.fused_sweeps(InfoNCE(), dot(), *_features(), True)
    assert fused.fused_sweeps(InfoNCE(), dot(), *_features(), None) is None  # auto: quietly generic


def test_declarations_of_the_built_in_plugins():
    """Every dot-family similarity and every loss of the issue declares the fused form."""
    for similarity in SIMILARITIES.values():
        form = similarity().fused_form()
        assert isinstance(form, fused.AffineDot) and form.scale.dim() == 0
    assert dot(bias=-2.0).fused_form().bias is not None
    for loss in [*LOSSES.values(), *NUCLR_CASES.values(), lambda: SogCLRLoss(num_samples=8)]:
        assert loss().fused_reductions is True


# --- helpers -----------------------------------------------------------------------------------


def _pair(dtype, seed: int = 0) -> tuple[PointSet, PointSet]:
    """Two [BATCH, 1, DIM] point sets of ``dtype`` on DEVICE, leaves that require grad."""
    a, b = random_points(BATCH, 1, DIM, seed=1 + 2 * seed), random_points(BATCH, 1, DIM, seed=2 + 2 * seed)
    return tuple(PointSet(x.points.detach().to(DEVICE, dtype).requires_grad_()) for x in (a, b))


def _fused_logits(similarity, features_a, features_b):
    runner = fused.FusedSweeps(similarity.fused_form())
    targets = torch.arange(features_a[0].shape[0], device=features_a[0].device)
    return global_logits(similarity.score_tile, features_a, features_b, targets, [], 16, fused=runner)


def _run(loss, similarity, a: PointSet, b: PointSet, *, fused_path: bool):
    """(loss, metrics, gradients of a, b, log_scale, bias) by the fused kernels or the full path."""
    ctx = full_context(a.batch_size, loss.requires, a, b)
    if fused_path:
        out = tiled_global_loss(loss, similarity, a, b, ctx, tile_size=16, fused=True)
    else:
        out = loss(similarity(a, b), torch.arange(a.batch_size, device=a.points.device), ctx)
    leaves = [a.points, b.points, similarity.log_scale, similarity.bias]
    return out.loss, out.metrics, torch.autograd.grad(out.loss, leaves)


def test_local_loss_direct_call_matches_rows(kernels):
    """tiled_local_loss with a local slice that starts at 0 and one that ends at the last row."""
    a, b = _pair(torch.float64)
    similarity = dot(bias=-1.0).double().to(DEVICE)
    for offset, n in [(0, 8), (12, 8)]:
        local_a, local_b = a.rows(offset, offset + n), b.rows(offset, offset + n)
        ctx = full_context(n, frozenset(), a, b)
        got = tiled_local_loss(SigLIPLoss(), similarity, local_a, b, a, local_b, offset, ctx, tile_size=16,
                               fused=True)  # fmt: skip
        logits = Logits(similarity(local_a, b).i2t, similarity(a, local_b).t2i)
        want = SigLIPLoss()(logits, offset + torch.arange(n, device=DEVICE), ctx)
        _close("local siglip", want.loss, got.loss, 1e-10)
