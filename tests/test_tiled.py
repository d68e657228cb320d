"""The tiled path (clipkit.tiled, ``train.tiled``): exact against the full N×N path in float64 (loss,
metrics, gradients of points, weights and similarity parameters), odd N with ragged tiles, masks and
weights, the global and the local-loss forms; float32 within 1e-5 relative; the refusals; the recipe
keys. Multi-process and training-loop checks live in tests/test_tiled_training.py."""

from __future__ import annotations

import pytest
import torch

from clipkit.contract.testing import check_tiled, full_context, random_points
from clipkit.contract.types import LossOutput, PointSet
from clipkit.errors import ClipkitError
from clipkit.plugins.losses.baseline_losses import (
    CyCLIPLoss,
    DebiasedContrastiveLoss,
    DecoupledContrastiveLoss,
    SigLIPLoss,
)
from clipkit.plugins.losses.cloob import CLOOBLoss, InfoLOOB
from clipkit.plugins.losses.infonce import InfoNCE
from clipkit.plugins.losses.nuclr import NUCLRLoss, SogCLRLoss
from clipkit.plugins.losses.yaware import SimCLRLoss, SupConLoss, YAwareInfoNCE
from clipkit.plugins.similarities.dot import DotSimilarity
from clipkit.plugins.similarities.hopfield import HopfieldSimilarity
from clipkit.plugins.similarities.kme import KMESimilarity
from clipkit.plugins.similarities.wpse import CosineMeanSimilarity, WPSESimilarity
from clipkit.tiled import LogSumExp, RowSum
from clipkit.tiled.contract import tiled_global_loss
from clipkit.tiled.engine import run_sweep
from clipkit.tiled.settings import AUTO_ABOVE, Tiling, decide, deprecation_warning, errors, tiling_of


def dot(**kwargs):
    return DotSimilarity(init_scale=4.0, **kwargs)


LOSSES = {
    "infonce": InfoNCE,
    "infonce_smoothed": lambda: InfoNCE(label_smoothing=0.1),
    "siglip": SigLIPLoss,
    "infoloob": InfoLOOB,
    "cloob_loss": lambda: CLOOBLoss(inverse_tau=4.0),
    "dcl": DecoupledContrastiveLoss,
    "dclw": lambda: DecoupledContrastiveLoss(weighting_sigma=2.0),
    "debiased": lambda: DebiasedContrastiveLoss(tau_plus=0.1, temperature=0.25),
}
SIMILARITIES = {
    "dot": dot,
    "dot_bias": lambda: dot(bias=-2.0),
    "cosine_mean": lambda: CosineMeanSimilarity(init_scale=4.0),
    "wpse": lambda: WPSESimilarity(embed_dim=8, num_features=16, init_scale=4.0),
    "kme": lambda: KMESimilarity(init_gamma=4.0, implementation="blockwise"),
}


@pytest.mark.parametrize("similarity", sorted(SIMILARITIES))
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_tiled_equals_full_float64(loss, similarity):
    check_tiled(
        LOSSES[loss](), SIMILARITIES[similarity](), batch=13, tile_size=4, weighted=True, tolerance=1e-10
    )


@pytest.mark.parametrize("loss", ["infonce", "siglip", "infoloob", "dclw", "debiased"])
def test_local_loss_form_equals_full_rows(loss):
    """``train.distributed.local_loss``: this process's anchors (rows 5..10) against all candidates."""
    check_tiled(LOSSES[loss](), dot(bias=-1.0), batch=13, tile_size=3, local_rows=(5, 6), tolerance=1e-10)


def masked_pair(batch: int = 11, points: int = 4, dim: int = 8) -> tuple[PointSet, PointSet]:
    """Point sets with padding (mask False on trailing points) and signed 'count' weights (WPSE)."""
    generator = torch.Generator().manual_seed(3)
    sets = []
    for _ in range(2):
        values = torch.nn.functional.normalize(torch.randn(batch, points, dim, generator=generator), dim=-1)
        real = torch.arange(points) < torch.randint(1, points + 1, (batch, 1), generator=generator)
        weights = torch.randn(batch, points, generator=generator)
        sets.append(PointSet(values, weights, real, "count"))
    return sets[0], sets[1]


@pytest.mark.parametrize("loss", ["infonce", "dcl"])
def test_kme_with_masks(loss):
    a, b = masked_pair()
    a, b = (PointSet(x.points, x.weights.abs() + 0.1, x.mask, "sum") for x in (a, b))
    check_tiled(LOSSES[loss](), SIMILARITIES["kme"](), pair=(a, b), tile_size=4, tolerance=1e-10)


