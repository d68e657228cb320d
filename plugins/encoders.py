"""Built-in encoders: a CLIP-style ViT image tower and a causal text Transformer.

Only the hook lives here; the implementations are imported inside it so that importing this
module (the plugin manager always does) does not import torch.
"""

from clipkit.hookspecs import hookimpl


@hookimpl
def register_encoders(register):
    from clipkit.plugins import text_transformer, vit

    register("vit", vit.vit)
    register("vit_tiny", vit.vit_tiny)
    register("text_transformer", text_transformer.text_transformer)
    register("text_transformer_tiny", text_transformer.text_transformer_tiny)
