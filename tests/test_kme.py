"""`kme` similarity (METHODS.md §3).

Hand cases, naive references (loops and the full einsum) forward and backward, gradcheck, Proposition 2,
block-wise memory, γ clamp, prompt ensembling, contract, bad arguments, bf16 inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from clipkit.contract.testing import check_similarity
from clipkit.contract.types import LossContext, PointSet
from clipkit.plugins.losses.infonce import InfoNCE
from clipkit.plugins.similarities.kme import KMESimilarity, kme_logits


def unit_sets(rows) -> PointSet:
    """[[point, ...], ...] -> PointSet [B, M, d] (rows given already unit-norm)."""
    return PointSet(torch.tensor(rows, dtype=torch.float64))


def random_set(
    batch: int, points: int, dim: int, *, weighted: bool, masked: bool, seed: int, dtype=torch.float64
) -> PointSet:
    """Unit points (and weights, mask with >= 1 real point per row) requiring grad, reproducibly."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.nn.functional.normalize(
        torch.randn(batch, points, dim, generator=generator, dtype=dtype), dim=-1
    )
    weights = torch.rand(batch, points, generator=generator, dtype=dtype) + 0.1 if weighted else None
    mask = None
    if masked:
        mask = torch.rand(batch, points, generator=generator) < 0.6
        mask[:, 0] = True
    return PointSet(
        values.requires_grad_(),
        None if weights is None else weights.requires_grad_(),
        mask,
    )


def reference_log_weights(x: PointSet) -> torch.Tensor:
    """Independent restatement of the weight rule: raw weights, or 1/M_real; masked -> log 0 = -inf."""
    mask = x.mask if x.mask is not None else torch.ones(x.points.shape[:2], dtype=torch.bool)
    if x.weights is None:
        weights = (1.0 / mask.sum(dim=1, keepdim=True)).to(x.points.dtype).expand_as(mask)
    else:
        weights = x.weights
    return torch.where(mask, weights.log(), torch.tensor(float("-inf"), dtype=x.points.dtype))


def einsum_reference(a: PointSet, b: PointSet, gamma: torch.Tensor) -> torch.Tensor:
    """The naive computation: materialise [Na, Nb, Mx, My] scores and log-sum-exp them."""
    dots = torch.einsum("amd,bnd->abmn", a.points, b.points)
    scores = (
        reference_log_weights(a)[:, None, :, None] + reference_log_weights(b)[None, :, None, :] + gamma * dots
    )
    return torch.logsumexp(scores.flatten(2), dim=2) - gamma


def loop_reference(a: PointSet, b: PointSet, gamma: float) -> torch.Tensor:
    """Explicit loops over anchors a, candidates b and point pairs (i, j): log Σ w_i w'_j e^{γ(u·v − 1)}."""
    wa, wb = (reference_log_weights(x).detach().exp() for x in (a, b))
    out = torch.empty(a.batch_size, b.batch_size, dtype=torch.float64)
    for p in range(a.batch_size):
        for q in range(b.batch_size):
            total = 0.0
            for i in range(a.num_points):
                for j in range(b.num_points):
                    dot = float(a.points[p, i].detach() @ b.points[q, j].detach())
                    total += float(wa[p, i]) * float(wb[q, j]) * math.exp(gamma * (dot - 1.0))
            out[p, q] = math.log(total)
    return out


# --- hand-derived cases ---------------------------------------------------------------------------------


