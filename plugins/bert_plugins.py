"""BERT-family text encoders and the WordPiece tokenizer.

Only the hooks live here; the implementations are imported inside them so that importing this
module (the plugin manager always does) does not import torch.
"""

from clipkit.hookspecs import hookimpl


@hookimpl
def register_encoders(register):
    from clipkit.plugins import bert

    register("distilbert", bert.distilbert)
    register("distilbert_tiny", bert.distilbert_tiny)
    register("minilm_l6", bert.minilm_l6)


@hookimpl
def register_tokenizers(register):
    from clipkit.plugins import wordpiece

    register("wordpiece", wordpiece.WordPieceTokenizer)
