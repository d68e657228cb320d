"""`infonce` against a hand-derived case and a naive loop reference (forward and backward)."""

import math

import pytest
import torch

from clipkit.contract.testing import check_loss
from clipkit.contract.types import Logits, LossContext
from clipkit.plugins.losses.infonce import InfoNCE


def naive_infonce(i2t: torch.Tensor) -> torch.Tensor:
    """½ [mean_a −log softmax_row(a)[a] + mean_b −log softmax_col(b)[b]], written as loops."""
    n = i2t.shape[0]
    rows = []
    cols = []
    for a in range(n):
        denominator = sum(torch.exp(i2t[a, j]) for j in range(n))
        rows.append(-(i2t[a, a] - torch.log(denominator)))
    for b in range(n):
        denominator = sum(torch.exp(i2t[j, b]) for j in range(n))
        cols.append(-(i2t[b, b] - torch.log(denominator)))
    return (sum(rows) / n + sum(cols) / n) / 2


def test_hand_derived_two_pairs():
    # Each row/column: log(e^2 + e^0) − 2 = log(1 + e^−2).
    logits = Logits.symmetric(torch.tensor([[2.0, 0.0], [0.0, 2.0]]))
    out = InfoNCE()(logits, torch.arange(2), LossContext())
    assert out.loss.item() == pytest.approx(math.log(1 + math.exp(-2)), abs=1e-6)
    assert out.loss.item() == pytest.approx(0.126928, abs=1e-6)
    assert float(out.metrics["acc_i2t"]) == 1.0


def test_uniform_logits_give_log_n():
    n = 7
    out = InfoNCE()(Logits.symmetric(torch.zeros(n, n)), torch.arange(n), LossContext())
    assert out.loss.item() == pytest.approx(math.log(n), abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_naive_reference_forward_and_backward(seed):
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 6, generator=generator, dtype=torch.float64) * 3
    fast_input = base.clone().requires_grad_()
    naive_input = base.clone().requires_grad_()
    fast = InfoNCE()(Logits.symmetric(fast_input), torch.arange(6), LossContext()).loss
    naive = naive_infonce(naive_input)
    torch.testing.assert_close(fast, naive)
    fast.backward()
    naive.backward()
    torch.testing.assert_close(fast_input.grad, naive_input.grad)


def test_directions_are_separate_for_asymmetric_logits():
    i2t = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    t2i = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    out = InfoNCE()(Logits(i2t=i2t, t2i=t2i), torch.arange(2), LossContext())
    expected_i2t = (math.log(1 + math.exp(-3)) + math.log(1 + math.exp(-1))) / 2
    expected_t2i = math.log(1 + math.exp(-1))
    assert out.loss.item() == pytest.approx((expected_i2t + expected_t2i) / 2, abs=1e-6)


def test_contract_and_bad_arguments():
    check_loss(InfoNCE())
    with pytest.raises(ValueError, match="label_smoothing"):
        InfoNCE(label_smoothing=1.5)