def test_one_point_each_is_gamma_times_dot_minus_one():
    """M = 1, w = 1: s = log e^{γ(u·v − 1)} = γ(u·v − 1); u = e1, v = (0.6, 0.8), γ = 10 -> 10·(−0.4) = −4;
    against v = e1: 0. ds/dt = γ(u·v − 1) too (γ = e^t), so the t-gradient of the sum is −4 + 0."""
    similarity = KMESimilarity(init_gamma=10.0).double()
    logits = similarity(unit_sets([[[1.0, 0.0]]]), unit_sets([[[0.6, 0.8]], [[1.0, 0.0]]]))
    torch.testing.assert_close(logits.i2t, torch.tensor([[-4.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(logits.t2i, logits.i2t.t())
    logits.i2t.sum().backward()
    assert similarity.log_gamma.grad.item() == pytest.approx(-4.0)


def test_two_weighted_points_by_hand():
    """Image points e1, e2 with weights (1, 3); text point e1 (w = 1); γ = 2:
    s = log(1·1·e^{2(1−1)} + 3·1·e^{2(0−1)}) = log(1 + 3e^{−2}).
    Uniform weights (None) over the same two points give log(½(1 + e^{−2}))."""
    image = PointSet(torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=torch.float64))
    weighted = PointSet(image.points, weights=torch.tensor([[1.0, 3.0]], dtype=torch.float64))
    text = unit_sets([[[1.0, 0.0]]])
    similarity = KMESimilarity(init_gamma=2.0).double()
    assert similarity(weighted, text).i2t.item() == pytest.approx(math.log(1 + 3 * math.exp(-2)))
    assert similarity(image, text).i2t.item() == pytest.approx(math.log(0.5 * (1 + math.exp(-2))))


def test_raw_weights_are_not_renormalised_and_masked_points_count_nothing():
    """Weights (2, 2) on two copies of e1 against e1: s = log(2 + 2) = log 4 (raw mass kept, not 1);
    masking the second point leaves log 2 whatever its weight or position."""
    points = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]], dtype=torch.float64)
    text = unit_sets([[[1.0, 0.0]]])
    similarity = KMESimilarity(init_gamma=5.0).double()
    full = PointSet(points, torch.tensor([[2.0, 2.0]], dtype=torch.float64))
    masked = PointSet(
        torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=torch.float64),
        torch.tensor([[2.0, 1e6]], dtype=torch.float64),
        torch.tensor([[True, False]]),
    )
    assert similarity(full, text).i2t.item() == pytest.approx(math.log(4.0))
    assert similarity(masked, text).i2t.item() == pytest.approx(math.log(2.0))


# --- naive references ------------------------------------------------------------------------------------


def test_matches_explicit_loops():
    a = random_set(3, 4, 5, weighted=True, masked=True, seed=1)
    b = random_set(2, 3, 5, weighted=False, masked=True, seed=2)
    similarity = KMESimilarity(init_gamma=7.0, block_size=2).double()
    with torch.no_grad():
        got = similarity(a, b).i2t
    torch.testing.assert_close(got, loop_reference(a, b, 7.0))