@pytest.mark.parametrize(("mx", "my"), [(4, 4), (3, 5), (197, 77), (1, 9)])
def test_kme_caps_the_tile_at_one_block_of_its_kernels(mx, my):
    """``largest_tile``: the largest square tile of sets the block-wise kernels score in one block."""
    from clipkit.plugins.similarities.kme import tile_shape

    def features(points: int) -> tuple:  # (points, no weights, no mask) of 4096 sets: shapes only
        return torch.zeros(4096, points, 4), torch.zeros(4096, 0), torch.zeros(4096, 0, dtype=torch.bool)

    side = KMESimilarity(implementation="blockwise").largest_tile(features(mx), features(my))
    assert tile_shape(side, side, mx, my, None) == (side, side)  # one block
    assert tile_shape(side + 1, side + 1, mx, my, None) != (side + 1, side + 1)  # the largest such


def test_kme_tile_cap_follows_block_size_and_skips_one_point_sets():
    one = (torch.zeros(9, 1, 4), torch.zeros(9, 0), torch.zeros(9, 0, dtype=torch.bool))
    four = (torch.zeros(9, 4, 4), torch.zeros(9, 0), torch.zeros(9, 0, dtype=torch.bool))
    assert KMESimilarity(implementation="blockwise").largest_tile(one, one) is None  # no recompute to spare
    assert KMESimilarity(block_size=3, implementation="blockwise").largest_tile(four, four) == 3


def test_kme_tiled_equals_full_where_the_cap_bites():
    """block_size 3 caps loss.tile_size 8 at 3: ragged engine tiles of one kernel block each."""
    similarity = KMESimilarity(init_gamma=4.0, block_size=3, implementation="blockwise")
    for loss in ("infonce", "siglip"):
        check_tiled(LOSSES[loss](), similarity, batch=13, tile_size=8, weighted=True, tolerance=1e-10)


def test_kme_score_pairs_is_the_diagonal_with_empty_sets_and_chunks(monkeypatch):
    """The positives (``score_pairs``) equal the diagonal of the full logits, value and gradient, with a
    set that has no real point (−inf, zero gradient) and chunks smaller than the batch."""
    from clipkit.plugins.similarities import kme

    monkeypatch.setattr(kme, "TILE_SCORES", 40)  # 40 // (4·4) = 2 rows per recomputed chunk
    a, b = masked_pair(batch=7)
    mask = a.mask.clone()
    mask[3] = False
    a = PointSet(a.points.double(), a.weights.abs().double() + 0.1, mask, "sum")
    b = PointSet(b.points.double(), b.weights.abs().double() + 0.1, b.mask, "sum")
    similarity = KMESimilarity(init_gamma=4.0, implementation="naive").double()
    values_of, grads = [], []
    for pairs in (True, False):
        leaves = [t.detach().requires_grad_() for t in (a.points, a.weights, b.points, b.weights)]
        pa, pb = PointSet(leaves[0], leaves[1], a.mask, "sum"), PointSet(leaves[2], leaves[3], b.mask, "sum")
        if pairs:
            values = similarity.score_pairs(similarity.tile_features(pa), similarity.tile_features(pb))
        else:
            values = similarity(pa, pb).i2t.diagonal()
        assert torch.isneginf(values[3]) and torch.isfinite(values[torch.arange(7) != 3]).all()
        values[torch.arange(7) != 3].sum().backward()
        values_of.append(values.detach())
        grads.append([t.grad for t in leaves])
    torch.testing.assert_close(*values_of, rtol=1e-12, atol=1e-12)
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_kme_tiled_scores_each_kernel_value_as_often_as_the_full_path(monkeypatch):
    """Forward once and once more in backward (the full path's recompute), not three times: a tile of
    one block keeps its exp-scores for the backward."""
    from clipkit.plugins.similarities import kme

    scored = []
    original = kme._tile_scores

    def counting(scaled_u, logw_u, v, logw_v, rows, cols, buffer):
        scores = original(scaled_u, logw_u, v, logw_v, rows, cols, buffer)
        scored.append(scores.numel())
        return scores

    monkeypatch.setattr(kme, "_tile_scores", counting)
    n, points = 40, 4
    a, b = (random_points(n, points, 8, weighted=True, seed=s) for s in (1, 2))
    counts = {}
    for tiled in (False, True):
        scored.clear()
        similarity = KMESimilarity(init_gamma=4.0, block_size=16, implementation="blockwise")
        if tiled:
            out = tiled_global_loss(
                InfoNCE(), similarity, a, b, full_context(n, frozenset(), a, b), tile_size=64
            )
        else:
            out = InfoNCE()(similarity(a, b), torch.arange(n), full_context(n, frozenset(), a, b))
        out.loss.backward()
        counts[tiled] = sum(scored)
    assert counts[False] == counts[True] == 2 * n * n * points * points


