"""Built-in encoders (ViT, text Transformer) and tokenizers: shapes, pooling, masking, grads."""

from __future__ import annotations

import pickle
import subprocess
import sys
import zlib

import pytest
import torch

from clipkit.plugins import encoders, text_transformer, tokenizers, vit
from clipkit.plugins.text_transformer import text_transformer_tiny
from clipkit.plugins.tokenizers import ByteTokenizer, HashedWordTokenizer
from clipkit.plugins.vit import vit_tiny

EMBED_DIM = 16
VOCAB = 50
CONTEXT = 8


def make_vit(**kwargs) -> vit.VisionTransformer:
    torch.manual_seed(0)
    return vit_tiny(embed_dim=EMBED_DIM, **kwargs)


def make_text(**kwargs) -> text_transformer.TextTransformer:
    torch.manual_seed(0)
    return text_transformer_tiny(embed_dim=EMBED_DIM, vocab_size=VOCAB, context_length=CONTEXT, **kwargs)


def images(batch: int = 2) -> torch.Tensor:
    """[B, 3, 32, 32] matching vit_tiny's default image_size."""
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def tokens() -> torch.Tensor:
    """[3, CONTEXT]: rows of different lengths (start ... end, then padding); row 2 is all padding."""
    return torch.tensor(
        [
            [1, 7, 8, 9, 2, 0, 0, 0],
            [1, 5, 2, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0],
        ]
    )


def assert_unit_norm(points: torch.Tensor) -> None:
    torch.testing.assert_close(points.norm(dim=-1), torch.ones(points.shape[:-1]))


# --- Vision Transformer -------------------------------------------------------------------


@pytest.mark.parametrize("output, num_points", [("cls", 1), ("tokens", 1 + 16)])
def test_vit_shapes_and_norm(output, num_points):
    out = make_vit(output=output)(images())
    assert out.points.shape == (2, num_points, EMBED_DIM)
    assert out.weights is None and out.mask is None
    assert_unit_norm(out.points)


def test_vit_cls_is_first_token():
    model = make_vit(output="tokens")
    all_tokens = model(images()).points
    model.output = "cls"
    torch.testing.assert_close(model(images()).points, all_tokens[:, :1])


def test_vit_rejects_wrong_image_size():
    with pytest.raises(ValueError, match="expected images"):
        make_vit()(torch.zeros(1, 3, 16, 16))


# --- Text Transformer ---------------------------------------------------------------------


def test_text_shapes_norm_and_mask():
    eos = make_text()(tokens())
    assert eos.points.shape == (3, 1, EMBED_DIM) and eos.mask is None
    assert_unit_norm(eos.points)

    out = make_text(output="tokens")(tokens())
    assert out.points.shape == (3, CONTEXT, EMBED_DIM)
    assert out.mask.dtype == torch.bool
    assert torch.equal(out.mask, tokens() != 0)
    assert_unit_norm(out.points)


def test_eos_pools_last_real_token():
    model = make_text(output="tokens")
    all_tokens = model(tokens()).points
    model.output = "eos"
    eos = model(tokens()).points[:, 0]
    torch.testing.assert_close(eos[0], all_tokens[0, 4])  # end token of row 0
    torch.testing.assert_close(eos[1], all_tokens[1, 2])  # end token of row 1


def test_all_padding_row_is_finite():
    for output in ("eos", "tokens"):
        assert torch.isfinite(make_text(output=output)(tokens()).points).all()


def test_text_accepts_shorter_sequences_rejects_longer():
    model = make_text(output="tokens")
    full = model(tokens()).points
    # Causal: the first 5 positions do not depend on what follows, so slicing the input is exact.
    torch.testing.assert_close(model(tokens()[:, :5]).points, full[:, :5])
    with pytest.raises(ValueError, match="context_length"):
        model(torch.ones(1, CONTEXT + 1, dtype=torch.long))


def test_causal_mask():
    model = make_text(output="tokens")
    before = model(tokens()).points
    changed = tokens()
    changed[0, 3] = 11  # position 3 changes; positions 0..2 must not
    after = model(changed).points
    torch.testing.assert_close(after[0, :3], before[0, :3])
    assert not torch.allclose(after[0, 3], before[0, 3])


# --- Both encoders ------------------------------------------------------------------------

ENCODERS = {
    "vit": (make_vit, images),
    "text": (make_text, tokens),
}


def loss_and_grads(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    points = model(inputs).points
    points.sum().backward()
    return points.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ENCODERS)
@pytest.mark.parametrize("output", ["pooled", "tokens"])
def test_gradients_reach_every_parameter(kind, output):
    build, inputs = ENCODERS[kind]
    model = build(output="tokens") if output == "tokens" else build()
    # A plain sum of unit vectors has tiny gradients; weight the points so none vanish by symmetry.
    points = model(inputs()).points
    (points * torch.linspace(-1, 1, points.numel()).view_as(points)).sum().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing
    zero = [name for name, p in model.named_parameters() if not p.grad.abs().sum() > 0]
    assert not zero


