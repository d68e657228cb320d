"""`dot` similarity: hand case, clamp, learnability, embed identity, CLIP prompt ensembling."""

import math

import pytest
import torch

from clipkit.contract.testing import check_similarity, random_points
from clipkit.contract.types import PointSet
from clipkit.plugins.similarities.dot import DotSimilarity


def unit(*rows):
    return PointSet(torch.tensor(rows, dtype=torch.float32).unsqueeze(1))


def test_hand_derived_logit():
    similarity = DotSimilarity(init_scale=10.0)
    logits = similarity(unit([1.0, 0.0]), unit([0.6, 0.8], [0.0, 1.0]))
    torch.testing.assert_close(logits.i2t, torch.tensor([[6.0, 0.0]]))
    torch.testing.assert_close(logits.t2i, logits.i2t.t())


def test_clip_init_and_clamp():
    assert DotSimilarity().scale().item() == pytest.approx(1 / 0.07, rel=1e-6)
    similarity = DotSimilarity(init_scale=100.0, max_scale=100.0)  # a start above it is refused
    assert similarity.scale().item() == pytest.approx(100.0)
    assert similarity.parameter_bounds() == {"log_scale": (None, pytest.approx(math.log(100.0)))}
    similarity(unit([1.0, 0.0]), unit([1.0, 0.0])).i2t.sum().backward()
    # At the bound the gradient flows, d(s·1)/dt = s (open_clip clamps the parameter after the step).
    assert similarity.log_scale.grad.item() == pytest.approx(100.0, rel=1e-6)
    # A parameter beyond its bound (an older checkpoint) is held to it in the forward pass.
    with torch.no_grad():
        similarity.log_scale.fill_(math.log(500.0))
    similarity.log_scale.grad = None
    assert similarity.scale().item() == pytest.approx(100.0)
    similarity(unit([1.0, 0.0]), unit([1.0, 0.0])).i2t.sum().backward()
    assert similarity.log_scale.grad.item() == 0.0
    assert DotSimilarity(learn_scale=False).parameter_bounds() == {}
    assert DotSimilarity(max_scale=None).parameter_bounds() == {}


def test_scale_is_learnable_or_fixed():
    learnable = DotSimilarity(init_scale=2.0)
    learnable(unit([1.0, 0.0]), unit([0.6, 0.8])).i2t.sum().backward()
    # d(s·0.6)/dt = s·0.6 with s = exp(t) = 2
    assert learnable.log_scale.grad.item() == pytest.approx(1.2, rel=1e-5)
    fixed = DotSimilarity(init_scale=2.0, learn_scale=False)
    assert not any(p.requires_grad for p in fixed.parameters())


def test_bias_is_added():
    similarity = DotSimilarity(init_scale=10.0, bias=-10.0)
    logits = similarity(unit([1.0, 0.0]), unit([1.0, 0.0]))
    assert logits.i2t.item() == pytest.approx(0.0)
    assert "logit_bias" in similarity.metrics()


def test_point_sets_pool_by_weighted_mean():
    a = PointSet(torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]), weights=torch.tensor([[3.0, 1.0]]))
    b = unit([1.0, 0.0])
    # ū = (0.75, 0.25); logit = 1 · 0.75
    assert DotSimilarity(init_scale=1.0)(a, b).i2t.item() == pytest.approx(0.75)


def test_embed_factorises_the_similarity():
    similarity = DotSimilarity(init_scale=3.0)
    a, b = random_points(5, 4, 8, weighted=True, seed=1), random_points(3, 4, 8, seed=2)
    with torch.no_grad():
        product = similarity.scale() * similarity.embed(a) @ similarity.embed(b).t()
        torch.testing.assert_close(product, similarity(a, b).i2t)


def test_ensemble_is_mean_of_unit_vectors_renormalised():
    prompts = unit([1.0, 0.0], [0.0, 1.0], [0.6, 0.8])
    ensembled = DotSimilarity().ensemble(prompts, torch.tensor([0, 0, 1]))
    expected = torch.tensor([[1 / math.sqrt(2), 1 / math.sqrt(2)], [0.6, 0.8]])
    torch.testing.assert_close(ensembled.points[:, 0], expected)


def test_contract():
    check_similarity(DotSimilarity())
    with pytest.raises(ValueError, match="init_scale"):
        DotSimilarity(init_scale=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_products_match_float64_forward_and_backward(dtype):
    """Half rows: the products are exact fp32 sums of exact products (tiny accumulation error),
    the result is fp32, and the backward (HalfProducts's own: torch has no derivative for CUDA's
    ``mm(out_dtype=)``) gives dx = g y, dy = gᵀ x in the rows' dtype, off by the rounding of g and
    of the result to that dtype (8 or 11 bits)."""
    from clipkit.plugins.similarities.dot import products

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 24, generator=gen).to(dtype).requires_grad_()
    y = torch.randn(29, 24, generator=gen).to(dtype).requires_grad_()
    weights = torch.randn(37, 29, generator=gen, dtype=torch.float64)
    out = products(x, y)
    assert out.dtype == torch.float32
    x64, y64 = x.detach().double(), y.detach().double()
    torch.testing.assert_close(out.double(), x64 @ y64.t(), rtol=1e-6, atol=1e-5)
    (out.double() * weights).sum().backward()
    assert x.grad.dtype == dtype and y.grad.dtype == dtype
    bits = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
    for grad, reference in ((x.grad, weights @ y64), (y.grad, weights.t() @ x64)):
        error = (grad.double() - reference).abs().max() / reference.abs().max()
        assert 0 < error <= 2 * bits, error


def test_half_products_give_only_the_gradients_asked_for():
    from clipkit.plugins.similarities.dot import products

    x = torch.randn(5, 8).bfloat16().requires_grad_()
    y = torch.randn(6, 8).bfloat16()
    products(x, y).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and y.grad is None
