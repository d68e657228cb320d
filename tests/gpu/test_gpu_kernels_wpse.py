"""WPSE's fused random-feature pooling on CUDA (plugins/similarities/wpse.py, METHODS.md §2):
``pooled_random_features`` chunk by chunk (forward and its custom backward) against the
materialising ``pooled_random_features_unfused`` evaluated in float64 on the same values.

Shape: B = 256 sets of M = 77 points (text tokens) at d = 512 with D = 1024 features: the features
are 2e7 values, so with the chunk lowered to 2^22 values the fused path walks 5 chunks of rows.

Tolerances (relative error ‖out − ref‖/‖ref‖, NaN/inf never passes): fp32 inputs 1e-4 for z̄ and
for the gradients w.r.t. the points and the weights. The cos/sin arguments x·ω + β reach |20| with
σ = 0.3 features, and an fp32 argument of that size is off by up to ~1e-6 absolute, which the
cosines pass on as ~1e-6 absolute; the pooled sums over M are ~1e-6 relative (far under 1e-4). The
fused result must also be no less accurate than the unfused fp32 one (within 2× of its error).
float64 inputs: fused vs unfused float64 within 1e-10 (the same arithmetic in another order).
"""

from __future__ import annotations

import math

import pytest
import torch

from clipkit.contract.types import PointSet
from clipkit.plugins.similarities import wpse
from clipkit.plugins.similarities.wpse import pooled_random_features, pooled_random_features_unfused

pytestmark = pytest.mark.gpu
ON_GPU = torch.cuda.is_available()  # False only in the CPU debug mode (CLIPKIT_GPU_TESTS_ON_CPU=1)
#: (B, M, d, D) and the fused path's chunk (values): 5 chunks of rows either way.
SHAPE, CHUNK = ((256, 77, 512, 1024), 1 << 22) if ON_GPU else ((16, 9, 32, 64), 2048)


def inputs(device, dtype, *, seed: int = 0):
    """Unit points and normalised mixture weights (0 on masked points) as leaves, Gaussian ω [d, D]
    (σ = 0.3) and β ~ U[0, 2π) [D]; drawn in float64 on the CPU, then rounded to ``dtype``."""
    batch, points, dim, features = SHAPE
    generator = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(
        torch.randn(batch, points, dim, generator=generator, dtype=torch.float64), dim=-1
    )
    mask = torch.rand(batch, points, generator=generator) < 0.7
    mask[:, 0] = True
    raw = torch.rand(batch, points, generator=generator, dtype=torch.float64) + 0.1
    weights = PointSet(x, raw, mask).normalized_weights()
    omega = torch.randn(dim, features, generator=generator, dtype=torch.float64) / 0.3
    beta = torch.rand(features, generator=generator, dtype=torch.float64) * 2 * math.pi
    upstream = torch.randn(batch, features, generator=generator, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (x, weights, omega, beta, upstream)]


def pooled_and_grads(pool, x, w, omega, beta, upstream):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    pooled = pool(x, w, omega, beta)
    grad_x, grad_w = torch.autograd.grad((pooled * upstream).sum(), [x, w])
    return {"pooled": pooled.detach(), "dx": grad_x, "dw": grad_w}


def fused(x, w, omega, beta):
    out = pooled_random_features(x, w, omega, beta, fused=True)
    assert type(out.grad_fn).__name__ == "_PooledRandomFeaturesBackward"  # really the chunked path
    return out


def test_fused_pooling_fp32_matches_float64_reference(gpu_device, monkeypatch, relative_error):
    """fp32 fused and fp32 unfused vs the float64 unfused reference on the same rounded inputs:
    each within 1e-4, and the fused error at most 2× the unfused one (+1e-7)."""
    monkeypatch.setattr(wpse, "FEATURE_CHUNK", CHUNK)
    values = inputs(gpu_device, torch.float32)
    reference = pooled_and_grads(pooled_random_features_unfused, *(t.double() for t in values))
    got = pooled_and_grads(fused, *values)
    unfused = pooled_and_grads(pooled_random_features_unfused, *values)
    errors = {name: relative_error(got[name], reference[name]) for name in reference}
    unfused_errors = {name: relative_error(unfused[name], reference[name]) for name in reference}
    print(f"wpse fused fp32 {SHAPE}: {errors}; unfused fp32: {unfused_errors}")
    for name, error in errors.items():
        assert error <= 1e-4, (name, errors)
        assert error <= 2 * unfused_errors[name] + 1e-7, (name, errors, unfused_errors)


def test_fused_pooling_float64_matches_unfused(gpu_device, monkeypatch, relative_error):
    """float64 on the device: fused = unfused within 1e-10 (forward and both gradients)."""
    monkeypatch.setattr(wpse, "FEATURE_CHUNK", CHUNK)
    values = inputs(gpu_device, torch.float64, seed=1)
    got, expected = (
        pooled_and_grads(fused, *values),
        pooled_and_grads(pooled_random_features_unfused, *values),
    )
    errors = {name: relative_error(got[name], expected[name]) for name in expected}
    print(f"wpse fused float64 {SHAPE}: {errors}")
    assert all(error <= 1e-10 for error in errors.values()), errors