@pytest.mark.parametrize("kind", ENCODERS)
def test_grad_checkpointing_matches(kind, monkeypatch):
    build, inputs = ENCODERS[kind]
    model = build()
    reference, reference_grads = loss_and_grads(model, inputs())

    calls = []
    real_checkpoint = vit.checkpoint

    def counting_checkpoint(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(vit, "checkpoint", counting_checkpoint)
    model.grad_checkpointing = True
    points, grads = loss_and_grads(model, inputs())
    assert calls == [False, False]  # once per block, non-reentrant
    torch.testing.assert_close(points, reference)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], msg=name)

    # Evaluation never checkpoints: there is no backward to save memory for.
    calls.clear()
    model.eval()
    with torch.no_grad():
        model(inputs())
    assert calls == []


@pytest.mark.parametrize(
    "build, kwargs, match",
    [
        (vit_tiny, {"image_size": 30, "patch_size": 8}, "divisible by patch_size"),
        (vit_tiny, {"width": 64, "heads": 3}, "divisible by heads"),
        (vit_tiny, {"output": "mean"}, "output"),
        (vit_tiny, {"layers": 0}, "layers"),
        (text_transformer_tiny, {"width": 64, "heads": 3}, "divisible by heads"),
        (text_transformer_tiny, {"output": "cls"}, "output"),
        (text_transformer_tiny, {"context_length": 0}, "context_length"),
    ],
)
def test_bad_arguments(build, kwargs, match):
    required = {"embed_dim": EMBED_DIM}
    if build is text_transformer_tiny:
        required |= {"vocab_size": VOCAB, "context_length": CONTEXT}
    with pytest.raises(ValueError, match=match):
        build(**(required | kwargs))


def test_encoder_hook_registers_builders():
    registered = {}
    encoders.register_encoders(register=registered.__setitem__)
    assert registered == {
        "vit": vit.vit,
        "vit_tiny": vit.vit_tiny,
        "text_transformer": text_transformer.text_transformer,
        "text_transformer_tiny": text_transformer.text_transformer_tiny,
    }


# --- Tokenizers ---------------------------------------------------------------------------


def crc_id(word: str, vocab_size: int) -> int:
    return zlib.crc32(word.encode()) % (vocab_size - 3) + 3


def test_hashed_words_golden_ids():
    tok = HashedWordTokenizer(vocab_size=100, context_length=10)
    ids = tok(["A cat, sat!"])
    # Lower-cased, then words and single punctuation marks: a | cat | , | sat | !
    words = ["a", "cat", ",", "sat", "!"]
    expected = [1, *(crc_id(w, 100) for w in words), 2, 0, 0, 0]
    assert ids.dtype == torch.long
    assert ids.tolist() == [expected]


def test_hashed_words_truncation_keeps_end_token():
    tok = HashedWordTokenizer(vocab_size=100, context_length=4)
    ids = tok(["one two three four five"])
    assert ids.tolist() == [[1, crc_id("one", 100), crc_id("two", 100), 2]]


def test_empty_text():
    assert HashedWordTokenizer(context_length=5)([""]).tolist() == [[1, 2, 0, 0, 0]]
    assert ByteTokenizer(context_length=5)([""]).tolist() == [[1, 2, 0, 0, 0]]


def test_byte_tokenizer_golden_ids_and_truncation():
    tok = ByteTokenizer(context_length=6)
    assert tok.vocab_size == 259
    assert tok(["ab", "abcdefg"]).tolist() == [
        [1, 97 + 3, 98 + 3, 2, 0, 0],
        [1, 100, 101, 102, 103, 2],
    ]


@pytest.mark.parametrize("tok", [HashedWordTokenizer(vocab_size=64, context_length=6), ByteTokenizer(8)])
def test_tokenizer_pickle_round_trip(tok):
    clone = pickle.loads(pickle.dumps(tok))
    assert (clone.vocab_size, clone.context_length) == (tok.vocab_size, tok.context_length)
    texts = ["Hello, world", "x"]
    assert torch.equal(clone(texts), tok(texts))


def test_tokenizer_rejects_bare_string():
    with pytest.raises(TypeError):
        ByteTokenizer()("ab")


def test_tokenizer_hook_registers_classes():
    registered = {}
    tokenizers.register_tokenizers(register=registered.__setitem__)
    assert registered == {"hashed_words": HashedWordTokenizer, "bytes": ByteTokenizer}


def test_plugin_modules_import_without_torch():
    code = (
        "import sys\n"
        "import clipkit.plugins.encoders, clipkit.plugins.tokenizers\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
