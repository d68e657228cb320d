"""y-Aware InfoNCE, conditional alignment/uniformity and the SimCLR / SupCon / align+uniform baselines
(METHODS §5, §11): hand-derived cases, naive loop references (forward and backward), the identities
between the losses, the meta-data kernels, contract checks and bad arguments."""

import math

import pytest
import torch

from clipkit.contract.testing import check_loss
from clipkit.contract.types import Logits, LossContext, PointSet
from clipkit.plugins.losses.yaware import (
    AlignUniform,
    ConditionalAlignUniform,
    SimCLRLoss,
    SupConLoss,
    YAwareInfoNCE,
    meta_kernel,
    view_weights,
)

TAU = 0.1
LN2, LN3 = math.log(2), math.log(3)
R = math.exp(-0.5)  # RBF weight between ages 0 and 1 with σ = 1


# --------------------------------------------------------------------------- helpers


def unit_views(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two [n, d] float64 leaves of unit rows (view 1, view 2), with gradients."""
    generator = torch.Generator().manual_seed(seed)
    z1, z2 = (
        torch.nn.functional.normalize(torch.randn(n, d, generator=generator, dtype=torch.float64), dim=1)
        for _ in range(2)
    )
    return z1.requires_grad_(), z2.requires_grad_()


def two_view_batch(z1: torch.Tensor, z2: torch.Tensor, meta=None) -> tuple[Logits, LossContext]:
    """The `dot` logits x·x'/τ of a two-view batch and the context (in_modal, meta)."""
    logits = Logits.symmetric(z1 @ z2.t() / TAU)
    in_modal = Logits(i2t=z1 @ z1.t() / TAU, t2i=z2 @ z2.t() / TAU)
    fields = {"in_modal": in_modal} if meta is None else {"in_modal": in_modal, "meta": meta}
    return logits, LossContext(**fields)


def hand_batch(meta: dict) -> tuple[Logits, LossContext]:
    """N = 2: in every row of F the other view of the same sample has ln 2, the same view of the other
    sample ln 3, the other view of the other sample 0; self-similarities are 5 (must be ignored)."""
    i2t = torch.tensor([[LN2, 0.0], [0.0, LN2]], dtype=torch.float64)
    in_modal = torch.tensor([[5.0, LN3], [LN3, 5.0]], dtype=torch.float64)
    context = LossContext(in_modal=Logits(i2t=in_modal, t2i=in_modal.clone()), meta=meta)
    return Logits.symmetric(i2t), context


def naive_views(z1, z2):
    """The 2N views in F's order and f(i, k) = x_i·x_k/τ, one pair at a time."""
    views = list(z1) + list(z2)

    def f(i, k):
        return torch.dot(views[i], views[k]) / TAU

    return views, f


def rbf_age_sex(ages, sexes, sigma):
    """w(a, b) on sample indices, written with math: exp(−Δage²/(2σ²))·δ(sex)."""

    def weight(a, b):
        return math.exp(-((ages[a] - ages[b]) ** 2) / (2 * sigma**2)) * float(sexes[a] == sexes[b])

    return weight


def naive_yaware(z1, z2, weight, normalisation="rows"):
    """−Σ_i Σ_{k≠i} w̃_ik log(e^{f(i,k)} / Σ_{j≠i} e^{f(i,j)}) / (2N rows | N code), loops over i, k, j."""
    views, f = naive_views(z1, z2)
    size, n = len(views), len(views) // 2
    total = 0.0
    for i in range(size):
        log_denominator = torch.log(sum(torch.exp(f(i, j)) for j in range(size) if j != i))
        for k in range(size):
            if k == i:
                continue
            if normalisation == "rows":
                norm = sum(weight(i % n, j % n) for j in range(size) if j != i)
            else:  # the official code: column sums
                norm = sum(weight(j % n, k % n) for j in range(size) if j != k)
            total = total + weight(i % n, k % n) / norm * (f(i, k) - log_denominator)
    return -total / (size if normalisation == "rows" else n)


def naive_cond_align_unif(z1, z2, weight, lam, eps=1e-6):
    views, f = naive_views(z1, z2)
    size, n = len(views), len(views) // 2
    align = 0.0
    unif_sum = 0.0
    for i in range(size):
        others = [j for j in range(size) if j != i]
        row_sum = sum(weight(i % n, j % n) for j in others)
        z_hat = row_sum / (size - 1)
        for k in others:
            align = align + weight(i % n, k % n) / row_sum * f(i, k)
            unif_sum = unif_sum + (1 - weight(i % n, k % n)) / max(1 - z_hat, eps) * torch.exp(f(i, k))
    align = -align / size
    unif = torch.log(unif_sum / (size * (size - 1)))
    return align + lam * unif, align, unif


def naive_supcon(z1, z2, labels, factor):
    """Khosla et al. L_out: −factor · mean_i mean_{p∈P(i)} log(e^{f(i,p)} / Σ_{a≠i} e^{f(i,a)})."""
    views, f = naive_views(z1, z2)
    size, n = len(views), len(views) // 2
    total = 0.0
    for i in range(size):
        positives = [p for p in range(size) if p != i and labels[p % n] == labels[i % n]]
        log_denominator = torch.log(sum(torch.exp(f(i, a)) for a in range(size) if a != i))
        total = total + sum(f(i, p) - log_denominator for p in positives) / len(positives)
    return -factor * total / size


def naive_pool(points, weights):
    """Weighted mean of each set's points, then divided by its norm: [N, M, d], [N, M] -> list of [d]."""
    pooled = []
    for b in range(points.shape[0]):
        mean = sum(weights[b, m] * points[b, m] for m in range(points.shape[1])) / weights[b].sum()
        pooled.append(mean / torch.sqrt(sum(value**2 for value in mean)))
    return pooled


def naive_align_uniform(x1, x2, alpha, t, align_weight, uniform_weight):
    n = len(x1)
    align = sum(torch.sqrt(sum((x1[i] - x2[i]) ** 2)) ** alpha for i in range(n)) / n

    def uniformity(x):
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
        return torch.log(sum(torch.exp(-t * sum((x[i] - x[j]) ** 2)) for i, j in pairs) / len(pairs))

    unif = (uniformity(x1) + uniformity(x2)) / 2
    return align_weight * align + uniform_weight * unif


def nt_xent(logits: Logits, ctx: LossContext) -> torch.Tensor:
    """Classical NT-Xent written independently: cross-entropy over 2N rows, target = the other view."""
    n = logits.i2t.shape[0]
    full = torch.cat(
        [torch.cat([ctx.in_modal.i2t, logits.i2t], 1), torch.cat([logits.t2i, ctx.in_modal.t2i], 1)], 0
    )
    full = full - torch.diag(torch.full((2 * n,), float("inf"), dtype=full.dtype))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return torch.nn.functional.cross_entropy(full, targets)


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


# --------------------------------------------------------------------------- hand-derived cases


def test_hand_derived_yaware_simclr_supcon():
    """Each row's softmax denominator over k ≠ i is e^{ln 2} + e^{ln 3} + e^0 = 6 (the 5s excluded).
    SimCLR: −ln(2/6) = ln 3.  RBF (ages 0, 1, σ = 1, r = e^{−1/2}): weights 1, r, r over the pos,
    same-view and other-view candidates → [ln 3 + r·ln 2 + r·ln 6] / (1 + 2r) = [ln 3 + r·ln 12]/(1 + 2r).
    All labels equal: −(1/3)[ln(2/6) + ln(3/6) + ln(1/6)] = (2/3)·ln 6. The code's normalisation (all
    column sums equal 1 + 2r) is twice the rows one."""
    meta = {"age": [0.0, 1.0], "label": ["a", "a"]}
    rbf = [{"key": "age", "type": "rbf", "sigma": 1.0}]
    targets = torch.arange(2)
    logits, ctx = hand_batch(meta)
    assert SimCLRLoss()(logits, targets, ctx).loss.item() == pytest.approx(LN3)
    expected = (LN3 + R * math.log(12)) / (1 + 2 * R)
    assert YAwareInfoNCE(rbf)(logits, targets, ctx).loss.item() == pytest.approx(expected)
    assert YAwareInfoNCE(rbf, "code")(logits, targets, ctx).loss.item() == pytest.approx(2 * expected)
    assert SupConLoss()(logits, targets, ctx).loss.item() == pytest.approx(2 / 3 * math.log(6))
    scaled = SupConLoss(base_temperature=0.14, temperature=0.07)(logits, targets, ctx).loss.item()
    assert scaled == pytest.approx(1 / 3 * math.log(6))
    logits, ctx = hand_batch({"label": ["a", "b"]})
    assert SupConLoss()(logits, targets, ctx).loss.item() == pytest.approx(LN3)


def test_hand_derived_conditional_align_uniform():
    """Same F and RBF weights (1, r, r). Alignment: −[1·ln 2 + r·ln 3 + r·0] / (1 + 2r) per row.
    Uniformity: Ẑ = (1 + 2r)/3, 1 − Ẑ = (2 − 2r)/3; each row sums 0·2 + (1 − r)·3/(2 − 2r)·(3 + 1) = 6,
    so log(4 · 6 / 12 ordered pairs) = ln 2. λ = 0.5 → align + ln 2 / 2."""
    logits, ctx = hand_batch({"age": [0.0, 1.0]})
    out = ConditionalAlignUniform([{"key": "age", "type": "rbf", "sigma": 1.0}], lam=0.5)(
        logits, torch.arange(2), ctx
    )
    align = -(LN2 + R * LN3) / (1 + 2 * R)
    assert float(out.metrics["align"]) == pytest.approx(align)
    assert float(out.metrics["unif"]) == pytest.approx(LN2)
    assert out.loss.item() == pytest.approx(align + LN2 / 2)


def test_hand_derived_align_uniform():
    """x = ([1, 0], [0, 1]) (view 1's first set pools [0.6, ±0.8] to [0.6, 0] → [1, 0]),
    x' = ([0, 1], [1, 0]).
    ‖x_i − x'_i‖² = 2: align = 2 (α = 2) or √2 (α = 1); each view has one pair at squared distance 2:
    unif = log e^{−2t} = −4 (t = 2). Weights (0.5, 2): 0.5·2 + 2·(−4) = −7."""
    view1 = PointSet(torch.tensor([[[0.6, 0.8], [0.6, -0.8]], [[0.0, 1.0], [0.0, 1.0]]]))
    view2 = PointSet(torch.tensor([[[0.0, 1.0]], [[1.0, 0.0]]]))
    ctx = LossContext(features=(view1, view2))
    logits = Logits.symmetric(torch.zeros(2, 2))
    out = AlignUniform()(logits, torch.arange(2), ctx)
    assert float(out.metrics["align"]) == pytest.approx(2.0)
    assert float(out.metrics["unif"]) == pytest.approx(-4.0)
    assert out.loss.item() == pytest.approx(-2.0)
    assert AlignUniform(alpha=1.0)(logits, torch.arange(2), ctx).loss.item() == pytest.approx(
        math.sqrt(2) - 4
    )
    weighted = AlignUniform(align_weight=0.5, uniform_weight=2.0)(logits, torch.arange(2), ctx)
    assert weighted.loss.item() == pytest.approx(-7.0)


# --------------------------------------------------------------------------- naive loop references


META4 = {"age": [20.0, 23.0, 21.0, 30.0], "sex": ["F", "M", "F", "F"], "label": [0, 1, 0, 0]}
AGE_SEX = [{"key": "age", "type": "rbf", "sigma": 2.0}, {"key": "sex", "type": "delta"}]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("normalisation", ["rows", "code"])
def test_yaware_matches_naive_loops(seed, normalisation):
    z1, z2 = unit_views(4, 5, seed)
    logits, ctx = two_view_batch(z1, z2, META4)
    fast = YAwareInfoNCE(AGE_SEX, normalisation)(logits, torch.arange(4), ctx).loss
    naive = naive_yaware(z1, z2, rbf_age_sex(META4["age"], META4["sex"], 2.0), normalisation)
    torch.testing.assert_close(fast, naive)
    for fast_grad, naive_grad in zip(grads(fast, z1, z2), grads(naive, z1, z2), strict=True):
        torch.testing.assert_close(fast_grad, naive_grad)


@pytest.mark.parametrize("seed", [0, 1])
def test_cond_align_unif_matches_naive_loops(seed):
    z1, z2 = unit_views(4, 5, seed)
    logits, ctx = two_view_batch(z1, z2, META4)
    out = ConditionalAlignUniform(AGE_SEX, lam=0.7)(logits, torch.arange(4), ctx)
    naive, align, unif = naive_cond_align_unif(z1, z2, rbf_age_sex(META4["age"], META4["sex"], 2.0), 0.7)
    torch.testing.assert_close(out.loss, naive)
    assert float(out.metrics["align"]) == pytest.approx(align.item())
    assert float(out.metrics["unif"]) == pytest.approx(unif.item())
    for fast_grad, naive_grad in zip(grads(out.loss, z1, z2), grads(naive, z1, z2), strict=True):
        torch.testing.assert_close(fast_grad, naive_grad)


@pytest.mark.parametrize("seed", [0, 1])
def test_supcon_matches_khosla_loops(seed):
    z1, z2 = unit_views(4, 5, seed)
    logits, ctx = two_view_batch(z1, z2, META4)
    fast = SupConLoss(base_temperature=0.1, temperature=0.07)(logits, torch.arange(4), ctx).loss
    naive = naive_supcon(z1, z2, META4["label"], 0.07 / 0.1)
    torch.testing.assert_close(fast, naive)
    for fast_grad, naive_grad in zip(grads(fast, z1, z2), grads(naive, z1, z2), strict=True):
        torch.testing.assert_close(fast_grad, naive_grad)


@pytest.mark.parametrize("alpha", [2.0, 1.5])
def test_align_uniform_matches_naive_loops(alpha):
    generator = torch.Generator().manual_seed(3)
    sets = [torch.randn(5, 3, 4, generator=generator, dtype=torch.float64) for _ in range(2)]
    weights = [torch.rand(5, 3, generator=generator, dtype=torch.float64) + 0.1 for _ in range(2)]
    leaves = [s.clone().requires_grad_() for s in sets]
    ctx = LossContext(features=tuple(PointSet(p, w) for p, w in zip(leaves, weights, strict=True)))
    fast = AlignUniform(alpha=alpha, t=1.5, align_weight=0.3, uniform_weight=1.7)(
        Logits.symmetric(torch.zeros(5, 5)), torch.arange(5), ctx
    ).loss
    pooled = [naive_pool(p, w) for p, w in zip(leaves, weights, strict=True)]
    naive = naive_align_uniform(*pooled, alpha=alpha, t=1.5, align_weight=0.3, uniform_weight=1.7)
    torch.testing.assert_close(fast, naive)
    for fast_grad, naive_grad in zip(grads(fast, *leaves), grads(naive, *leaves), strict=True):
        torch.testing.assert_close(fast_grad, naive_grad)


def test_self_similarities_get_no_gradient():
    """The diagonals of in_modal (a view against itself) are never candidates."""
    z1, z2 = unit_views(3, 4, 0)
    in_i = (z1 @ z1.t() / TAU).detach().requires_grad_()
    in_t = (z2 @ z2.t() / TAU).detach().requires_grad_()
    ctx = LossContext(in_modal=Logits(i2t=in_i, t2i=in_t), meta={"age": [1.0, 2.0, 4.0]})
    logits = Logits.symmetric((z1 @ z2.t() / TAU).detach())
    for loss in (YAwareInfoNCE([{"key": "age", "type": "rbf", "sigma": 1.0}]), ConditionalAlignUniform()):
        in_i.grad = in_t.grad = None
        loss(logits, torch.arange(3), ctx).loss.backward()
        assert (
            torch.count_nonzero(in_i.grad.diagonal()) == 0 and torch.count_nonzero(in_t.grad.diagonal()) == 0
        )
        assert torch.count_nonzero(in_i.grad) > 0


# --------------------------------------------------------------------------- METHODS identities


def test_simclr_is_classical_nt_xent_and_same_sample_yaware():
    z1, z2 = unit_views(5, 6, 4)
    logits, ctx = two_view_batch(z1, z2, {"id": [f"s{i}" for i in range(5)], "age": [1.0, 2, 3, 4, 5]})
    simclr = SimCLRLoss()(logits, torch.arange(5), ctx).loss
    torch.testing.assert_close(simclr, nt_xent(logits, ctx))
    # w = δ(same sample) through meta: a delta kernel on unique ids, and the string spec.
    unique = YAwareInfoNCE([{"key": "id", "type": "delta"}])(logits, torch.arange(5), ctx).loss
    torch.testing.assert_close(unique, simclr, rtol=0, atol=0)
    same = YAwareInfoNCE("same_sample")(logits, torch.arange(5), ctx).loss
    torch.testing.assert_close(same, simclr, rtol=0, atol=0)
    # σ → 0 on distinct continuous values: every cross-sample weight underflows to 0.
    tiny = YAwareInfoNCE([{"key": "age", "type": "rbf", "sigma": 1e-6}])(logits, torch.arange(5), ctx).loss
    torch.testing.assert_close(tiny, simclr, rtol=0, atol=0)


def test_supcon_is_yaware_with_delta_kernel_and_small_sigma():
    z1, z2 = unit_views(6, 4, 5)
    meta = {"label": [2, 0, 2, 1, 0, 2]}
    logits, ctx = two_view_batch(z1, z2, meta)
    supcon = SupConLoss()(logits, torch.arange(6), ctx).loss
    delta = YAwareInfoNCE([{"key": "label", "type": "delta"}])(logits, torch.arange(6), ctx).loss
    torch.testing.assert_close(delta, supcon, rtol=0, atol=0)
    # METHODS §5: with σ → 0 and categorical y (integer codes) y-Aware is SupCon.
    small = YAwareInfoNCE([{"key": "label", "type": "rbf", "sigma": 1e-6}])(logits, torch.arange(6), ctx).loss
    torch.testing.assert_close(small, supcon, rtol=0, atol=0)
    # τ/base_τ = 1 leaves it unchanged; τ/base_τ = 0.5 halves it.
    unit = SupConLoss(base_temperature=0.07, temperature=0.07)(logits, torch.arange(6), ctx).loss
    torch.testing.assert_close(unit, supcon)
    half = SupConLoss(base_temperature=0.2, temperature=0.1)(logits, torch.arange(6), ctx).loss
    torch.testing.assert_close(half, supcon / 2)
    # ... and differs from SimCLR when labels repeat.
    assert not torch.isclose(supcon, SimCLRLoss()(logits, torch.arange(6), ctx).loss)


@pytest.mark.parametrize(
    "labels", [[0, 1, 0, 1], [0, 0, 1, 1, 2, 2], [3, 3, 3, 3], [0, 0, 0, 1], ["a", "b", "b"]]
)
def test_code_normalisation_is_twice_rows_for_categorical_labels(labels):
    """§11: with balanced categorical labels every row (= column) sum is equal, so the code's column
    normalisation matches the paper's and only its sum/N (= 2 × mean over 2N) differs. It holds more
    widely: with a delta kernel w_ik > 0 only inside a class, whose views share one row sum, so
    unbalanced labels ([0, 0, 0, 1], ["a", "b", "b"]) give 2 × rows too."""
    n = len(labels)
    z1, z2 = unit_views(n, 4, 6)
    logits, ctx = two_view_batch(z1, z2, {"label": labels})
    kernel = [{"key": "label", "type": "delta"}]
    rows = YAwareInfoNCE(kernel, "rows")(logits, torch.arange(n), ctx).loss
    code = YAwareInfoNCE(kernel, "code")(logits, torch.arange(n), ctx).loss
    torch.testing.assert_close(code, 2 * rows)


@pytest.mark.parametrize(
    "kernel",
    [
        [{"key": "age", "type": "rbf", "sigma": 2.0}],
        [{"key": "age", "type": "rbf", "sigma": 4.0}, {"key": "label", "type": "delta"}],
    ],
)
def test_code_normalisation_differs_for_continuous_meta(kernel):
    """Continuous y with unequal row sums between weighted pairs: code ≠ 2 × rows (the naive loop
    test above checks the code variant's exact value)."""
    z1, z2 = unit_views(4, 4, 7)
    logits, ctx = two_view_batch(z1, z2, {"age": [20.0, 21.0, 23.0, 30.0], "label": [0, 0, 0, 1]})
    rows = YAwareInfoNCE(kernel, "rows")(logits, torch.arange(4), ctx).loss
    code = YAwareInfoNCE(kernel, "code")(logits, torch.arange(4), ctx).loss
    assert abs(code.item() - 2 * rows.item()) > 1e-3


# --------------------------------------------------------------------------- kernels


def test_rbf_kernel_by_hand():
    """Ages 20, 25, 30 with σ = 5: Δ = 5 → e^{−25/50} = e^{−1/2}, Δ = 10 → e^{−100/50} = e^{−2}."""
    kernel = meta_kernel({"age": [20, 25, 30]}, [{"key": "age", "type": "rbf", "sigma": 5.0}])
    h, q = math.exp(-0.5), math.exp(-2)
    expected = torch.tensor([[1, h, q], [h, 1, h], [q, h, 1]], dtype=torch.float64)
    torch.testing.assert_close(kernel, expected)
    # Vectors: ‖(3, 4) − (0, 0)‖² = 25 → e^{−1/2}; a tensor [N, p] works the same.
    vector = meta_kernel({"y": [[0.0, 0.0], [3.0, 4.0]]}, [{"key": "y", "type": "rbf", "sigma": 5}])
    torch.testing.assert_close(vector, torch.tensor([[1, h], [h, 1]], dtype=torch.float64))
    as_tensor = meta_kernel(
        {"y": torch.tensor([[0.0, 0.0], [3.0, 4.0]])}, [{"key": "y", "type": "rbf", "sigma": 5}]
    )
    torch.testing.assert_close(as_tensor, vector)


def test_product_kernel_and_delta_on_strings():
    """w = rbf(age)·δ(sex): the M sample is 0 against both F samples; F–F keeps e^{−2}."""
    meta = {"age": [20.0, 25.0, 30.0], "sex": ["F", "M", "F"]}
    kernel = meta_kernel(meta, [{"key": "age", "type": "rbf", "sigma": 5.0}, {"key": "sex", "type": "delta"}])
    q = math.exp(-2)
    torch.testing.assert_close(kernel, torch.tensor([[1, 0, q], [0, 1, 0], [q, 0, 1]], dtype=torch.float64))
    delta = meta_kernel({"c": torch.tensor([[1, 2], [1, 2], [2, 1]])}, [{"key": "c", "type": "delta"}])
    torch.testing.assert_close(delta, torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.float64))
    torch.testing.assert_close(meta_kernel({}, "same_sample", size=3), torch.eye(3, dtype=torch.float64))