@pytest.mark.parametrize(
    ("na", "nb", "block_size", "weighted", "masked"),
    [
        (7, 5, 3, True, True),  # uneven last blocks on both sides
        (7, 5, 3, False, True),  # uniform 1/M_real weights under a mask
        (7, 5, 3, True, False),
        (4, 6, 64, True, True),  # one block larger than N
        (5, 5, 1, False, False),  # one anchor × one candidate per block
    ],
)
def test_blockwise_matches_einsum_reference_forward_and_backward(na, nb, block_size, weighted, masked):
    a = random_set(na, 4, 6, weighted=weighted, masked=masked, seed=3)
    b = random_set(nb, 3, 6, weighted=weighted, masked=masked, seed=4)
    similarity = KMESimilarity(init_gamma=9.0, block_size=block_size).double()
    upstream = torch.randn(na, nb, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    got = similarity(a, b).i2t
    named = {"u": a.points, "v": b.points, "t": similarity.log_gamma}
    if weighted:
        named.update({"w": a.weights, "w'": b.weights})
    leaves = list(named.values())
    got_grads = torch.autograd.grad((got * upstream).sum(), leaves)

    expected = einsum_reference(a, b, similarity.log_gamma.exp())
    expected_grads = torch.autograd.grad((expected * upstream).sum(), leaves)

    torch.testing.assert_close(got, expected)
    for name, g, e in zip(named, got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, msg=lambda m, name=name: f"gradient wrt {name}: {m}")


def test_gradcheck_points_weights_and_gamma():
    """torch.autograd.gradcheck through masks, explicit weights and uneven blocks (points need not be
    unit vectors for the formulas to hold)."""
    generator = torch.Generator().manual_seed(6)
    u = torch.randn(3, 3, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    wu = (torch.rand(3, 3, generator=generator, dtype=torch.float64) + 0.5).requires_grad_()
    wv = (torch.rand(2, 2, generator=generator, dtype=torch.float64) + 0.5).requires_grad_()
    log_gamma = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    mask_u = torch.tensor([[True, True, False], [True, False, True], [True, True, True]])

    def fn(u, wu, v, wv, log_gamma):
        return kme_logits(PointSet(u, wu, mask_u), PointSet(v, wv), log_gamma.exp(), block_size=2)

    assert torch.autograd.gradcheck(fn, (u, wu, v, wv, log_gamma))


# --- METHODS identities -----------------------------------------------------------------------------------


def test_proposition_2_single_points_equal_clip_up_to_a_constant():
    """M = 1, w = 1 (explicit or uniform): s = γ u·v − γ; InfoNCE is shift-invariant per row, so the
    loss and its gradients equal CLIP's InfoNCE on γ u·v."""
    gamma = 1 / 0.07
    a = random_set(6, 1, 8, weighted=False, masked=False, seed=7)
    b = random_set(6, 1, 8, weighted=False, masked=False, seed=8)
    ones = torch.ones(6, 1, dtype=torch.float64)
    similarity = KMESimilarity().double()
    clip = gamma * a.points[:, 0] @ b.points[:, 0].t()
    for x, y in [(a, b), (PointSet(a.points, ones), PointSet(b.points, ones))]:
        torch.testing.assert_close(similarity(x, y).i2t, clip - gamma)

    targets, ctx = torch.arange(6), LossContext()
    kme_loss = InfoNCE()(similarity(a, b), targets, ctx).loss
    kme_grads = torch.autograd.grad(kme_loss, [a.points, b.points])
    clip_loss = InfoNCE()(type(similarity(a, b)).symmetric(clip), targets, ctx).loss
    clip_grads = torch.autograd.grad(clip_loss, [a.points, b.points])
    torch.testing.assert_close(kme_loss, clip_loss)
    for g, e in zip(kme_grads, clip_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_prompt_ensemble_is_the_mean_of_rkhs_embeddings():
    """exp s(image, union_g) = mean_{k in g} exp s(image, prompt_k): the union with weights / K_g is the
    mean embedding. Groups unsorted and of unequal sizes, prompts masked, weights explicit or uniform."""
    images = random_set(3, 4, 5, weighted=True, masked=False, seed=9)
    groups = torch.tensor([1, 0, 1, 2, 1, 0])
    similarity = KMESimilarity(init_gamma=6.0).double()
    for weighted in (False, True):
        prompts = random_set(6, 3, 5, weighted=weighted, masked=True, seed=10)
        union = similarity.ensemble(prompts, groups)
        assert tuple(union.points.shape) == (3, 3 * 3, 5) and union.weights is not None
        per_prompt = similarity(images, prompts).i2t.exp()  # [3 images, 6 prompts]
        expected = torch.stack([per_prompt[:, groups == g].mean(dim=1) for g in range(3)], dim=1)
        torch.testing.assert_close(similarity(images, union).i2t.exp(), expected)
        # Coordinates are carried over, never averaged: every real union point is one of the prompts' points.
        real = union.points[union.mask]
        assert real.shape[0] == int(prompts.mask.sum())
        assert torch.cdist(real, prompts.points[prompts.mask]).min(dim=1).values.max() < 1e-12


# --- block-wise memory -------------------------------------------------------------------------------------


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor produced by any op."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _saved_numels(fn) -> list[int]:
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.sum().backward()
    return sizes


def autograd_blockwise_reference(a: PointSet, b: PointSet, gamma: torch.Tensor, block: int) -> torch.Tensor:
    """Block-wise forward with plain autograd: no tile is ever whole-batch, but autograd keeps every tile
    for backward, so the memory held between forward and backward is still O(Na·Nb·Mx·My)."""
    la, lb = reference_log_weights(a), reference_log_weights(b)
    rows = []
    for r in range(0, a.batch_size, block):
        cols = []
        for c in range(0, b.batch_size, block):
            dots = torch.einsum("amd,bnd->abmn", a.points[r : r + block], b.points[c : c + block])
            scores = la[r : r + block, None, :, None] + lb[None, c : c + block, None, :] + gamma * dots
            cols.append(torch.logsumexp(scores.flatten(2), dim=2))
        rows.append(torch.cat(cols, dim=1))
    return torch.cat(rows) - gamma


def test_never_saves_or_materialises_the_full_score_tensor():
    """Na·Nb·Mx·My = 7·5·6·5 = 1050; a 3×3 block holds 3·3·6·5 = 270. The tensors saved for backward must
    total fewer than 1050 elements (inputs + [Na, Nb] only), and no intermediate of forward or backward may
    reach 1050. The einsum reference breaks both; plain-autograd tiling breaks the first (so this can
    fail)."""
    na, nb, mx, my = 7, 5, 6, 5
    full = na * nb * mx * my
    similarity = KMESimilarity(block_size=3).double()

    def make():
        a = random_set(na, mx, 3, weighted=True, masked=True, seed=11)
        b = random_set(nb, my, 3, weighted=True, masked=True, seed=12)
        return a, b

    a, b = make()
    saved = _saved_numels(lambda: similarity(a, b).i2t)
    assert saved and sum(saved) < full, f"{sum(saved)} >= {full} elements saved for backward"
    a, b = make()
    assert max(_saved_numels(lambda: einsum_reference(a, b, similarity.gamma()))) >= full
    a, b = make()
    assert sum(_saved_numels(lambda: autograd_blockwise_reference(a, b, similarity.gamma(), 3))) >= full
    torch.testing.assert_close(
        autograd_blockwise_reference(a, b, similarity.gamma(), 3), einsum_reference(a, b, similarity.gamma())
    )

    a, b = make()
    with _LargestTensor() as probe:
        similarity(a, b).i2t.sum().backward()
    assert probe.largest < full, f"an intermediate has {probe.largest} >= {full} elements"
    with _LargestTensor() as probe:
        einsum_reference(*make(), similarity.gamma()).sum().backward()
    assert probe.largest >= full


# --- temperature, edge cases, contract, errors, dtypes ------------------------------------------------------


def test_gamma_init_clamp_and_learnability():
    assert KMESimilarity().gamma().item() == pytest.approx(1 / 0.07, rel=1e-6)
    clamped = KMESimilarity(init_gamma=100.0, max_gamma=100.0)  # a start above the bound is refused
    assert clamped.gamma().item() == pytest.approx(100.0)
    assert clamped.metrics() == {"gamma": pytest.approx(100.0)}
    a = random_set(2, 2, 3, weighted=False, masked=False, seed=13, dtype=torch.float32)
    clamped(a, a).i2t.sum().backward()
    assert clamped.log_gamma.grad.item() != 0.0  # at the bound the gradient flows (clamped after the step)
    assert clamped.parameter_bounds() == {"log_gamma": (None, pytest.approx(math.log(100.0)))}
    unclamped = KMESimilarity(init_gamma=500.0, max_gamma=None)
    assert unclamped.gamma().item() == pytest.approx(500.0)
    unclamped(a, a).i2t.sum().backward()
    assert unclamped.log_gamma.grad.item() != 0.0
    fixed = KMESimilarity(learn_gamma=False)
    assert not any(p.requires_grad for p in fixed.parameters())
    assert fixed.gamma().item() == pytest.approx(1 / 0.07, rel=1e-6)


def test_set_with_no_real_point_gives_minus_inf_and_no_nan_gradient():
    a = random_set(2, 3, 4, weighted=True, masked=False, seed=14)
    a = PointSet(a.points, a.weights, torch.tensor([[True, True, False], [False, False, False]]))
    b = random_set(3, 2, 4, weighted=False, masked=False, seed=15)
    logits = KMESimilarity(block_size=1).double()(a, b).i2t
    assert torch.isfinite(logits[0]).all() and torch.isneginf(logits[1]).all()
    logits[0].sum().backward()
    assert torch.isfinite(a.points.grad).all() and torch.isfinite(a.weights.grad).all()
    assert a.points.grad[1].abs().max() == 0 and a.weights.grad[:, 2].abs().max() == 0


def test_bf16_inputs_are_upcast_to_fp32():
    a32 = random_set(5, 4, 8, weighted=True, masked=True, seed=16, dtype=torch.float32)
    b32 = random_set(4, 3, 8, weighted=True, masked=False, seed=17, dtype=torch.float32)

    def bf16(x):
        weights = x.weights.detach().bfloat16().requires_grad_()
        return PointSet(x.points.detach().bfloat16().requires_grad_(), weights, x.mask)

    a16, b16 = bf16(a32), bf16(b32)
    similarity = KMESimilarity(block_size=2)
    got = similarity(a16, b16).i2t
    assert got.dtype == torch.float32
    # Exactly the fp32 computation on the bf16-rounded values (so the upcast happens before any arithmetic)...
    upcast = [PointSet(x.points.float(), x.weights.float(), x.mask) for x in (a16, b16)]
    torch.testing.assert_close(got, similarity(*upcast).i2t)
    # ...and within bf16 rounding of the fp32 result (γ ≈ 14.3 amplifies the 2^-8 relative rounding).
    torch.testing.assert_close(got, similarity(a32, b32).i2t, atol=0.15, rtol=0.02)
    got.sum().backward()
    assert a16.points.grad.dtype == torch.bfloat16 and torch.isfinite(a16.points.grad.float()).all()


def test_contract_and_embed():
    check_similarity(KMESimilarity())
    check_similarity(KMESimilarity(block_size=2), weighted=True)
    assert KMESimilarity().embed(random_set(2, 2, 3, weighted=False, masked=False, seed=0)) is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": -3}, "block_size"),
        ({"init_gamma": 0.0}, "init_gamma"),
        ({"init_gamma": -1.0}, "init_gamma"),
        ({"max_gamma": 0.0}, "max_gamma"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KMESimilarity(**kwargs)


def test_mismatched_dimensions_and_groups_are_rejected():
    similarity = KMESimilarity()
    a = random_set(2, 2, 3, weighted=False, masked=False, seed=0)
    with pytest.raises(ValueError, match="point dimensions differ"):
        similarity(a, random_set(2, 2, 4, weighted=False, masked=False, seed=1))
    with pytest.raises(ValueError, match="groups"):
        similarity.ensemble(a, torch.tensor([0, 1, 1]))


# --- zero point weights (issue 15) --------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["blockwise", "naive"])
def test_exact_zero_weight_on_a_real_point_has_finite_gradients(implementation):
    """A softplus weight that underflowed to exactly 0 on an unmasked point: the logits equal those
    with that point masked out (it contributes nothing), and every gradient is finite — the weight's
    own is 0, the others equal the masked set's (before the fix log(0)'s 1/w gave NaN)."""
    a = random_set(3, 3, 5, weighted=True, masked=False, seed=21)
    b = random_set(4, 2, 5, weighted=True, masked=False, seed=22)
    weights = a.weights.detach().clone()
    weights[1, 2] = 0.0
    zero = PointSet(a.points, weights.requires_grad_(), None)
    masked_out = PointSet(a.points, weights.clone().requires_grad_(), torch.ones(3, 3, dtype=torch.bool))
    masked_out.mask[1, 2] = False
    gamma = torch.tensor(8.0, dtype=torch.float64)
    upstream = torch.randn(3, 4, generator=torch.Generator().manual_seed(23), dtype=torch.float64)

    got = kme_logits(zero, b, gamma, implementation=implementation)
    got_grads = torch.autograd.grad((got * upstream).sum(), [zero.points, zero.weights, b.points])
    expected = kme_logits(masked_out, b, gamma, implementation=implementation)
    leaves = [a.points, masked_out.weights, b.points]
    expected_grads = torch.autograd.grad((expected * upstream).sum(), leaves)

    torch.testing.assert_close(got, expected)
    assert all(torch.isfinite(g).all() for g in got_grads)
    assert got_grads[1][1, 2] == 0.0
    for g, e in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_zero_weight_gradient_is_finite_in_fp32_through_softplus():
    """fp32 softplus(−200) is exactly 0: the KME similarity and InfoNCE on top give finite gradients
    to the pre-activations (NaN before the fix)."""
    generator = torch.Generator().manual_seed(24)
    points = torch.nn.functional.normalize(torch.randn(4, 3, 6, generator=generator), dim=-1)
    raw = torch.randn(4, 3, generator=generator)
    raw[2, 1] = -200.0
    raw.requires_grad_()
    weights = torch.nn.functional.softplus(raw)
    assert float(weights[2, 1]) == 0.0
    text = PointSet(torch.nn.functional.normalize(torch.randn(4, 2, 6, generator=generator), dim=-1))
    logits = KMESimilarity()(PointSet(points.requires_grad_(), weights), text)
    loss = InfoNCE()(logits, torch.arange(4), LossContext()).loss
    loss.backward()
    assert torch.isfinite(raw.grad).all() and torch.isfinite(points.grad).all()
