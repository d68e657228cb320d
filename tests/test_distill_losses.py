"""Distillation losses (issue 39 item 2): ``kl``, ``feature_cosine``, ``feature_mse`` against hand-derived
values and naive float64 loops, forward and backward (the gradients against their closed forms)."""

from __future__ import annotations

import math

import pytest
import torch

from clipkit.contract.registry import default_registry
from clipkit.contract.types import DistillView, Logits
from clipkit.plugins.losses.distill import FeatureCosine, FeatureMSE, KLDistillation


def view(i2t, t2i=None, image=None, text=None) -> DistillView:
    i2t = torch.as_tensor(i2t, dtype=torch.float64)
    t2i = i2t.t() if t2i is None else torch.as_tensor(t2i, dtype=torch.float64)
    image = torch.zeros(i2t.shape[0], 2, dtype=torch.float64) if image is None else image
    text = torch.zeros(t2i.shape[0], 2, dtype=torch.float64) if text is None else text
    return DistillView(Logits(i2t, t2i), image, text)


def naive_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> float:
    """Σ_j p_ij log(p_ij / q_ij), averaged over rows, one element at a time (math module)."""
    total = 0.0
    for s_row, t_row in zip(student.tolist(), teacher.tolist(), strict=True):
        zs = sum(math.exp(x / temperature) for x in s_row)
        zt = sum(math.exp(x / temperature) for x in t_row)
        for s, t in zip(s_row, t_row, strict=True):
            p, q = math.exp(t / temperature) / zt, math.exp(s / temperature) / zs
            total += p * math.log(p / q)
    return total / student.shape[0]


def test_kl_by_hand():
    # s = [[2, 0], [0, 2]], t = [[1, 0], [0, 1]]: p = (σ(1), σ(−1)), q = (σ(2), σ(−2)) in every row.
    sigma = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = sigma(1) * math.log(sigma(1) / sigma(2)) + sigma(-1) * math.log(sigma(-1) / sigma(-2))
    out = KLDistillation()(view([[2.0, 0.0], [0.0, 2.0]]), view([[1.0, 0.0], [0.0, 1.0]]))
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(0.0826, abs=1e-4)
    entropy = -(sigma(1) * math.log(sigma(1)) + sigma(-1) * math.log(sigma(-1)))
    assert out.metrics["cross_entropy"].item() == pytest.approx(expected + entropy, abs=1e-12)


