"""Built-in tokenizers (``register_tokenizers``): hashed words and bytes (tests, synthetic data),
CLIP's BPE and BERT's WordPiece. Implementations are imported inside the hook (see
:mod:`clipkit.plugins.encoders` for the pattern)."""

from clipkit.contract.hookspecs import hookimpl


@hookimpl
def register_tokenizers(register):
    from clipkit.plugins.tokenizers import basic, clip_bpe, wordpiece

    register("hashed_words", basic.HashedWordTokenizer)
    register("bytes", basic.ByteTokenizer)
    register("clip_bpe", clip_bpe.ClipBPETokenizer)
    register("wordpiece", wordpiece.WordPieceTokenizer)