@pytest.mark.parametrize("loss", ["infonce", "siglip"])
def test_masks_and_signed_weights(loss):
    similarity = WPSESimilarity(embed_dim=8, kernel="imq", num_features=12, init_scale=3.0)
    check_tiled(LOSSES[loss](), similarity, pair=masked_pair(), tile_size=5, tolerance=1e-10)


def test_float32_within_relative_1e5():
    check_tiled(InfoNCE(), dot(), batch=67, tile_size=16, dim=32, tolerance=1e-5)
    check_tiled(SigLIPLoss(), dot(bias=-3.0), batch=67, tile_size=16, dim=32, tolerance=1e-5)


@pytest.mark.parametrize("tile_size", [1, 13, 64])
def test_degenerate_tiles(tile_size):
    """One-element tiles, one tile exactly the batch, one tile larger than the batch."""
    check_tiled(InfoNCE(), dot(), batch=13, tile_size=tile_size, tolerance=1e-10)


def test_online_lse_against_a_naive_loop():
    """The engine's lse with the positive excluded and a per-candidate offset, against a Python loop."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 3, generator=generator, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    log_w = torch.randn(5, dtype=torch.float64)
    from clipkit.tiled.engine import Sweep

    targets = {"i2t": torch.tensor([0, 1, 2, 3, 4, 0, 1]), "t2i": torch.arange(5)}
    offset = LogSumExp("i2t", exclude_positive=True, offset=lambda tile: log_w[tile.cols])
    sums = RowSum("t2i", lambda values, tile: values.square())
    sweep = Sweep(lambda a, b: a[0] @ b[0].t(), (x,), (y,), targets, (), (offset, sums), 2)
    lse, square_sums = run_sweep(sweep)
    for i in range(7):
        kept = [float(x[i] @ y[j]) + float(log_w[j]) for j in range(5) if j != int(targets["i2t"][i])]
        assert float(lse[i]) == pytest.approx(
            float(torch.tensor(kept, dtype=torch.float64).logsumexp(0)), abs=1e-12
        )
    for j in range(5):
        assert float(square_sums[j]) == pytest.approx(
            sum(float(x[i] @ y[j]) ** 2 for i in range(7)), abs=1e-10
        )


def test_memory_does_not_hold_the_full_logits():
    """N = 2048 with 64-row tiles: the autograd graph holds no N×N (or tile-sized) tensor after forward."""
    saved = []
    a, b = random_points(2048, 1, 16, seed=1), random_points(2048, 1, 16, seed=2)
    from clipkit.contract.types import LossContext
    from clipkit.tiled.contract import tiled_global_loss

    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = tiled_global_loss(InfoNCE(), dot(), a, b, LossContext(), tile_size=64)
    assert max(saved) <= 2048 * 16, f"largest saved tensor has {max(saved)} elements"
    out.loss.backward()
    assert torch.isfinite(a.points.grad).all()


def test_refusals_name_the_reason():
    with pytest.raises(AssertionError, match="Hopfield retrieval"):
        check_tiled(InfoLOOB(), HopfieldSimilarity())
    with pytest.raises(AssertionError, match="cyclic-consistency"):
        check_tiled(CyCLIPLoss(), dot())
    with pytest.raises(ClipkitError, match="train.tiled: true, but the loss CyCLIPLoss has no tiled form"):
        decide(Tiling("true"), 64, "the loss CyCLIPLoss has no tiled form: ...")
    assert not decide(Tiling("auto"), AUTO_ABOVE + 1, "any reason").tiled  # auto falls back to the full path


def test_auto_switches_above_the_threshold():
    assert not decide(Tiling("auto"), AUTO_ABOVE, None).tiled
    assert decide(Tiling("auto", 256), AUTO_ABOVE + 1, None).tile_size == 256
    assert decide(Tiling("true"), 2, None).tiled and not decide(Tiling("false"), 10**6, None).tiled


def test_the_train_keys_are_checked():
    assert errors({"train": {"tiled": "sometimes"}}) == [
        "train.tiled: must be auto, true or false, got 'sometimes'"
    ]
    assert "train.tile_size" in errors({"train": {"tile_size": 0}})[0]
    assert tiling_of({"train": {"tiled": True, "tile_size": 256}}) == Tiling("true", 256)
    assert tiling_of({"train": {}}) == Tiling() and tiling_of({}) == Tiling()


def test_the_deprecated_loss_keys_still_work_and_never_reach_the_factory():
    old = {"loss": {"name": "infonce", "tiled": True, "tile_size": 256, "label_smoothing": 0.1}}
    assert tiling_of(old) == Tiling("true", 256)
    assert deprecation_warning(old) == (
        "warning: loss.tiled and loss.tile_size are deprecated and will be removed after this release; "
        "write train.tiled and train.tile_size instead"
    )
    assert deprecation_warning({"loss": {"name": "infonce"}, "train": {"tiled": True}}) is None
    assert deprecation_warning({"loss": {"name": "infonce", "tiled": "auto"}}).startswith(
        "warning: loss.tiled is deprecated"
    )
    both = {"loss": {"name": "infonce", "tiled": True}, "train": {"tiled": False}}
    assert "sets both" in errors(both)[0]


def test_a_recipe_with_loss_tiled_resolves_with_one_warning_line(capsys):
    from clipkit.app.api import resolve
    from clipkit.contract.registry import default_registry

    recipe = resolve("clip@tiny", ["loss.tiled=true", "loss.tile_size=8"], default_registry())
    warned = [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]
    assert warned == [
        "warning: loss.tiled and loss.tile_size are deprecated and will be removed after this release; "
        "write train.tiled and train.tile_size instead"
    ]
    assert tiling_of(recipe) == Tiling("true", 8)


def test_validate_refuses_tiled_true_for_cloob(registry=None):
    from clipkit.app.api import resolve
    from clipkit.contract.registry import default_registry
    from clipkit.errors import RecipeError

    with pytest.raises(RecipeError, match="train.tiled: true, but the similarity HopfieldSimilarity"):
        resolve("cloob@tiny", ["train.tiled=true"], default_registry())
    with pytest.raises(RecipeError, match="train.tiled: true, but the similarity HopfieldSimilarity"):
        resolve("cloob@tiny", ["loss.tiled=true"], default_registry())  # the deprecated spelling too
    assert resolve("clip@tiny", ["train.tiled=true", "train.tile_size=8"], default_registry())["train"][
        "tiled"
    ]
    with pytest.raises(RecipeError, match="ZeRO-3"):
        zero3 = ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=3"]
        resolve("clip@tiny", ["train.tiled=true", *zero3], default_registry())


class _SlightlyWrongTiles(InfoNCE):
    """A tiled form off by a tiny extra term (1e-6 · the positives): check_tiled must notice."""

    def tiled_loss(self, logits, ctx):
        out = super().tiled_loss(logits, ctx)
        return type(out)(out.loss + 1e-6 * logits.positives("i2t").sum(), out.metrics)


def test_check_tiled_catches_a_wrong_tiled_form():
    with pytest.raises(AssertionError, match="tiled != full for loss"):
        check_tiled(_SlightlyWrongTiles(), dot())


class _OneDirectionInfoNCE:
    """The third-party example of docs/plugins.md ("Tiled losses"), with its tiled_loss."""

    requires = frozenset()

    def __init__(self, weight: float = 1.0):
        self.weight = weight

    def __call__(self, logits, targets, ctx):
        loss = self.weight * torch.nn.functional.cross_entropy(logits.i2t, targets)
        return LossOutput(loss, {"i2t_ce": loss.detach()})

    def tiled_loss(self, logits, ctx):
        (lse,) = logits.reduce(LogSumExp("i2t"))
        loss = self.weight * (lse - logits.positives("i2t")).mean()
        return LossOutput(loss, {"i2t_ce": loss.detach()})


def test_the_documented_third_party_example():
    check_tiled(_OneDirectionInfoNCE(0.5), DotSimilarity(), tolerance=1e-10)
    check_tiled(_OneDirectionInfoNCE(0.5), DotSimilarity(), local_rows=(4, 5), tolerance=1e-10)


NUCLR_CASES = {
    "sogclr": lambda: SogCLRLoss(num_samples=64, tau=0.1, gamma=0.9),
    "nuclr": lambda: NUCLRLoss(
        num_samples=64, tau=0.1, gamma=0.8, freeze_epochs=0, zeta_lr=0.05, zeta_lr_schedule="constant"
    ),  # fmt: skip
    "nuclr_code": lambda: NUCLRLoss(
        num_samples=64,
        tau=0.1,
        gamma=0.8,
        freeze_epochs=0,
        zeta_lr=0.05,
        zeta_lr_schedule="constant",
        first_visit="set",
        offset_rescale="code",
        xi_update="epoch",
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(NUCLR_CASES))
def test_per_sample_state_losses_tile_exactly(name):
    """SogCLR / NUCLR: loss, metrics, gradients and the state written (u, b, ζ, z) equal the full path,
    over two steps (the second reads the state the first wrote, with ζ no longer at its start)."""
    full_loss, tiled_loss = NUCLR_CASES[name](), NUCLR_CASES[name]()
    for step in range(2):
        check_tiled(full_loss, dot(), batch=13, tile_size=4, tolerance=1e-10)
        # check_tiled runs on copies: advance both copies of the state by one real step each.
        for loss in (full_loss, tiled_loss):
            a, b = random_points(13, 1, 8, seed=10 + step), random_points(13, 1, 8, seed=20 + step)
            ctx = full_context(13, loss.requires, a, b)
            if loss is full_loss:
                loss(dot()(a, b), torch.arange(13), ctx)
            else:
                tiled_global_loss(loss, dot(), a, b, ctx, tile_size=4)
        for key, value in full_loss.state_dict().items():
            got = tiled_loss.state_dict()[key]
            assert torch.allclose(got.double(), value.double(), rtol=1e-5, atol=1e-6, equal_nan=True), key


KERNEL_LOSSES = {
    "yaware": lambda: YAwareInfoNCE(),
    "yaware_two_factors": lambda: YAwareInfoNCE(
        kernel=[{"key": "age", "type": "rbf", "sigma": 3.0}, {"key": "label", "type": "delta"}]
    ),
    "simclr": SimCLRLoss,
    "supcon": lambda: SupConLoss(base_temperature=0.1, temperature=0.07),
}


@pytest.mark.parametrize("name", sorted(KERNEL_LOSSES))
def test_target_weighted_two_view_losses_tile_exactly(name):
    """y-Aware InfoNCE / SimCLR / SupCon: the 2N views scored by tiles, target weights from the
    meta-data kernel per tile (full path: the in-modal N×N logits and the 2N × 2N kernel)."""
    check_tiled(KERNEL_LOSSES[name](), dot(), batch=13, tile_size=4, tolerance=1e-10)


def test_yaware_code_normalisation_is_refused_when_tiled():
    with pytest.raises(ClipkitError, match="normalisation 'code'"):
        check_tiled(YAwareInfoNCE(normalisation="code"), dot())


def test_validate_explains_the_knob():
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app
    from clipkit.contract.manager import make_plugin_manager

    app = make_app(make_plugin_manager(autoload=False))
    result = CliRunner().invoke(app, ["validate", "clip@tiny", "data.batch_size=65536"])
    assert result.exit_code == 0, result.output
    assert "# train.tiled: auto — contrastive batch 65536: tiled, tiles of at most 1024×1024" in result.output
    assert "the full logits would take 32 GiB" in result.output
    result = CliRunner().invoke(app, ["validate", "cloob@tiny"])
    assert "full N×N logits (the similarity HopfieldSimilarity has no tiled form" in result.output
    result = CliRunner().invoke(app, ["validate", "clip@tiny", "train.tiled=maybe"])
    assert result.exit_code == 2 and "train.tiled: must be auto, true or false, got 'maybe'" in result.output


def test_zero3_keeps_the_full_path_and_refuses_tiled_true():
    from clipkit.tiled.settings import strategy_refusal

    zero3 = strategy_refusal({"strategy": "deepspeed", "zero_stage": 3})
    assert strategy_refusal({}) is None and "ZeRO-3" in zero3
    assert strategy_refusal({"strategy": "deepspeed", "zero_stage": 2}) is None
    assert strategy_refusal({"strategy": "deepspeed"}) is None  # ZeRO-2 is the default stage
    assert not decide(Tiling("auto"), AUTO_ABOVE + 1, zero3).tiled
    with pytest.raises(ClipkitError, match="ZeRO-3"):
        decide(Tiling("true"), 8, zero3)
