"""Built-in encoders (ViT, text Transformer) and tokenizers: shapes, pooling, masking, grads,
point-set options (first m tokens, weight heads, padding points), sizes and export."""

from __future__ import annotations

import pickle
import subprocess
import sys
import zlib

import pytest
import torch
from safetensors.torch import load_model, save_model

from clipkit.contract.testing import check_encoder
from clipkit.contract.types import PointSet
from clipkit.plugins import encoders, tokenizers
from clipkit.plugins.encoders import densenet3d, text_transformer, vit
from clipkit.plugins.encoders.text_transformer import clip_text, text_transformer_tiny
from clipkit.plugins.encoders.vit import vit_b16, vit_b32, vit_tiny
from clipkit.plugins.similarities.kme import KMESimilarity
from clipkit.plugins.tokenizers.basic import ByteTokenizer, HashedWordTokenizer

EMBED_DIM = 16
VOCAB = 50
CONTEXT = 8


def make_vit(seed: int = 0, **kwargs) -> vit.VisionTransformer:
    torch.manual_seed(seed)
    return vit_tiny(embed_dim=EMBED_DIM, **kwargs)


def make_text(seed: int = 0, **kwargs) -> text_transformer.TextTransformer:
    torch.manual_seed(seed)
    return text_transformer_tiny(embed_dim=EMBED_DIM, vocab_size=VOCAB, context_length=CONTEXT, **kwargs)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


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


def test_vit_b_parameter_counts():
    """OpenAI CLIP's ViT-B image towers with embed_dim 512, counted by hand (width 768, MLP 3072):

      ViT-B/16               conv1 (no bias) 3·768·16²     =    589 824
                             class embedding               =        768
                             positions 197·768             =    151 296
                             ln_pre 2·768                  =      1 536
                             12 blocks × 7 087 872         = 85 054 464
                             ln_post                       =      1 536
                             proj (no bias) 768·512        =    393 216   -> 86 192 640
      block = ln_1 1 536 + in_proj 768·2304 + 2304 + out_proj 768² + 768 + ln_2 1 536
              + fc 768·3072 + 3072 + c_proj 3072·768 + 768 = 7 087 872
      ViT-B/32: conv1 3·768·32² = 2 359 296 and positions 50·768 = 38 400 instead -> 87 849 216.
    A weight head adds Linear(768, 1) = 769.
    """
    with torch.device("meta"):
        b16, b32 = vit_b16(embed_dim=512), vit_b32(embed_dim=512)
        weighted = vit_b16(embed_dim=512, output="tokens", weights="softplus")
    assert count(b16) == 86_192_640
    assert count(b32) == 87_849_216
    assert count(weighted) == 86_192_640 + 769
    assert b16.positional_embedding.shape == (197, 768) and b32.positional_embedding.shape == (50, 768)


@pytest.mark.parametrize("m", [1, 2, 10, 17])
def test_vit_keeps_the_first_m_tokens(m):
    """KME-CLIP's point-set-size ablation: the first m of [CLS, patches in raster order]."""
    full = make_vit(output="tokens", weights="softplus")(images())
    first = make_vit(output="tokens", num_points=m, weights="softplus")(images())
    assert first.points.shape == (2, m, EMBED_DIM) and first.weights.shape == (2, m)
    torch.testing.assert_close(first.points, full.points[:, :m])
    torch.testing.assert_close(first.weights, full.weights[:, :m])
    torch.testing.assert_close(first.points[:, :1], make_vit(output="cls")(images()).points)


def capture_final_features(model: torch.nn.Module, norm: torch.nn.Module) -> list[torch.Tensor]:
    """Record what ``norm`` (the tower's final LayerNorm) outputs on the next forward."""
    captured = []
    norm.register_forward_hook(lambda module, args, out: captured.append(out.detach()))
    return captured


def test_vit_softplus_weights():
    model = make_vit(output="tokens", weights="softplus")
    features = capture_final_features(model, model.ln_post)
    out = model(images())
    assert out.weights.shape == (2, 17) and (out.weights > 0).all()
    assert out.weight_normalization == "sum"
    head = model.weight_head.linear
    expected = torch.nn.functional.softplus(features[0] @ head.weight.t() + head.bias).squeeze(-1)
    torch.testing.assert_close(out.weights, expected)
    # A separate head, built after the tower: same seed -> the very points of the unweighted tower.
    torch.testing.assert_close(make_vit(output="tokens")(images()).points, out.points)


