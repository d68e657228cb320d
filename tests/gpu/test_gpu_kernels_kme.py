"""KME-CLIP's fused Triton kernels on CUDA (plugins/similarities/kme_triton.py) against the block-wise
torch path and the float64 einsum reference, forward and every gradient (points, weights, γ).

Sizes: ViT-B/16 × text point sets (197 × 77) and WPSE-like 50 × 50 sets at d = 512. Forward plus
backward costs about 6·N²·Mx·My·d FLOPs (N = 64, 197 × 77: 2e11; N = 512, 50 × 50: 2e12) and the
float64 reference holds N²·Mx·My scores (8 bytes each, several copies in autograd): 0.5 GB at N = 64,
197 × 77 and 1.3 GB at N = 256, 50 × 50, so those get the float64 reference; at N = 512, 50 × 50
(5.2 GB a copy) the kernels are compared with the block-wise path in fp32 instead (cuBLAS SGEMM at
IEEE precision, each tile's log-sum-exp in fp32: accurate to ~1e-6, far inside the tolerances).

Tolerances (relative error ‖out − ref‖/‖ref‖, NaN/inf never passes):
- fp32 points, IEEE dot products: 2e-5 for logits and gradients (fp32 rounding of sums over up to
  N·My·Mx ≈ 1e6 terms, accumulated blockwise: ~1e-6 expected);
- fp32 points with TF32 allowed: 2e-3 (TF32 rounds the inputs of the dot products to 10 mantissa
  bits, 2^-11 ≈ 5e-4 per operand; on unit vectors at d = 512 that is ~3e-4 of a logit or less);
- bf16 points: logits 2e-5 (products of bf16 values are exact in fp32, and the reference sees the
  same rounded values); gradients 1e-2 (the backward rounds Q to bf16 for its GEMMs and returns
  bf16 gradients: two roundings of 2^-9 relative, ~2e-3 in norm expected).
"""

from __future__ import annotations

import time

import pytest
import torch

from clipkit.contract.types import PointSet
from clipkit.plugins.similarities.kme import kme_logits, kme_logits_naive

pytestmark = pytest.mark.gpu
ON_GPU = torch.cuda.is_available()  # False only in the CPU debug mode (CLIPKIT_GPU_TESTS_ON_CPU=1)

#: (N, Mx, My, d) on a GPU, and the reduced CPU-debug sizes (the Triton interpreter is slow).
GPU_SHAPES = {
    "vit_text": (64, 197, 77, 512),
    "sets50": (256, 50, 50, 512),
    "sets50_large_n": (512, 50, 50, 512),
}
CPU_SHAPES = {"vit_text": (4, 19, 7, 32), "sets50": (6, 5, 5, 32), "sets50_large_n": (8, 5, 5, 32)}
SHAPES = GPU_SHAPES if ON_GPU else CPU_SHAPES
TOLERANCES = {  # (logits, gradients); see the module docstring
    "fp32": (2e-5, 2e-5),
    "tf32": (2e-3, 2e-3),
    "bf16": (2e-5, 1e-2),
}


def triton_or_skip() -> None:
    from clipkit.plugins.similarities import kme_triton

    if not kme_triton.available():
        pytest.skip("triton is not installed")
    if not ON_GPU and not kme_triton.interpreting():
        pytest.skip("the CPU debug mode runs the kernels under TRITON_INTERPRET=1")


