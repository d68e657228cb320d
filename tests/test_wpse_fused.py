"""WPSE's fused random-feature pooling (METHODS.md §2, issue 8): z̄ = Σ_m w_m sqrt(2/D) cos(x_m ω + β)
computed chunk by chunk equals the materialising reference, forward and backward, and does not hold
the [B, M, D] feature tensor."""

from __future__ import annotations

import math

import pytest
import torch

from clipkit.contract.types import PointSet
from clipkit.plugins.similarities import wpse
from clipkit.plugins.similarities.wpse import (
    WPSESimilarity,
    pooled_random_features,
    pooled_random_features_unfused,
)
from clipkit.train.memory import peak_allocated_bytes


def inputs(batch, points, dim, features, *, seed, dtype=torch.float64):
    """Unit points and mixture weights (normalised, 0 on masked points; the last set fully masked)
    as leaves, and Gaussian features ω [d, D], β [D]."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(
        torch.randn(batch, points, dim, generator=generator, dtype=dtype), dim=-1
    )
    mask = torch.rand(batch, points, generator=generator) < 0.7
    mask[:, 0] = True
    mask[-1] = False
    raw = torch.rand(batch, points, generator=generator, dtype=dtype) + 0.1
    weights = PointSet(x, raw, mask).normalized_weights()
    omega = torch.randn(dim, features, generator=generator, dtype=dtype) / 0.3
    beta = torch.rand(features, generator=generator, dtype=dtype) * 2 * math.pi
    return x.requires_grad_(), weights.detach().requires_grad_(), omega, beta


@pytest.mark.parametrize("chunk", [None, 40])  # 40 values: one batch row (3 points × 8 features) per chunk
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_pooling_matches_the_materialising_reference(chunk, dtype, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(wpse, "FEATURE_CHUNK", chunk)
    x, w, omega, beta = inputs(5, 3, 4, 8, seed=1, dtype=dtype)
    upstream = torch.randn(5, 8, generator=torch.Generator().manual_seed(2), dtype=dtype)
    fused = pooled_random_features(x, w, omega, beta, fused=True)
    assert type(fused.grad_fn).__name__ == "_PooledRandomFeaturesBackward"
    reference = pooled_random_features_unfused(x, w, omega, beta)
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(fused, reference, **tolerance)
    assert fused[-1].abs().max() == 0  # a set with no real point pools to 0
    got = torch.autograd.grad((fused * upstream).sum(), [x, w])
    expected = torch.autograd.grad((reference * upstream).sum(), [x, w])
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **tolerance)


def test_gradcheck_through_chunks(monkeypatch):
    monkeypatch.setattr(wpse, "FEATURE_CHUNK", 12)  # 1 row of 2 points × 6 features per chunk
    x, w, omega, beta = inputs(3, 2, 3, 6, seed=3)
    assert torch.autograd.gradcheck(
        lambda x, w: pooled_random_features(x, w, omega, beta, fused=True), (x, w)
    )


def test_learnable_features_fall_back_to_the_exact_unfused_gradient():
    x, w, omega, beta = inputs(3, 2, 3, 6, seed=4)
    omega.requires_grad_()
    pooled = pooled_random_features(x, w, omega, beta, fused=True)
    (grad_omega,) = torch.autograd.grad(pooled.sum(), [omega])
    (expected,) = torch.autograd.grad(pooled_random_features_unfused(x, w, omega, beta).sum(), [omega])
    torch.testing.assert_close(grad_omega, expected)


def test_fused_by_default_only_when_the_features_exceed_a_chunk(monkeypatch):
    """fused=None: the features of B = 5 sets × 3 points × 8 features (120 values) are materialised
    (plain autograd) under a 120-value chunk, and pooled chunk-wise above it."""
    x, w, omega, beta = inputs(5, 3, 4, 8, seed=9)
    monkeypatch.setattr(wpse, "FEATURE_CHUNK", 120)
    assert type(pooled_random_features(x, w, omega, beta).grad_fn).__name__ != "_PooledRandomFeaturesBackward"
    monkeypatch.setattr(wpse, "FEATURE_CHUNK", 119)
    assert type(pooled_random_features(x, w, omega, beta).grad_fn).__name__ == "_PooledRandomFeaturesBackward"


@pytest.mark.parametrize("kernel", ["gaussian", "imq"])
def test_similarity_logits_and_gradients_unchanged(kernel, monkeypatch):
    """WPSESimilarity through the fused pooling (forced by a 16-value chunk: one set per chunk)
    = the same module with the reference pooling."""
    monkeypatch.setattr(wpse, "FEATURE_CHUNK", 16)
    similarity = WPSESimilarity(embed_dim=6, kernel=kernel, alpha=[0.3, 0.7], num_features=16).double()
    make = [inputs(4, 5, 6, 16, seed=5), inputs(3, 2, 6, 16, seed=6)]
    sets = [PointSet(x, w) for x, w, _, _ in make]
    leaves = [t for s in sets for t in (s.points, s.weights)] + [similarity.logit_scale.log_scale]
    fused = similarity(*sets, generator=torch.Generator().manual_seed(7)).i2t
    fused_grads = torch.autograd.grad(fused.square().sum(), leaves)
    monkeypatch.setattr(wpse, "pooled_random_features", pooled_random_features_unfused)
    reference = similarity(*sets, generator=torch.Generator().manual_seed(7)).i2t
    reference_grads = torch.autograd.grad(reference.square().sum(), leaves)
    torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
    for g, e in zip(fused_grads, reference_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_fused_pooling_does_not_hold_the_feature_tensor(monkeypatch):
    """B = 32, M = 64, D = 512 (fp32): the features are 1 M values = 4 MiB; the reference holds them
    (and cos's input) for backward, the fused path holds one 2^14-value chunk at a time. Peak bytes
    from torch's allocator events, forward + backward."""
    monkeypatch.setattr(wpse, "FEATURE_CHUNK", 1 << 14)
    x, w, omega, beta = inputs(32, 64, 16, 512, seed=8, dtype=torch.float32)
    features_bytes = 32 * 64 * 512 * 4

    def peak(pool):
        return peak_allocated_bytes(lambda: pool(x, w, omega, beta).sum().backward())[1]

    unfused, fused = peak(pooled_random_features_unfused), peak(pooled_random_features)  # fused: auto
    assert unfused >= 2 * features_bytes
    inputs_bytes = 2 * x.numel() * 4  # the points' gradient, and the pooled output's own size is tiny
    assert fused < inputs_bytes + 8 * (1 << 14) * 4, (fused, unfused)
    assert fused < unfused / 10
