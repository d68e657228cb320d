"""CLOOB (METHODS §4, §11): `hopfield` retrieval logits, `infoloob` and `cloob` losses.

Each piece is checked against a hand-derived case, a naive loop reference (forward and
backward, float64), the §4 identities (positive left out, β limits, two stores) and the
clipkit contract checks.
"""

import math

import pytest
import torch

from clipkit.contract.testing import check_loss, check_similarity, random_points
from clipkit.contract.types import Logits, LossContext, PointSet
from clipkit.plugins.losses.cloob import CLOOBLoss, InfoLOOB, info_loob
from clipkit.plugins.similarities.hopfield import HopfieldSimilarity

# ---------------------------------------------------------------------------------------------
# naive references (explicit loops over i, j, k)


def naive_info_loob(logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """mean_i [ −L[i, t_i] + log Σ_{j ≠ t_i} exp L[i, j] ], as loops."""
    rows = []
    for i in range(logits.shape[0]):
        negatives = sum(torch.exp(logits[i, j]) for j in range(logits.shape[1]) if j != targets[i])
        rows.append(-logits[i, targets[i]] + torch.log(negatives))
    return sum(rows) / len(rows)


def naive_pooled_unit(x: PointSet) -> list[torch.Tensor]:
    """Per set: Σ_m w_m p_m / Σ_m w_m, divided by its norm (uniform weights when None)."""
    out = []
    for b in range(x.batch_size):
        weights = [x.weights[b, m] if x.weights is not None else 1.0 for m in range(x.num_points)]
        total = sum(weights)
        mean = sum(weights[m] * x.points[b, m] for m in range(x.num_points)) / total
        out.append(mean / torch.sqrt(sum(v * v for v in mean)))
    return out


def naive_retrieve(queries: list[torch.Tensor], stored: list[torch.Tensor], beta: float) -> list:
    """H(β, Q, S)_i = Σ_k softmax_k(β S_k·Q_i) S_k, re-normalised, written with explicit sums."""
    out = []
    for q in queries:
        energies = [torch.exp(beta * torch.dot(s, q)) for s in stored]
        partition = sum(energies)
        retrieved = sum((energies[k] / partition) * stored[k] for k in range(len(stored)))
        out.append(retrieved / torch.sqrt(torch.dot(retrieved, retrieved)))
    return out


def naive_hopfield_logits(a: PointSet, b: PointSet, beta: float, scale: float):
    x, y = naive_pooled_unit(a), naive_pooled_unit(b)
    u_x, u_y = naive_retrieve(x, x, beta), naive_retrieve(y, x, beta)
    v_x, v_y = naive_retrieve(x, y, beta), naive_retrieve(y, y, beta)
    n = len(x)
    i2t = torch.stack([torch.stack([scale * torch.dot(u_x[i], u_y[j]) for j in range(n)]) for i in range(n)])
    t2i = torch.stack([torch.stack([scale * torch.dot(v_y[i], v_x[j]) for j in range(n)]) for i in range(n)])
    return i2t, t2i


def official_style_cloob(x: torch.Tensor, y: torch.Tensor, beta: float, inverse_tau: float) -> torch.Tensor:
    """The §11 description of the official code, written independently: retrieve with
    column-vector softmax, then ``infoLOOB`` = τ·(pos + neg) with a −10000 mask, image +
    text terms summed."""
    tau = 1.0 / inverse_tau

    def hopfield(state, stored):
        retrieved = stored.t() @ torch.softmax(beta * stored @ state.t(), dim=0)  # [d, Nq]
        return (retrieved / retrieved.norm(dim=0, keepdim=True)).t()

    def loob(anchors, samples):
        k = anchors @ samples.t() / tau
        eye = torch.eye(k.shape[0], dtype=k.dtype)
        positives = -torch.mean(torch.sum(k * eye, dim=1))
        negatives = torch.mean(torch.logsumexp(k * (1 - eye) + eye * -10000.0, dim=1))
        return tau * (positives + negatives)

    p_xx, p_yy = hopfield(x, x), hopfield(y, y)
    p_xy, p_yx = hopfield(y, x), hopfield(x, y)  # texts from the image store, images from the text store
    return loob(p_xx, p_xy) + loob(p_yy, p_yx)


def random_pair(n: int, points: int, dim: int, seed: int, weighted: bool = True):
    generator = torch.Generator().manual_seed(seed)

    def one():
        values = torch.nn.functional.normalize(
            torch.randn(n, points, dim, generator=generator, dtype=torch.float64), dim=-1
        )
        weights = torch.rand(n, points, generator=generator, dtype=torch.float64) + 0.1 if weighted else None
        return PointSet(values.requires_grad_(), weights)

    return one(), one()


def unit(rows) -> PointSet:
    return PointSet(torch.tensor(rows, dtype=torch.float64).unsqueeze(1))


# ---------------------------------------------------------------------------------------------
# InfoLOOB and CLOOB losses

HAND = [[2.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 3.0]]


def test_info_loob_hand_derived_3x3():
    """Rows of L (positive on the diagonal, left out of the lse):
    row 0: −2 + log(e⁰ + e¹) = −2 + log(1 + e) ≈ −0.686738
    row 1: −1 + log(e⁰ + e⁰) = −1 + log 2     ≈ −0.306853
    row 2: −3 + log(e¹ + e¹) = −2 + log 2     ≈ −1.306853   -> i2t term ≈ −0.766815
    t2i = Lᵀ, rows = columns of L:
    col 0: −2 + log(1 + e)                    ≈ −0.686738
    col 1: −1 + log(e⁰ + e¹) = −1 + log(1 + e) ≈ 0.313262
    col 2: −3 + log(e¹ + e⁰) = −3 + log(1 + e) ≈ −1.686738  -> t2i term ≈ −0.686738
    infoloob = ½ (−0.766815 − 0.686738) ≈ −0.726776; cloob (1/τ = 30) = (−1.453553)/30 ≈ −0.048452.
    """
    i2t = torch.tensor(HAND)
    logits, targets = Logits.symmetric(i2t), torch.arange(3)
    log1pe, log2 = math.log(1 + math.e), math.log(2)
    expected_i2t = ((-2 + log1pe) + (-1 + log2) + (-2 + log2)) / 3
    expected_t2i = ((-2 + log1pe) + (-1 + log1pe) + (-3 + log1pe)) / 3
    assert expected_i2t == pytest.approx(-0.766815, abs=1e-6)
    assert expected_t2i == pytest.approx(-0.686738, abs=1e-6)
    out = InfoLOOB()(logits, targets, LossContext())
    assert float(out.metrics["loss_i2t"]) == pytest.approx(expected_i2t, abs=1e-6)
    assert float(out.metrics["loss_t2i"]) == pytest.approx(expected_t2i, abs=1e-6)
    assert out.loss.item() == pytest.approx(-0.726776, abs=1e-6)
    assert float(out.metrics["acc_i2t"]) == 1.0  # every row's largest logit is its diagonal
    cloob = CLOOBLoss(inverse_tau=30.0)(logits, targets, LossContext())
    assert cloob.loss.item() == pytest.approx(-0.048452, abs=1e-6)


def test_info_loob_two_pairs_is_negative_margin():
    # Each row: −2 + log(e⁰) = −2 (the lone negative's lse is its logit); InfoNCE would give +0.127.
    out = InfoLOOB()(Logits.symmetric(torch.tensor([[2.0, 0.0], [0.0, 2.0]])), torch.arange(2), LossContext())
    assert out.loss.item() == pytest.approx(-2.0, abs=1e-6)


@pytest.mark.parametrize("delta", [0.5, 5.0, 50.0])
def test_positive_is_excluded_so_loss_is_linear_in_the_diagonal(delta):
    """InfoLOOB: raising L_ii by Δ changes that direction's term by exactly −Δ/N (slope −1/N,
    the lse does not contain L_ii). InfoNCE's change is −(log-softmax change)/N, not linear."""
    n, i = 5, 2
    base = torch.randn(n, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    targets = torch.arange(n)
    bumped = base.clone()
    bumped[i, i] += delta
    before = InfoLOOB()(Logits(i2t=base, t2i=base.t().clone()), targets, LossContext())
    after = InfoLOOB()(Logits(i2t=bumped, t2i=base.t().clone()), targets, LossContext())
    change = float(after.metrics["loss_i2t"] - before.metrics["loss_i2t"])
    assert change == pytest.approx(-delta / n, abs=1e-12)
    assert float(after.metrics["loss_t2i"]) == float(before.metrics["loss_t2i"])  # other store untouched
    assert float(after.loss - before.loss) == pytest.approx(-delta / (2 * n), abs=1e-12)

    infonce_change = float(
        torch.nn.functional.cross_entropy(bumped, targets) - torch.nn.functional.cross_entropy(base, targets)
    )
    assert abs(infonce_change - (-delta / n)) > 1e-3  # the positive sits in InfoNCE's denominator

    leaf = base.clone().requires_grad_()
    info_loob(leaf, targets).backward()
    torch.testing.assert_close(leaf.grad.diagonal(), torch.full((n,), -1.0 / n, dtype=torch.float64))
    nce_leaf = base.clone().requires_grad_()
    torch.nn.functional.cross_entropy(nce_leaf, targets).backward()
    assert (nce_leaf.grad.diagonal() > -1.0 / n + 1e-6).all()  # −(1 − p_ii)/N: saturates


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_info_loob_matches_naive_reference_forward_and_backward(seed):
    generator = torch.Generator().manual_seed(seed)
    n = 6
    i2t = torch.randn(n, n, generator=generator, dtype=torch.float64) * 3
    t2i = torch.randn(n, n, generator=generator, dtype=torch.float64) * 3  # a separate store, as CLOOB's
    targets = torch.randperm(n, generator=generator)  # positives off the diagonal too
    fast_inputs = [i2t.clone().requires_grad_(), t2i.clone().requires_grad_()]
    naive_inputs = [i2t.clone().requires_grad_(), t2i.clone().requires_grad_()]
    fast = InfoLOOB()(Logits(*fast_inputs), targets, LossContext()).loss
    naive = (
        naive_info_loob(naive_inputs[0], targets.tolist())
        + naive_info_loob(naive_inputs[1], targets.tolist())
    ) / 2
    torch.testing.assert_close(fast, naive)
    fast.backward()
    naive.backward()
    for fast_input, naive_input in zip(fast_inputs, naive_inputs, strict=True):
        torch.testing.assert_close(fast_input.grad, naive_input.grad)


def test_info_loob_rectangular_rows_with_offset_targets():
    # A rank's local rows [3, 6] whose positives are columns 3..5 of the global batch.
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    targets = torch.tensor([3, 4, 5])
    torch.testing.assert_close(info_loob(logits, targets), naive_info_loob(logits, [3, 4, 5]))


@pytest.mark.parametrize("inverse_tau", [30.0, 14.3])
def test_cloob_is_tau_times_the_sum_of_both_directions(inverse_tau):
    generator = torch.Generator().manual_seed(5)
    i2t = torch.randn(5, 5, generator=generator, dtype=torch.float64) * 4
    t2i = torch.randn(5, 5, generator=generator, dtype=torch.float64) * 4
    targets = torch.arange(5)
    out = CLOOBLoss(inverse_tau=inverse_tau)(Logits(i2t, t2i), targets, LossContext())
    expected = (naive_info_loob(i2t, targets.tolist()) + naive_info_loob(t2i, targets.tolist())) / inverse_tau
    torch.testing.assert_close(out.loss, expected)
    # = 2τ · the symmetric (halved) InfoLOOB.
    halved = InfoLOOB()(Logits(i2t, t2i), targets, LossContext()).loss
    torch.testing.assert_close(out.loss, 2 * halved / inverse_tau)


def test_hopfield_plus_cloob_matches_the_official_formula():
    a, b = random_pair(6, 1, 8, seed=6, weighted=False)
    similarity = HopfieldSimilarity(beta=8.0, inverse_tau=30.0)
    ours = CLOOBLoss(inverse_tau=30.0)(similarity(a, b), torch.arange(6), LossContext()).loss
    reference = official_style_cloob(a.points[:, 0], b.points[:, 0], beta=8.0, inverse_tau=30.0)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# hopfield similarity


def test_hopfield_hand_derived_two_orthogonal_pairs():
    """X = Y = [e1, e2], β = log 3: softmax_k(β X_k·X_1) = (e^β, 1)/(e^β + 1) = (3/4, 1/4), so
    U_x[0] = (3, 1)/√10, U_x[1] = (1, 3)/√10 and U_y = U_x. With 1/τ = 10:
    i2t = 10·[[(9+1)/10, (3+3)/10], [(3+3)/10, (1+9)/10]] = [[10, 6], [6, 10]]."""
    points = unit([[1.0, 0.0], [0.0, 1.0]])
    similarity = HopfieldSimilarity(beta=math.log(3), inverse_tau=10.0)
    u_x, u_y, v_x, v_y = similarity.retrieve(points, points)
    expected = torch.tensor([[3.0, 1.0], [1.0, 3.0]], dtype=torch.float64) / math.sqrt(10)
    for retrieved in (u_x, u_y, v_x, v_y):
        torch.testing.assert_close(retrieved, expected)
    logits = similarity(points, points)
    target = torch.tensor([[10.0, 6.0], [6.0, 10.0]], dtype=torch.float64)
    torch.testing.assert_close(logits.i2t, target, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.t2i, target, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_hopfield_matches_naive_loops_forward_and_backward(seed):
    a, b = random_pair(4, 3, 5, seed=seed)
    a2, b2 = (PointSet(x.points.detach().clone().requires_grad_(), x.weights) for x in (a, b))
    similarity = HopfieldSimilarity(beta=3.0, inverse_tau=7.0)
    fast = similarity(a, b)
    naive_i2t, naive_t2i = naive_hopfield_logits(a2, b2, beta=3.0, scale=similarity.scale().item())
    torch.testing.assert_close(fast.i2t, naive_i2t)
    torch.testing.assert_close(fast.t2i, naive_t2i)
    weights = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (fast.i2t * weights[0] + fast.t2i * weights[1]).sum().backward()
    (naive_i2t * weights[0] + naive_t2i * weights[1]).sum().backward()
    torch.testing.assert_close(a.points.grad, a2.points.grad)
    torch.testing.assert_close(b.points.grad, b2.points.grad)


def test_beta_to_zero_retrieves_the_normalised_mean_of_the_store():
    a, b = random_pair(5, 1, 6, seed=7, weighted=False)
    u_x, u_y, v_x, v_y = HopfieldSimilarity(beta=1e-6).retrieve(a, b)
    with torch.no_grad():
        image_mean = torch.nn.functional.normalize(a.points[:, 0].mean(0), dim=0).expand(5, -1)
        text_mean = torch.nn.functional.normalize(b.points[:, 0].mean(0), dim=0).expand(5, -1)
    for retrieved, store_mean in ((u_x, image_mean), (u_y, image_mean), (v_x, text_mean), (v_y, text_mean)):
        torch.testing.assert_close(retrieved.detach(), store_mean, atol=1e-5, rtol=0)
    assert not torch.allclose(image_mean, text_mean, atol=1e-2)  # the limit is store-specific


def test_beta_to_infinity_retrieves_the_nearest_stored_pattern():
    generator = torch.Generator().manual_seed(8)
    basis, _ = torch.linalg.qr(torch.randn(16, 16, generator=generator, dtype=torch.float64))
    x = basis[:4]  # orthonormal images: X_i·X_i = 1 beats X_k·X_i = 0 by a margin of 1
    noise = 0.05 * torch.randn(4, 16, generator=generator, dtype=torch.float64)
    y = torch.nn.functional.normalize(x + noise, dim=-1)  # texts near their own image

    def margin(cosines):  # min over rows of (diagonal − largest off-diagonal entry)
        off_diagonal = cosines - 10 * torch.eye(4, dtype=torch.float64)
        return (cosines.diagonal() - off_diagonal.max(dim=1).values).min()

    # Y_i's nearest image is X_i and X_i's nearest text is Y_i, by a wide margin; Y is well spread.
    assert min(margin(y @ x.t()), margin(x @ y.t()), margin(y @ y.t())) > 0.5
    similarity = HopfieldSimilarity(beta=500.0, inverse_tau=30.0)
    u_x, u_y, v_x, v_y = similarity.retrieve(PointSet(x.unsqueeze(1)), PointSet(y.unsqueeze(1)))
    torch.testing.assert_close(u_x, x)  # each image retrieves itself from the image store
    torch.testing.assert_close(u_y, x)  # each text retrieves its nearest image
    torch.testing.assert_close(v_x, y)
    torch.testing.assert_close(v_y, y)


def test_t2i_is_not_the_transpose_of_i2t_in_training():
    a, b = random_pair(6, 2, 8, seed=10)
    similarity = HopfieldSimilarity(beta=8.0)
    assert similarity.training
    logits = similarity(a, b)
    assert not torch.allclose(logits.t2i, logits.i2t.t(), atol=1e-3)
    u_x, u_y, v_x, v_y = similarity.retrieve(a, b)
    torch.testing.assert_close(logits.i2t, 30.0 * u_x @ u_y.t())
    torch.testing.assert_close(logits.t2i, 30.0 * v_y @ v_x.t())


def test_eval_mode_is_the_plain_scaled_cosine_and_handles_unequal_batches():
    images = random_points(5, 3, 8, weighted=True, seed=11)
    prompts = random_points(3, 2, 8, seed=12)
    similarity = HopfieldSimilarity(beta=8.0, inverse_tau=30.0).eval()
    logits = similarity(images, prompts)
    with torch.no_grad():
        x = torch.nn.functional.normalize(images.mean(), dim=-1)
        y = torch.nn.functional.normalize(prompts.mean(), dim=-1)
    torch.testing.assert_close(logits.i2t, 30.0 * x @ y.t())
    torch.testing.assert_close(logits.t2i, logits.i2t.t())
    # Paired batches in eval mode are plain cosine too (retrieval is a training-time device).
    paired = similarity(images, images)
    torch.testing.assert_close(paired.i2t, 30.0 * x @ x.t())


def test_train_mode_unequal_batches_warn_and_fall_back_to_cosine():
    images, prompts = random_points(5, 1, 8, seed=13), random_points(3, 1, 8, seed=14)
    similarity = HopfieldSimilarity()
    with pytest.warns(UserWarning, match="Na=5 != Nb=3"):
        logits = similarity(images, prompts)
    torch.testing.assert_close(logits.i2t, similarity.eval()(images, prompts).i2t)


def test_train_mode_shapes_and_gradients_with_a_paired_batch():
    a, b = random_points(6, 3, 8, weighted=True, seed=15), random_points(6, 4, 8, seed=16)
    similarity = HopfieldSimilarity(learn_scale=True)
    logits = similarity(a, b)
    assert tuple(logits.i2t.shape) == (6, 6) and tuple(logits.t2i.shape) == (6, 6)
    assert torch.isfinite(logits.i2t).all() and torch.isfinite(logits.t2i).all()
    out = CLOOBLoss()(logits, torch.arange(6), LossContext())
    out.loss.backward()
    for grad in (a.points.grad, b.points.grad, similarity.log_inverse_tau.grad):
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_scale_fixed_by_default_learnable_and_clamped_on_request():
    fixed = HopfieldSimilarity(inverse_tau=30.0)
    assert list(fixed.parameters()) == []
    assert "log_inverse_tau" in fixed.state_dict()
    assert fixed.scale().item() == pytest.approx(30.0, rel=1e-6)
    assert fixed.metrics() == {"logit_scale": pytest.approx(30.0, rel=1e-6)}
    learned = HopfieldSimilarity(inverse_tau=100.0, learn_scale=True)  # a start above 100 is refused
    assert learned.scale().item() == pytest.approx(100.0)
    points = unit([[1.0, 0.0], [0.0, 1.0]])
    logits = learned(points, points).i2t
    logits.sum().backward()
    # Started at the bound; there the gradient flows,
    # d(Σ logits)/d log(1/τ) = Σ logits (the parameter is clamped after each optimiser step, as CLIP's).
    assert learned.log_inverse_tau.grad.item() == pytest.approx(logits.sum().item(), rel=1e-5)
    assert learned.parameter_bounds() == {"log_inverse_tau": (None, pytest.approx(math.log(100.0)))}
    assert fixed.parameter_bounds() == {}


def test_ensemble_is_mean_of_unit_vectors_renormalised():
    prompts = PointSet(torch.tensor([[[2.0, 0.0]], [[0.0, 1.0]], [[0.6, 0.8]]]))
    ensembled = HopfieldSimilarity().ensemble(prompts, torch.tensor([0, 0, 1]))
    expected = torch.tensor([[1 / math.sqrt(2), 1 / math.sqrt(2)], [0.6, 0.8]])
    assert ensembled.points.shape == (2, 1, 2)
    torch.testing.assert_close(ensembled.points[:, 0], expected)


# ---------------------------------------------------------------------------------------------
# contracts and arguments


def test_contracts():
    check_loss(InfoLOOB())
    check_loss(CLOOBLoss())
    # check_similarity pairs 5 images with 4 texts, which only evaluation (plain cosine) serves.
    check_similarity(HopfieldSimilarity().eval())
    check_similarity(HopfieldSimilarity(beta=14.3, inverse_tau=14.3, learn_scale=True).eval(), weighted=True)


def test_bad_arguments():
    with pytest.raises(ValueError, match="beta"):
        HopfieldSimilarity(beta=-1.0)
    for bad in (0.0, -30.0):
        with pytest.raises(ValueError, match="inverse_tau"):
            HopfieldSimilarity(inverse_tau=bad)
        with pytest.raises(ValueError, match="inverse_tau"):
            CLOOBLoss(inverse_tau=bad)
    with pytest.raises(ValueError, match="Nb >= 2"):
        info_loob(torch.zeros(3, 1), torch.zeros(3, dtype=torch.long))