def random_set(batch: int, points: int, dim: int, *, seed: int, device, dtype, weighted: bool) -> PointSet:
    """Random unit points (a leaf, in ``dtype``) with positive fp32 weights (a leaf) when ``weighted``
    and a mask keeping ~70 % of the points (every set keeps its first one: no −inf logit)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.nn.functional.normalize(torch.randn(batch, points, dim, generator=generator), dim=-1)
    weights = torch.rand(batch, points, generator=generator) + 0.1 if weighted else None
    mask = torch.rand(batch, points, generator=generator) < 0.7
    mask[:, 0] = True
    return PointSet(
        values.to(device=device, dtype=dtype).requires_grad_(),
        None if weights is None else weights.to(device).requires_grad_(),
        mask.to(device),
    )


def as_leaves(x: PointSet, dtype: torch.dtype) -> PointSet:
    """The same (already rounded) values as fresh leaves in ``dtype``."""
    weights = None if x.weights is None else x.weights.detach().to(dtype).requires_grad_()
    return PointSet(x.points.detach().to(dtype).requires_grad_(), weights, x.mask)


def logits_and_grads(fn, a: PointSet, b: PointSet, gamma: torch.Tensor, upstream: torch.Tensor):
    """fn(a, b, γ) and the gradients of Σ g·s w.r.t. u, w, v, γ (b is unweighted: uniform weights)."""
    logits = fn(a, b, gamma)
    leaves = [a.points, a.weights, b.points, gamma]
    grads = torch.autograd.grad((logits * upstream.to(logits.dtype)).sum(), leaves)
    return logits.detach(), dict(zip(["u", "w", "v", "gamma"], grads, strict=True))


def compare(case: str, dtype: torch.dtype, precision: str, reference: str, device, relative_error) -> None:
    """Triton vs ``reference`` ("naive64": kme_logits_naive in float64 on the same rounded values;
    "blockwise32": the block-wise path in fp32 on the same values) for one shape."""
    n, mx, my, d = SHAPES[case]
    a = random_set(n, mx, d, seed=1, device=device, dtype=dtype, weighted=True)
    b = random_set(n, my, d, seed=2, device=device, dtype=dtype, weighted=False)
    gamma = torch.tensor(14.0, device=device, requires_grad=True)
    upstream = torch.randn(n, n, generator=torch.Generator().manual_seed(3)).to(device)
    started = time.perf_counter()
    got, got_grads = logits_and_grads(
        lambda a, b, g: kme_logits(a, b, g, implementation="triton"), a, b, gamma, upstream
    )
    triton_seconds = time.perf_counter() - started
    ref_dtype = torch.float64 if reference == "naive64" else torch.float32
    a_ref, b_ref = as_leaves(a, ref_dtype), as_leaves(b, ref_dtype)
    gamma_ref = gamma.detach().to(ref_dtype).requires_grad_()
    if reference == "naive64":
        expected, expected_grads = logits_and_grads(kme_logits_naive, a_ref, b_ref, gamma_ref, upstream)
    else:
        torch.set_float32_matmul_precision("highest")  # the reference GEMMs in IEEE fp32
        expected, expected_grads = logits_and_grads(
            lambda a, b, g: kme_logits(a, b, g, implementation="blockwise"), a_ref, b_ref, gamma_ref, upstream
        )
    logits_tolerance, grad_tolerance = TOLERANCES[precision]
    errors = {"logits": relative_error(got, expected)}
    errors.update({f"d{name}": relative_error(g, expected_grads[name]) for name, g in got_grads.items()})
    print(f"kme {case} N={n} {mx}x{my} d={d} {precision} vs {reference}: {triton_seconds:.2f} s, {errors}")
    assert got.dtype == torch.float32 and got_grads["u"].dtype == dtype
    assert errors["logits"] <= logits_tolerance, errors
    for name in ("du", "dw", "dv", "dgamma"):
        assert errors[name] <= grad_tolerance, (name, errors)


@pytest.mark.parametrize(
    ("case", "dtype", "precision", "reference"),
    [
        ("vit_text", torch.float32, "fp32", "naive64"),
        ("vit_text", torch.bfloat16, "bf16", "naive64"),
        ("vit_text", torch.float32, "tf32", "naive64"),
        ("sets50", torch.float32, "fp32", "naive64"),
        ("sets50", torch.bfloat16, "bf16", "naive64"),
        ("sets50_large_n", torch.float32, "fp32", "blockwise32"),
        ("sets50_large_n", torch.bfloat16, "bf16", "blockwise32"),
    ],
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_triton_kernels_match_the_reference(
    case, dtype, precision, reference, gpu_device, fp32_matmul_precision, relative_error
):
    """Forward logits and ∂u, ∂w, ∂v, ∂γ of the fused kernels vs the float64 einsum (or, at N = 512,
    the fp32 block-wise path); the tolerances per precision are in the module docstring."""
    triton_or_skip()
    fp32_matmul_precision("high" if precision == "tf32" else "highest")
    compare(case, dtype, precision, reference, gpu_device, relative_error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blockwise_matches_naive_float64_on_device(dtype, gpu_device, fp32_matmul_precision, relative_error):
    """The block-wise path on CUDA (its tiles are 16× larger there, CUDA_TILE_SCORES) vs the float64
    einsum at N = 64, 197 × 77, d = 512: inputs below fp32 are upcast, so logits and gradients are
    fp32-accurate: 2e-5 for logits, and 2e-5 (fp32) or 1e-2 (bf16, gradients returned in bf16) for
    the gradients."""
    fp32_matmul_precision("highest")
    n, mx, my, d = SHAPES["vit_text"]
    a = random_set(n, mx, d, seed=4, device=gpu_device, dtype=dtype, weighted=True)
    b = random_set(n, my, d, seed=5, device=gpu_device, dtype=dtype, weighted=False)
    gamma = torch.tensor(14.0, device=gpu_device, requires_grad=True)
    upstream = torch.randn(n, n, generator=torch.Generator().manual_seed(6)).to(gpu_device)
    got, got_grads = logits_and_grads(
        lambda a, b, g: kme_logits(a, b, g, implementation="blockwise"), a, b, gamma, upstream
    )
    a64, b64, gamma64 = as_leaves(a, torch.float64), as_leaves(b, torch.float64), gamma.detach().double()
    expected, expected_grads = logits_and_grads(
        kme_logits_naive, a64, b64, gamma64.requires_grad_(), upstream
    )
    grad_tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    errors = {"logits": relative_error(got, expected)}
    errors.update({f"d{name}": relative_error(g, expected_grads[name]) for name, g in got_grads.items()})
    print(f"blockwise {dtype}: {errors}")
    assert errors["logits"] <= 2e-5, errors
    assert all(errors[f"d{name}"] <= grad_tolerance for name in ("u", "w", "v", "gamma")), errors