def test_vit_scaled_tanh_weights_are_count_normalised():
    """The WPSE authors' weights: a·tanh(z/a), may be negative; the weighted mean is
    torch.mean(points * w, dim=1) (divides by the token count, METHODS §11)."""
    model = make_vit(output="tokens", weights="scaled_tanh", weight_scale=0.5)
    features = capture_final_features(model, model.weight_head.linear)
    out = model(images())
    assert out.weight_normalization == "count"
    torch.testing.assert_close(out.weights, 0.5 * torch.tanh(features[0].squeeze(-1) / 0.5))
    assert (out.weights.abs() < 0.5).all() and (out.weights < 0).any() and (out.weights > 0).any()
    torch.testing.assert_close(out.mean(), (out.points * out.weights.unsqueeze(-1)).mean(dim=1))


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


def test_clip_text_parameter_count():
    """OpenAI CLIP's ViT-B/16 text tower (vocab 49 408, context 77, width 512, 12 layers, d = 512):

      token embedding 49 408·512     = 25 296 896
      positions 77·512               =     39 424
      12 blocks × 3 152 384          = 37 828 608
      ln_final 2·512                 =      1 024
      text_projection 512·512        =    262 144   -> 63 428 096
      block = ln_1 1 024 + in_proj 512·1536 + 1536 + out_proj 512² + 512 + ln_2 1 024
              + fc 512·2048 + 2048 + c_proj 2048·512 + 512 = 3 152 384
    output="tokens" adds the pad vector (512); a weight head adds Linear(512, 1) = 513.
    """
    shape = {"embed_dim": 512, "vocab_size": 49408, "context_length": 77}
    with torch.device("meta"):
        eos = clip_text(**shape)
        tokens_out = clip_text(**shape, output="tokens", weights="softplus")
    assert count(eos) == 63_428_096
    assert count(tokens_out) == 63_428_096 + 512 + 513


def test_zero_id_inside_the_text_is_a_real_token():
    """CLIP's BPE gives "!" the id 0: the mask ends at the last non-zero id, not at the first 0."""
    ids = torch.tensor([[1, 7, 0, 9, 2, 0, 0, 0], [1, 0, 0, 2, 0, 0, 0, 0]])
    model = make_text(output="tokens")
    out = model(ids)
    assert out.mask.tolist() == [[True] * 5 + [False] * 3, [True] * 4 + [False] * 4]
    model.output = "eos"
    eos = model(ids).points[:, 0]
    torch.testing.assert_close(eos[0], out.points[0, 4])
    torch.testing.assert_close(eos[1], out.points[1, 3])


def test_padding_uses_the_pad_vector_not_token_zero():
    ids = torch.tensor([[1, 7, 8, 2, 0, 0, 0, 0], [1, 7, 0, 2, 0, 0, 0, 0]])
    model = make_text(output="tokens", pad_points="include")
    before = model(ids).points
    with torch.no_grad():
        model.token_embedding.weight[0] += 1.0
    after = model(ids).points
    assert torch.equal(after[0], before[0])  # no 0 in the text: token 0's embedding is unused
    assert torch.equal(after[1, :2], before[1, :2])  # causal: before the inner 0
    assert not torch.allclose(after[1, 2:], before[1, 2:])
    with torch.no_grad():
        model.pad_embedding += 1.0
    padded = model(ids).points
    assert torch.equal(padded[:, :4], after[:, :4])  # real tokens never see the padding
    assert not torch.allclose(padded[:, 4:], after[:, 4:])


def test_include_makes_position_dependent_pads_real_points():
    """WPSE (METHODS §2, §11): pads are points, each different (pad vector + its position)."""
    include = make_text(output="tokens", pad_points="include")(tokens())
    masked = make_text(output="tokens", pad_points="mask")(tokens())
    assert include.mask is None and include.points.shape == (3, CONTEXT, EMBED_DIM)
    assert torch.equal(include.points, masked.points)  # same parameters, only the mask differs
    assert torch.equal(masked.mask, tokens() != 0)
    pads = include.points[1, 3:]  # row 1 = [1, 5, 2, 0, 0, 0, 0, 0]
    distances = torch.cdist(pads, pads) + torch.eye(len(pads))
    assert distances.min() > 1e-3


