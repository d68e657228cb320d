"""clipkit.train.compile: torch.compile of the two towers only, in place, with unchanged outputs,
gradients and parameter names."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from clipkit.errors import ClipkitError
from clipkit.plugins.encoders.text_transformer import text_transformer_tiny
from clipkit.plugins.encoders.vit import vit_tiny
from clipkit.plugins.similarities.dot import DotSimilarity
from clipkit.train.compile import (
    COMPILE_MODES,
    compile_towers,
    compile_unavailable,
    compiled_units,
    is_compiled,
)

EMBED_DIM = 16


class Towers(nn.Module):
    """The attributes compile_towers looks at, as on clipkit.model.ContrastiveModel."""

    def __init__(self, *, text: bool = True, layers: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Smaller than the tiny presets (one layer, width 32, 16 px) to keep compiling short; token
        # outputs with weight heads and a padding mask, so every PointSet field goes through Inductor.
        points = {"output": "tokens", "weights": "softplus", "width": 32, "layers": layers}
        self.image_encoder = vit_tiny(embed_dim=EMBED_DIM, image_size=16, patch_size=8, **points)
        self.text_encoder = (
            text_transformer_tiny(
                embed_dim=EMBED_DIM, vocab_size=50, context_length=8, pad_points="mask", **points
            )
            if text
            else None
        )
        self.similarity = DotSimilarity()


@pytest.fixture(autouse=True, scope="module")
def restore_environment():
    """Inductor exports variables into os.environ while compiling, among them
    ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``, a pointer into this process. Processes that later
    tests launch would inherit it, and a child that dereferences it aborts (seen as a flaky
    ``torchrun`` failure in tests/test_distributed.py). Restore the environment after this module."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """[4, 3, 16, 16] images and [4, 8] token rows of different lengths (0 = padding)."""
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor(
        [
            [1, 7, 8, 9, 2, 0, 0, 0],
            [1, 5, 2, 0, 0, 0, 0, 0],
            [1, 4, 4, 4, 4, 4, 4, 2],
            [1, 2, 0, 0, 0, 0, 0, 0],
        ]
    )
    return images, tokens


def symmetric_infonce(model: Towers, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logits = model.similarity(model.image_encoder(images), model.text_encoder(tokens))
    targets = torch.arange(images.shape[0])
    return (
        nn.functional.cross_entropy(logits.i2t, targets) + nn.functional.cross_entropy(logits.t2i, targets)
    ) / 2


def test_none_leaves_the_model_eager():
    model = Towers()
    assert compile_towers(model, "none") is model
    assert not is_compiled(model.image_encoder) and not is_compiled(model.text_encoder)


def test_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ClipkitError, match="reduce-overhead"):
        compile_towers(Towers(), "fast")


@pytest.mark.parametrize("mode", [m for m in COMPILE_MODES if m != "none"])
def test_only_the_towers_are_compiled_and_names_are_kept(mode):
    """Compilation is lazy, so this needs no compiler: the towers are marked, the similarity is
    not, and state_dict keys stay those of the eager model (no ``_orig_mod.`` prefix)."""
    model = Towers()
    keys = list(model.state_dict())
    assert compile_towers(model, mode) is model
    assert is_compiled(model.image_encoder) and is_compiled(model.text_encoder)
    assert not is_compiled(model.similarity)
    assert list(model.state_dict()) == keys


def test_two_view_model_without_text_tower():
    model = compile_towers(Towers(text=False), "default")
    assert is_compiled(model.image_encoder) and model.text_encoder is None


@pytest.mark.slow
def test_compiled_towers_match_eager_outputs_and_gradients():
    """Inductor's generated CPU kernels against eager PyTorch on the same weights: every PointSet
    field and the loss agree to float32 rounding (measured ≤ 5e-7), and so does every parameter
    gradient.
    Compiling takes ~25 s on a cold Inductor cache, a few seconds warm."""
    reason = compile_unavailable()
    if reason:
        pytest.skip(reason)
    eager = Towers()
    compiled = compile_towers(copy.deepcopy(eager), "default")
    images, tokens = inputs()

    for name, x in (("image_encoder", images), ("text_encoder", tokens)):
        want, got = getattr(eager, name)(x), getattr(compiled, name)(x)
        torch.testing.assert_close(got.points, want.points, rtol=1e-5, atol=1e-5)
        for field in ("weights", "mask"):
            want_field, got_field = getattr(want, field), getattr(got, field)
            assert (want_field is None) == (got_field is None), (name, field)
            if want_field is not None:
                torch.testing.assert_close(got_field, want_field, rtol=1e-5, atol=1e-5)
        assert got.weights is not None and (name == "image_encoder" or got.mask is not None)

    want_loss, got_loss = (
        symmetric_infonce(eager, images, tokens),
        symmetric_infonce(compiled, images, tokens),
    )
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    want_loss.backward()
    got_loss.backward()
    for (name, want), (_, got) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        assert got.grad is not None, name
        # Relative to the tensor's largest gradient: summation order differs between the fused
        # kernels and eager, so near-zero entries carry the rounding of the large ones
        # (measured ≤ 1e-6 of the largest entry; a semantic error is of order 1).
        error = float((got.grad - want.grad).abs().max())
        assert error <= 1e-5 * float(want.grad.abs().max()) + 1e-8, (name, error)


def test_block_unit_compiles_each_block_and_leaves_the_rest_eager():
    """``train.compile_unit: block`` (lazy: no compiler needed): every transformer layer of both
    towers is compiled, the towers themselves, their embeddings and heads are not, and the
    state_dict keys stay the eager model's."""
    model = Towers(layers=3)
    keys = list(model.state_dict())
    compile_towers(model, "default", "block")
    layers = [*model.image_encoder.transformer.blocks, *model.text_encoder.transformer.blocks]
    assert len(layers) == 6 and all(is_compiled(layer) for layer in layers)
    assert compiled_units(model, "block") == layers
    assert not is_compiled(model.image_encoder) and not is_compiled(model.text_encoder)
    assert not any(is_compiled(m) for m in model.image_encoder.modules() if all(m is not x for x in layers))
    assert list(model.state_dict()) == keys