def test_kl_is_zero_for_identical_distributions_and_shift_invariant():
    logits = torch.randn(5, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = KLDistillation()(view(logits), view(logits + 3.0))  # a bias moves no softmax
    assert out.loss.item() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_kl_against_a_naive_loop_forward_and_backward(temperature):
    generator = torch.Generator().manual_seed(1)
    s_i2t = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 3
    s_t2i = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 3
    t_i2t = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 3
    t_t2i = torch.randn(4, 6, generator=generator, dtype=torch.float64) * 3
    student = view(s_i2t.clone().requires_grad_(), s_t2i.clone().requires_grad_())
    out = KLDistillation(temperature)(student, view(t_i2t, t_t2i))
    expected = (naive_kl(s_i2t, t_i2t, temperature) + naive_kl(s_t2i, t_t2i, temperature)) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    out.loss.backward()
    # d/ds_ij of the mean-over-rows KL, halved for the two directions: (q_ij − p_ij) / (T · rows · 2)
    for s, t, grad in ((s_i2t, t_i2t, student.logits.i2t.grad), (s_t2i, t_t2i, student.logits.t2i.grad)):
        q, p = torch.softmax(s / temperature, 1), torch.softmax(t / temperature, 1)
        assert torch.allclose(grad, (q - p) / (temperature * s.shape[0] * 2), atol=1e-14)


def test_kl_sends_no_gradient_to_the_teacher():
    teacher = view(torch.randn(3, 3, dtype=torch.float64).requires_grad_())
    student = view(torch.randn(3, 3, dtype=torch.float64).requires_grad_())
    KLDistillation()(student, teacher).loss.backward()
    assert student.logits.i2t.grad is not None and teacher.logits.i2t.grad is None


def test_feature_cosine_by_hand_and_backward():
    # e1 against (e1 + e2)/√2: cos = 1/√2; the text pair is identical (loss 0).
    student_image = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    teacher_image = torch.tensor([[1.0, 1.0]], dtype=torch.float64) / math.sqrt(2)
    text = torch.tensor([[0.6, 0.8]], dtype=torch.float64)
    out = FeatureCosine()(
        view([[0.0]], image=student_image, text=text), view([[0.0]], image=teacher_image, text=text)
    )
    assert out.metrics["image"].item() == pytest.approx(1 - 1 / math.sqrt(2), abs=1e-12)
    assert out.metrics["text"].item() == pytest.approx(0.0, abs=1e-12)
    assert out.loss.item() == pytest.approx((1 - 1 / math.sqrt(2)) / 2, abs=1e-12)
    out.loss.backward()
    # d(−cos)/ds for a unit s: −(t̂ − (s·t̂) s) / |s|, halved (image and text averaged)
    s, t = student_image.detach()[0], teacher_image[0]
    expected = -(t - (s @ t) * s) / 2
    assert torch.allclose(student_image.grad[0], expected, atol=1e-14)


def naive_mean(rows_a, rows_b, term) -> float:
    values = [term(a, b) for a, b in zip(rows_a.tolist(), rows_b.tolist(), strict=True)]
    return sum(values) / len(values)


def test_feature_losses_against_naive_loops_forward_and_backward():
    generator = torch.Generator().manual_seed(2)
    s_img, s_txt, t_img, t_txt = (
        torch.randn(5, 3, generator=generator, dtype=torch.float64) for _ in range(4)
    )

    def cosine(a, b):
        return 1 - sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(
            sum(x * x for x in a) * sum(y * y for y in b)
        )

    def squared(a, b):
        return sum((x - y) ** 2 for x, y in zip(a, b, strict=True))

    for loss, term in ((FeatureCosine(), cosine), (FeatureMSE(), squared)):
        image, text = s_img.clone().requires_grad_(), s_txt.clone().requires_grad_()
        out = loss(
            view(torch.zeros(5, 5), image=image, text=text), view(torch.zeros(5, 5), image=t_img, text=t_txt)
        )
        expected = (naive_mean(s_img, t_img, term) + naive_mean(s_txt, t_txt, term)) / 2
        assert out.loss.item() == pytest.approx(expected, rel=1e-12)
        out.loss.backward()
        if isinstance(loss, FeatureMSE):  # d/ds of mean ||s − t||², halved: (s − t) / rows
            assert torch.allclose(image.grad, (s_img - t_img) / 5, atol=1e-14)
        else:  # −(t̂ − cos·ŝ)/|s| per row, / rows, halved
            norm_s, unit_t = s_img.norm(dim=1, keepdim=True), t_img / t_img.norm(dim=1, keepdim=True)
            cos = ((s_img / norm_s) * unit_t).sum(1, keepdim=True)
            expected_grad = -(unit_t - cos * s_img / norm_s) / norm_s / 5 / 2
            assert torch.allclose(image.grad, expected_grad, atol=1e-14)


def test_registered_through_the_plugin_manager():
    registry = default_registry()
    assert {"kl", "feature_cosine", "feature_mse"} <= set(registry.names("distill_loss"))
    assert registry.get("distill_loss", "kl").plugin.endswith("losses")
    assert getattr(registry.factory("distill_loss", "feature_mse")(), "compares_features", False)


@pytest.mark.parametrize("name", ["kl", "feature_cosine", "feature_mse"])
def test_built_ins_pass_the_plugin_contract_check(name):
    from clipkit.contract.testing import check_distill_loss

    check_distill_loss(default_registry().factory("distill_loss", name)())


def test_the_contract_check_catches_a_loss_that_ignores_the_student():
    from clipkit.contract.testing import check_distill_loss
    from clipkit.contract.types import LossOutput

    def teacher_only(student, teacher):
        return LossOutput((teacher.image**2).sum())

    with pytest.raises(AssertionError, match="does not depend on the student"):
        check_distill_loss(teacher_only)