def test_view_weights_tile_the_sample_kernel():
    """Views v and v + N share y (w = 1); the diagonal (self-pairs) is zeroed."""
    weights = view_weights(torch.tensor([[1.0, 0.25], [0.25, 1.0]]))
    expected = torch.tensor([[0, 0.25, 1, 0.25], [0.25, 0, 0.25, 1], [1, 0.25, 0, 0.25], [0.25, 1, 0.25, 0]])
    torch.testing.assert_close(weights, expected)


def test_meta_errors_name_the_key():
    spec = [{"key": "age", "type": "rbf", "sigma": 5.0}, {"key": "sex", "type": "delta"}]
    with pytest.raises(ValueError, match="'sex'.*missing"):
        meta_kernel({"age": [1.0, 2.0]}, spec)
    with pytest.raises(ValueError, match="'age'"):
        meta_kernel({"age": ["old", "young"], "sex": ["F", "M"]}, spec)
    with pytest.raises(ValueError, match="'age'"):
        meta_kernel({"age": [1.0, float("nan")], "sex": ["F", "M"]}, spec)
    with pytest.raises(ValueError, match="'age'.*3 values"):
        meta_kernel({"age": [1.0, 2.0, 3.0], "sex": ["F", "M"]}, spec, size=2)
    with pytest.raises(ValueError, match="'sex'"):
        meta_kernel({"age": [1.0, 2.0], "sex": [["F"], {"M": 1}]}, spec)
    # ... and through a loss, from the missing meta field.
    z1, z2 = unit_views(2, 3, 0)
    logits, ctx = two_view_batch(z1, z2, {"label": [0, 1]})
    with pytest.raises(ValueError, match="'age'"):
        YAwareInfoNCE()(logits, torch.arange(2), ctx)


