"""Fast KME-CLIP paths (METHODS.md §3, issue 8) against the naive einsum reference.

The block-wise path (any device) and the fused triton kernels (CUDA, or CPU tensors under
TRITON_INTERPRET=1; skipped where neither is available) are compared with ``kme_logits_naive``
evaluated in float64 on the same (rounded) inputs: forward and every gradient, fp32 and bf16
inputs (fp32 accumulation), masks, explicit and uniform weights, sets with no real point.
The block-wise path's peak memory, read from torch's allocator events, grows like the inputs and
N², not like N²·Mx·My as the naive path's does.
"""

from __future__ import annotations

import math

import pytest
import torch

from clipkit.contract.types import PointSet
from clipkit.plugins.similarities import kme
from clipkit.plugins.similarities.kme import KMESimilarity, kme_logits, kme_logits_naive, tile_shape
from clipkit.train.memory import peak_allocated_bytes


def random_set(
    batch: int,
    points: int,
    dim: int,
    *,
    seed: int,
    weighted: bool = True,
    masked: bool = True,
    empty_row: bool = False,
    dtype: torch.dtype = torch.float64,
) -> PointSet:
    """Unit points in ``dtype`` (weights too, when weighted) as gradient leaves; with ``masked`` about
    40 % of points are padding but every set keeps its first point, unless ``empty_row``: then the
    last set has no real point at all."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.nn.functional.normalize(torch.randn(batch, points, dim, generator=generator), dim=-1)
    weights = torch.rand(batch, points, generator=generator) + 0.1 if weighted else None
    mask = None
    if masked or empty_row:
        mask = torch.rand(batch, points, generator=generator) < 0.6
        mask[:, 0] = True
        if empty_row:
            mask[-1] = False
    return PointSet(
        values.to(dtype).requires_grad_(),
        None if weights is None else weights.to(dtype).requires_grad_(),
        mask,
    )


def leaves(a: PointSet, b: PointSet, gamma: torch.Tensor) -> dict[str, torch.Tensor]:
    named = {"u": a.points, "w": a.weights, "v": b.points, "w'": b.weights, "gamma": gamma}
    return {name: t for name, t in named.items() if t is not None}


def float64_copy(x: PointSet) -> PointSet:
    """The same (already rounded) values as float64 leaves: the reference sees exactly the inputs
    the fast path saw."""
    weights = None if x.weights is None else x.weights.detach().double().requires_grad_()
    return PointSet(x.points.detach().double().requires_grad_(), weights, x.mask)


def value_and_grads(fn, a: PointSet, b: PointSet, gamma: torch.Tensor, upstream: torch.Tensor):
    logits = fn(a, b, gamma)
    grads = torch.autograd.grad(
        (logits * upstream.to(logits.device, logits.dtype)).sum(), list(leaves(a, b, gamma).values())
    )
    return logits.detach(), grads


def check_against_naive(fast, a, b, gamma, *, rtol, atol, grad_rtol, grad_atol):
    """fast(a, b, γ) vs kme_logits_naive in float64 on the same values: logits (−inf where a set is
    empty) and the gradient of Σ g·s with respect to every leaf, with a random upstream g."""
    upstream = torch.randn(a.batch_size, b.batch_size, generator=torch.Generator().manual_seed(99))
    got, got_grads = value_and_grads(fast, a, b, gamma, upstream)
    a64, b64 = float64_copy(a), float64_copy(b)
    gamma64 = gamma.detach().double().requires_grad_()
    expected, expected_grads = value_and_grads(kme_logits_naive, a64, b64, gamma64, upstream.double())
    assert got.dtype == (torch.float64 if a.points.dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=atol)
    for (name, leaf), g, e in zip(leaves(a, b, gamma).items(), got_grads, expected_grads, strict=True):
        assert g.dtype == leaf.dtype, name
        scale = float(e.abs().max()) or 1.0
        torch.testing.assert_close(
            g.double(), e, rtol=grad_rtol, atol=grad_atol * scale, msg=lambda m, name=name: f"∂{name}: {m}"
        )


# --- the reference itself -----------------------------------------------------------------------------------


def test_naive_reference_matches_explicit_loops():
    """kme_logits_naive = log Σ_ij w_i w'_j exp(γ(u_i·v_j − 1)) summed pair by pair in Python floats
    (raw weights; uniform 1/M_real when None; masked points skipped)."""
    a = random_set(3, 4, 5, seed=1)
    b = random_set(2, 3, 5, seed=2, weighted=False)
    gamma = 7.0
    got = kme_logits_naive(a, b, torch.tensor(gamma, dtype=torch.float64))
    for p in range(3):
        for q in range(2):
            real_b = [j for j in range(3) if b.mask[q, j]]
            total = 0.0
            for i in range(4):
                for j in real_b:
                    if a.mask[p, i]:
                        dot = float(a.points[p, i].detach() @ b.points[q, j].detach())
                        total += float(a.weights[p, i].detach()) / len(real_b) * math.exp(gamma * (dot - 1))
            assert float(got[p, q].detach()) == pytest.approx(math.log(total), rel=1e-12)


# --- block-wise path ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_size", "tile_scores"),
    [(3, None), (1, None), (None, None), (None, 60)],  # None, 60: automatic tiles of 2 × 2 sets, uneven
)
@pytest.mark.parametrize(("mx", "my", "weighted"), [(4, 3, True), (4, 3, False), (1, 1, True), (1, 5, False)])
def test_blockwise_matches_naive_float64(block_size, tile_scores, mx, my, weighted, monkeypatch):
    """Uneven tiles, masks, explicit and uniform weights, a set without real points; Mx = My = 1
    (CLIP's case, whose backward skips the recompute) and Mx ≠ My."""
    if tile_scores is not None:
        monkeypatch.setattr(kme, "TILE_SCORES", tile_scores)
    a = random_set(7, mx, 6, seed=3, weighted=weighted, empty_row=True)
    b = random_set(5, my, 6, seed=4, weighted=weighted)
    gamma = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)

    def fast(a, b, gamma):
        return kme_logits(a, b, gamma, block_size=block_size, implementation="blockwise")

    check_against_naive(fast, a, b, gamma, rtol=1e-12, atol=1e-12, grad_rtol=1e-10, grad_atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_fp32_and_bf16_inputs_accumulate_in_fp32(dtype):
    """Inputs below fp32 are upcast before any arithmetic: the logits match the float64 reference on
    the same rounded values to fp32 accuracy (not bf16's 2^-8); gradients come back in the input
    dtype, so bf16 gradients carry one bf16 rounding (relative 2^-8)."""
    a = random_set(6, 5, 16, seed=5, dtype=dtype, empty_row=True)
    b = random_set(5, 7, 16, seed=6, dtype=dtype, weighted=False)
    gamma = torch.tensor(14.0, requires_grad=True)
    grad_tolerance = 1e-5 if dtype == torch.float32 else 2**-8

    def fast(a, b, gamma):
        return kme_logits(a, b, gamma, block_size=2, implementation="blockwise")

    check_against_naive(
        fast, a, b, gamma, rtol=1e-5, atol=1e-5, grad_rtol=grad_tolerance, grad_atol=grad_tolerance
    )


def test_sets_without_points_and_empty_batches():
    """No point at all (M = 0) -> s = −inf everywhere, and backward still runs (zero gradient); an
    empty batch gives an empty [0, Nb] matrix."""
    a = PointSet(torch.zeros(2, 0, 4, requires_grad=True))
    b = random_set(3, 2, 4, seed=7, dtype=torch.float32)
    gamma = torch.tensor(5.0, requires_grad=True)
    for implementation in ("blockwise", "naive"):
        logits = kme_logits(a, b, gamma, implementation=implementation)
        assert logits.shape == (2, 3) and torch.isneginf(logits).all()
    logits = kme_logits(a, b, gamma)
    torch.autograd.grad(logits.exp().sum(), [b.points, gamma])  # exp(−inf) = 0: a finite loss
    empty = kme_logits(PointSet(torch.zeros(0, 3, 4)), b, gamma)
    assert empty.shape == (0, 3)


def test_automatic_tiles_are_balanced_and_bounded(monkeypatch):
    """None: ~TILE_SCORES scores per tile whatever M, both GEMM operands about sqrt(TILE_SCORES)
    points; an explicit block_size is used as is (capped at N)."""
    assert kme.TILE_SCORES == 1 << 20
    assert tile_shape(384, 384, 197, 77, None) == (5, 13)  # 985 × 1001 points, 0.98 M scores
    assert tile_shape(4096, 4096, 1, 1, None) == (1024, 1024)
    assert tile_shape(64, 4096, 1, 1, None) == (64, 4096)  # capped rows leave room for columns
    for mx, my in [(1, 1), (10, 10), (50, 50), (197, 77), (77, 197), (3000, 2000)]:
        rows, cols = tile_shape(4096, 4096, mx, my, None)
        assert rows >= 1 and cols >= 1
        assert rows * cols * mx * my <= max(kme.TILE_SCORES, mx * my), (mx, my)
    assert tile_shape(384, 384, 197, 77, 16) == (16, 16)
    assert tile_shape(5, 3, 197, 77, 16) == (5, 3)


def test_blockwise_peak_memory_is_quadratic_in_n_not_in_m(monkeypatch):
    """Peak bytes held (torch allocator events) for forward + backward at N = 64, d = 8. Tiles of 2^14
    scores make N²·M² ≫ one tile at these small sizes. Doubling M doubles the inputs only for the
    block-wise path (< 2.2×) but quadruples the naive one's N²·M² scores (> 3.5×); doubling N at
    most quadruples the block-wise peak; and the block-wise peak stays under 1/10 of the naive one."""
    monkeypatch.setattr(kme, "TILE_SCORES", 1 << 14)
    gamma = torch.tensor(3.0, requires_grad=True)

    def peak(fn, n, m):
        a = random_set(n, m, 8, seed=8, dtype=torch.float32)
        b = random_set(n, m, 8, seed=9, dtype=torch.float32)
        return peak_allocated_bytes(lambda: fn(a, b, gamma).sum().backward())[1]

    blockwise = {(n, m): peak(kme_logits, n, m) for n, m in [(64, 8), (64, 16), (128, 8)]}
    naive = {m: peak(kme_logits_naive, 64, m) for m in (8, 16)}
    assert naive[16] >= 64 * 64 * 16 * 16 * 4  # at least one fp32 score tensor of N²·M²
    assert naive[16] / naive[8] > 3.5
    assert blockwise[64, 16] / blockwise[64, 8] < 2.2
    assert blockwise[128, 8] / blockwise[64, 8] < 4.5
    assert blockwise[64, 16] < naive[16] / 10, (blockwise, naive)


def test_dispatch_and_arguments():
    """CPU inputs never need triton ("auto" -> block-wise, exactly its result); unknown names fail."""
    a = random_set(3, 2, 4, seed=10, dtype=torch.float32)
    b = random_set(2, 3, 4, seed=11, dtype=torch.float32)
    gamma = torch.tensor(4.0)
    assert not kme._triton_applies(a, b)
    torch.testing.assert_close(
        kme_logits(a, b, gamma), kme_logits(a, b, gamma, implementation="blockwise"), rtol=0, atol=0
    )
    torch.testing.assert_close(
        KMESimilarity(init_gamma=4.0, implementation="naive")(a, b).i2t, kme_logits_naive(a, b, gamma)
    )
    with pytest.raises(ValueError, match="implementation"):
        kme_logits(a, b, gamma, implementation="cuda")
    with pytest.raises(ValueError, match="implementation"):
        KMESimilarity(implementation="fast")
    with pytest.raises(ValueError, match="block_size"):
        kme_logits(a, b, gamma, block_size=0)


# --- triton kernels (CUDA, or the triton interpreter on CPU) ----------------------------------------------


def _triton_device() -> str | None:
    try:
        from clipkit.plugins.similarities import kme_triton
    except ImportError:  # pragma: no cover
        return None
    if not kme_triton.available():
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if kme_triton.interpreting() else None


TRITON_DEVICE = _triton_device()
needs_triton = pytest.mark.skipif(
    TRITON_DEVICE is None, reason="needs triton with CUDA, or TRITON_INTERPRET=1 for CPU tensors"
)


def on_device(x: PointSet) -> PointSet:
    weights = None if x.weights is None else x.weights.detach().to(TRITON_DEVICE).requires_grad_()
    mask = None if x.mask is None else x.mask.to(TRITON_DEVICE)
    return PointSet(x.points.detach().to(TRITON_DEVICE).requires_grad_(), weights, mask)


def triton_logits(a, b, gamma):
    return kme_logits(a, b, gamma, implementation="triton")


@needs_triton
@pytest.mark.parametrize(
    ("na", "nb", "mx", "my", "dim"),
    [
        (5, 4, 3, 2, 8),  # several sets per tile, masks, an empty set
        (6, 70, 20, 1, 24),  # Mx > 16 slots: two chunks of anchor points; My = 1 (CLIP-like) side
        (3, 2, 1, 1, 5),  # M = 1 both sides, d below the 16-wide dot
    ],
)
def test_triton_matches_naive_fp32(na, nb, mx, my, dim):
    a = on_device(random_set(na, mx, dim, seed=12, dtype=torch.float32, empty_row=True))
    b = on_device(random_set(nb, my, dim, seed=13, dtype=torch.float32, weighted=False))
    gamma = torch.tensor(9.0, device=TRITON_DEVICE, requires_grad=True)
    check_against_naive(triton_logits, a, b, gamma, rtol=1e-5, atol=1e-5, grad_rtol=1e-5, grad_atol=1e-5)


@needs_triton
def test_triton_bf16_points_accumulate_in_fp32():
    """bf16 points go to the GEMMs as bf16 with fp32 accumulation: logits to fp32 accuracy of the
    float64 reference on the same values; gradients within bf16 rounding (Q is rounded to bf16 for
    the backward GEMMs, as FlashAttention rounds P, and the gradients are returned in bf16)."""
    a = on_device(random_set(6, 20, 32, seed=14, dtype=torch.bfloat16))
    b = on_device(random_set(5, 17, 32, seed=15, dtype=torch.bfloat16))
    gamma = torch.tensor(14.0, device=TRITON_DEVICE, requires_grad=True)
    check_against_naive(triton_logits, a, b, gamma, rtol=1e-5, atol=1e-5, grad_rtol=2**-7, grad_atol=2**-7)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backward_with_d_split_across_programs(dtype, monkeypatch):
    """Tiles(backward_dims=16) at d = 40: three programs per row block each own 16 output dims (the
    last one ragged) and recompute the scores walking d in steps; same results as the naive path."""
    import dataclasses

    from clipkit.plugins.similarities import kme_triton

    split = {size: dataclasses.replace(t, backward_dims=16) for size, t in kme_triton.TILES.items()}
    monkeypatch.setattr(kme_triton, "TILES", split)
    a = on_device(random_set(5, 3, 40, seed=16, dtype=dtype, empty_row=True))
    b = on_device(random_set(4, 2, 40, seed=17, dtype=dtype, weighted=False))
    gamma = torch.tensor(9.0, device=TRITON_DEVICE, requires_grad=True)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    check_against_naive(
        triton_logits, a, b, gamma, rtol=1e-5, atol=1e-5, grad_rtol=tolerance, grad_atol=tolerance
    )


def test_bfloat16_matmul_option_rounds_only_the_points():
    """matmul_dtype="bfloat16": the logits equal fp32 KME on bf16-rounded points (weights kept), and
    the gradient still reaches the fp32 points."""
    from clipkit.plugins.similarities.kme import KMESimilarity

    a = random_set(5, 7, 16, seed=21, dtype=torch.float32)
    b = random_set(4, 3, 16, seed=22, dtype=torch.float32, weighted=False)
    fast, exact = KMESimilarity(matmul_dtype="bfloat16"), KMESimilarity()
    got = fast(a, b).i2t
    rounded_a = PointSet(a.points.detach().to(torch.bfloat16).float(), a.weights, a.mask)
    rounded_b = PointSet(b.points.detach().to(torch.bfloat16).float(), b.weights, b.mask)
    expected = exact(rounded_a, rounded_b).i2t
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, exact(a, b).i2t, rtol=1e-7, atol=1e-7)  # the rounding is real
    got.sum().backward()
    assert a.points.grad is not None and a.points.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="matmul_dtype"):
        KMESimilarity(matmul_dtype="float16")
