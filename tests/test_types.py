import pytest
import torch

from clipkit.contract.types import Logits, LossContext, PointSet


def test_pointset_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\[B, M, d\]"):
        PointSet(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="weights"):
        PointSet(torch.zeros(2, 3, 4), weights=torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask"):
        PointSet(torch.zeros(2, 3, 4), mask=torch.ones(3, 3, dtype=torch.bool))


def test_mean_uses_weights_and_mask():
    points = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])
    weights = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    # masked point ignored; weights 1:3 -> (0.25, 0.75)
    torch.testing.assert_close(PointSet(points, weights, mask).mean(), torch.tensor([[0.25, 0.75]]))
    # uniform weights over the two real points
    torch.testing.assert_close(PointSet(points, None, mask).mean(), torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(PointSet(points).mean(), torch.tensor([[2.0, 2.0]]))


def test_float_and_shape_properties():
    ps = PointSet(torch.zeros(2, 3, 4, dtype=torch.bfloat16), torch.ones(2, 3, dtype=torch.bfloat16))
    assert ps.float().points.dtype == torch.float32 and ps.float().weights.dtype == torch.float32
    assert (ps.batch_size, ps.num_points, ps.dim) == (2, 3, 4)


def test_logits_symmetric_is_transpose():
    i2t = torch.arange(6.0).view(2, 3)
    logits = Logits.symmetric(i2t)
    assert torch.equal(logits.t2i, i2t.t())


def test_loss_context_exposes_only_declared_fields():
    ctx = LossContext(index=torch.arange(3))
    assert torch.equal(ctx.index, torch.arange(3))
    assert "index" in ctx and "meta" not in ctx
    with pytest.raises(AttributeError, match="add 'meta' to the loss's `requires`"):
        _ = ctx.meta
    with pytest.raises(TypeError, match="unknown LossContext fields"):
        LossContext(bogus=1)