# --------------------------------------------------------------------------- contracts and arguments


def test_contracts_and_requires():
    for loss in (
        YAwareInfoNCE(),
        YAwareInfoNCE(normalisation="code"),
        YAwareInfoNCE([{"key": "label", "type": "delta"}, {"key": "age", "type": "rbf", "sigma": 3.0}]),
        ConditionalAlignUniform(),
        ConditionalAlignUniform([{"key": "label", "type": "delta"}], lam=2.0),
        SimCLRLoss(),
        SupConLoss(),
        SupConLoss(base_temperature=0.1),
        AlignUniform(),
    ):
        out = check_loss(loss)
        assert out.loss.dtype == torch.float32
    assert YAwareInfoNCE().requires == frozenset({"in_modal", "meta"})
    assert ConditionalAlignUniform().requires == frozenset({"in_modal", "meta"})
    assert SupConLoss().requires == frozenset({"in_modal", "meta"})
    assert SimCLRLoss.requires == SimCLRLoss().requires == frozenset({"in_modal"})
    assert YAwareInfoNCE("same_sample").requires == frozenset({"in_modal"})
    assert AlignUniform.requires == frozenset({"features"})


def test_rejects_a_local_slice():
    z1, z2 = unit_views(4, 3, 0)
    logits = Logits.symmetric(z1[:2] @ z2.t())
    ctx = LossContext(in_modal=Logits(i2t=z1 @ z1.t(), t2i=z2 @ z2.t()), meta={"age": [1.0] * 4})
    with pytest.raises(ValueError, match="full batch"):
        YAwareInfoNCE()(logits, torch.arange(2), ctx)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ConditionalAlignUniform(lam=-0.1), "lam"),
        (lambda: ConditionalAlignUniform(eps=0.0), "eps"),
        (lambda: AlignUniform(alpha=0.0), "alpha"),
        (lambda: AlignUniform(t=-1.0), "t must"),
        (lambda: AlignUniform(uniform_weight=-1.0), "uniform_weight"),
        (
            lambda: YAwareInfoNCE([{"key": "age", "type": "gauss", "sigma": 1.0}]),
            "unknown kernel type 'gauss'",
        ),
        (lambda: YAwareInfoNCE(normalisation="cols"), "normalisation 'cols'"),
        (lambda: YAwareInfoNCE([{"key": "age", "type": "rbf"}]), "sigma"),
        (lambda: YAwareInfoNCE([{"key": "age", "type": "rbf", "sigma": 0.0}]), "sigma"),
        (lambda: YAwareInfoNCE([{"key": "age", "type": "delta", "sigma": 1.0}]), "no sigma"),
        (lambda: YAwareInfoNCE([{"key": "age", "type": "delta", "scale": 1}]), "scale"),
        (lambda: YAwareInfoNCE([{"type": "delta"}]), "key"),
        (lambda: YAwareInfoNCE([]), "non-empty"),
        (lambda: YAwareInfoNCE("simclr"), "same_sample"),
        (lambda: SupConLoss(label_key=""), "label_key"),
        (lambda: SupConLoss(temperature=0.0), "temperature"),
        (lambda: SupConLoss(base_temperature=-0.07), "base_temperature"),
    ],
)
def test_bad_arguments(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_align_uniform_needs_two_samples():
    one = PointSet(torch.nn.functional.normalize(torch.ones(1, 1, 3), dim=-1))
    with pytest.raises(ValueError, match="N >= 2"):
        AlignUniform()(Logits.symmetric(torch.zeros(1, 1)), torch.arange(1), LossContext(features=(one, one)))