def test_a_tower_without_blocks_is_compiled_whole_under_the_block_unit():
    """An encoder with no ModuleList and no ``sharding_blocks()`` has no blocks: compiled whole."""
    model = Towers(text=False)
    model.image_encoder = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    compile_towers(model, "default", "block")
    assert is_compiled(model.image_encoder)


def test_unknown_unit_is_refused_with_the_choices():
    with pytest.raises(ClipkitError, match="train.compile_unit: unknown unit 'layer'.*tower, block"):
        compile_towers(Towers(), "default", "layer")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad_checkpointing"])
def test_block_unit_traces_one_graph_per_block_kind_and_matches_eager(checkpointing):
    """Regional compilation's point: the three identical layers of a tower share one traced graph
    of one layer's four linear maps (one graph for the image blocks, one for the causal text
    blocks: two in all, not six; compiled whole, each tower's graph holds all 14 of its linear
    maps), and the compiled model's loss and every gradient equal eager's, also with each compiled
    block inside gradient checkpointing. The backend here keeps
    and runs TorchDynamo's traced graphs as they are (what Inductor would be given; no C++)."""
    if compile_unavailable():
        pytest.skip(compile_unavailable())
    import torch._dynamo

    torch._dynamo.reset()
    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    eager = Towers(layers=3)
    for tower in (eager.image_encoder, eager.text_encoder):  # each block recomputed in backward
        tower.grad_checkpointing = checkpointing
    compiled = compile_towers(copy.deepcopy(eager), "default", "block", backend=counting)
    images, tokens = inputs()
    want, got = symmetric_infonce(eager, images, tokens), symmetric_infonce(compiled, images, tokens)
    try:
        linear_maps = [
            sum(
                1 for node in graph.graph.nodes if node.op == "call_function" and "linear" in str(node.target)
            )
            for graph in graphs
        ]
        assert linear_maps == [4, 4]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        want.backward()
        got.backward()
        for (name, expected), (_, actual) in zip(
            eager.named_parameters(), compiled.named_parameters(), strict=True
        ):
            torch.testing.assert_close(actual.grad, expected.grad, rtol=1e-5, atol=1e-7, msg=name)
    finally:
        torch._dynamo.reset()