@pytest.mark.parametrize("weights", [None, "softplus"])
def test_mask_mode_appending_padding_keeps_real_outputs(weights):
    short = torch.tensor([[1, 7, 8, 9, 2], [1, 5, 0, 6, 2]])
    padded = torch.cat([short, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    model = make_text(output="tokens", weights=weights)
    a, b = model(short), model(padded)
    assert b.mask[:, :5].all() and not b.mask[:, 5:].any()
    torch.testing.assert_close(b.points[:, :5], a.points)
    if weights:
        torch.testing.assert_close(b.weights[:, :5], a.weights)
        assert (b.weights > 0).all()
    model.output = "eos"
    torch.testing.assert_close(model(padded).points, model(short).points)


def test_text_weight_heads():
    out = make_text(output="tokens", weights="softplus")(tokens())
    assert out.weights.shape == (3, CONTEXT) and (out.weights > 0).all() and out.weight_normalization == "sum"
    out = make_text(output="tokens", pad_points="include", weights="scaled_tanh", weight_scale=2.0)(tokens())
    assert out.weight_normalization == "count" and (out.weights.abs() < 2.0).all()
    eos = make_text(weights="softplus")(tokens())
    assert eos.weights.shape == (3, 1)


# --- Weighted point sets ("count" normalisation) --------------------------------------------


def test_count_normalisation_semantics():
    points = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])
    weights = torch.tensor([[2.0, -1.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    counted = PointSet(points, weights, mask, weight_normalization="count")
    # w / (number of real points = 2); the masked point contributes nothing
    torch.testing.assert_close(counted.normalized_weights(), torch.tensor([[1.0, -0.5, 0.0]]))
    torch.testing.assert_close(counted.mean(), torch.tensor([[1.0, -0.5]]))
    # no mask: the WPSE authors' torch.mean(points * w, dim=1)
    unmasked = PointSet(points, weights, weight_normalization="count")
    torch.testing.assert_close(unmasked.mean(), (points * weights.unsqueeze(-1)).mean(dim=1))
    # "sum" divides by Σw instead: 2 + (-1) = 1 over the real points
    torch.testing.assert_close(
        PointSet(points, weights, mask).normalized_weights(), torch.tensor([[2.0, -1.0, 0.0]])
    )
    # without weights both are uniform over the real points
    torch.testing.assert_close(
        PointSet(points, None, mask, "count").normalized_weights(), torch.tensor([[0.5, 0.5, 0.0]])
    )
    assert counted.float().weight_normalization == "count"
    assert counted.to("cpu").weight_normalization == "count"
    with pytest.raises(ValueError, match="weight_normalization"):
        PointSet(points, weights, weight_normalization="mean")


def test_kme_refuses_count_normalised_weights():
    a = make_vit(output="tokens", weights="scaled_tanh")(images())
    b = make_vit(output="tokens", weights="softplus")(images())
    with pytest.raises(ValueError, match="positive weights"):
        KMESimilarity()(a, b)
    assert torch.isfinite(KMESimilarity()(b, b).i2t).all()


# --- Both encoders ------------------------------------------------------------------------

ENCODERS = {
    "vit": (make_vit, images),
    "text": (make_text, tokens),
}

#: (kind, options): the plain towers and each with the point-set options.
VARIANTS = [
    ("vit", {}),
    ("vit", {"output": "tokens", "num_points": 5, "weights": "softplus"}),
    ("vit", {"output": "tokens", "weights": "scaled_tanh"}),
    ("text", {}),
    ("text", {"output": "tokens", "weights": "softplus"}),
    ("text", {"output": "tokens", "pad_points": "include", "weights": "scaled_tanh"}),
]
VARIANT_IDS = [f"{kind}-{'-'.join(map(str, options.values())) or 'plain'}" for kind, options in VARIANTS]


def weighted_sum(out: PointSet) -> torch.Tensor:
    """A scalar touching every point coordinate and weight with distinct coefficients (a plain sum
    of unit vectors has tiny gradients, and symmetric sums can cancel)."""
    total = (out.points * torch.linspace(-1, 1, out.points.numel()).view_as(out.points)).sum()
    if out.weights is not None:
        total = total + (out.weights * torch.linspace(-1, 1, out.weights.numel()).view_as(out.weights)).sum()
    return total


def loss_and_grads(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(inputs)
    weighted_sum(out).backward()
    return out.points.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "kind, options",
    VARIANTS + [("vit", {"output": "tokens"}), ("text", {"output": "tokens"})],
    ids=[*VARIANT_IDS, "vit-tokens", "text-tokens"],
)
def test_gradients_reach_every_parameter(kind, options):
    build, inputs = ENCODERS[kind]
    model = build(**options)
    weighted_sum(model(inputs())).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing
    zero = [name for name, p in model.named_parameters() if not p.grad.abs().sum() > 0]
    assert not zero


@pytest.mark.parametrize("kind, options", VARIANTS, ids=VARIANT_IDS)
def test_grad_checkpointing_matches(kind, options, monkeypatch):
    build, inputs = ENCODERS[kind]
    model = build(**options)
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
        (vit_tiny, {"output": "tokens", "num_points": 0}, r"num_points must be an integer in \[1, 17\]"),
        (vit_tiny, {"output": "tokens", "num_points": 18}, r"num_points must be an integer in \[1, 17\]"),
        (vit_tiny, {"output": "tokens", "num_points": 2.5}, "num_points must be an integer"),
        (vit_tiny, {"num_points": 2}, "num_points needs output='tokens'"),
        (vit_tiny, {"weights": "sigmoid"}, "weights"),
        (vit_tiny, {"weights": "scaled_tanh", "weight_scale": 0}, "weight_scale"),
        (text_transformer_tiny, {"width": 64, "heads": 3}, "divisible by heads"),
        (text_transformer_tiny, {"output": "cls"}, "output"),
        (text_transformer_tiny, {"context_length": 0}, "context_length"),
        (text_transformer_tiny, {"output": "tokens", "pad_points": "drop"}, "pad_points"),
        (text_transformer_tiny, {"pad_points": "include"}, "needs output='tokens'"),
        (text_transformer_tiny, {"weights": "relu"}, "weights"),
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
    assert (
        registered.items()
        >= {
            "vit": vit.vit,
            "vit_b16": vit.vit_b16,
            "vit_b32": vit.vit_b32,
            "vit_tiny": vit.vit_tiny,
            "text_transformer": text_transformer.text_transformer,
            "clip_text": text_transformer.clip_text,
            "text_transformer_tiny": text_transformer.text_transformer_tiny,
            "densenet3d": densenet3d.densenet3d,
            "densenet3d_121": densenet3d.densenet3d_121,
            "densenet3d_tiny": densenet3d.densenet3d_tiny,
        }.items()
    )


@pytest.mark.parametrize(
    "build, inputs",
    [
        (lambda: make_vit(), images),
        (lambda: make_vit(output="tokens", num_points=5, weights="softplus"), images),
        (lambda: make_text(), tokens),
        (lambda: make_text(output="tokens", weights="softplus"), tokens),
        (lambda: make_text(output="tokens", pad_points="include"), tokens),
        (
            lambda: densenet3d.densenet3d_tiny(embed_dim=EMBED_DIM),
            lambda: torch.randn(2, 1, 16, 16, 16, generator=torch.Generator().manual_seed(3)),
        ),
    ],
    ids=["vit", "vit-tokens-weights", "text", "text-tokens-weights", "text-include", "densenet3d"],
)
def test_tiny_presets_meet_the_encoder_contract(build, inputs):
    torch.manual_seed(0)
    check_encoder(build(), inputs())


@pytest.mark.parametrize("kind, options", VARIANTS, ids=VARIANT_IDS)
def test_safetensors_round_trip_is_bit_exact(kind, options, tmp_path):
    build, inputs = ENCODERS[kind]
    model = build(**options).eval()
    save_model(model, str(tmp_path / "encoder.safetensors"))
    clone = build(seed=99, **options).eval()
    load_model(clone, str(tmp_path / "encoder.safetensors"))
    with torch.no_grad():
        a, b = model(inputs()), clone(inputs())
    assert torch.equal(a.points, b.points)
    assert (a.weights is None and b.weights is None) or torch.equal(a.weights, b.weights)


@pytest.mark.parametrize(
    "image_options, text_options",
    [
        ({}, {}),
        ({"output": "tokens", "weights": "softplus"}, {"output": "tokens", "weights": "softplus"}),
        ({"output": "tokens", "weights": "scaled_tanh"}, {"output": "tokens", "pad_points": "include"}),
    ],
)
def test_tiny_towers_train_one_step(image_options, text_options):
    """One SGD step of CLIP's symmetric InfoNCE on the pooled point sets lowers the loss."""
    image_tower, text_tower = make_vit(**image_options), make_text(**text_options)
    parameters = [*image_tower.parameters(), *text_tower.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=1e-4)  # the tiny towers are steep: small step
    pixels, ids = images(), tokens()[:2]

    def loss() -> torch.Tensor:
        a = torch.nn.functional.normalize(image_tower(pixels).mean(), dim=-1)
        b = torch.nn.functional.normalize(text_tower(ids).mean(), dim=-1)
        logits = 10 * a @ b.t()
        targets = torch.arange(2)
        return (
            torch.nn.functional.cross_entropy(logits, targets)
            + torch.nn.functional.cross_entropy(logits.t(), targets)
        ) / 2

    before = loss()
    before.backward()
    optimizer.step()
    with torch.no_grad():
        after = loss()
    assert torch.isfinite(after) and after < before


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
    assert registered.items() >= {"hashed_words": HashedWordTokenizer, "bytes": ByteTokenizer}.items()


def test_plugin_modules_import_without_torch():
    code = (
        "import sys\n"
        "import clipkit.plugins.encoders, clipkit.plugins.tokenizers.basic\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
