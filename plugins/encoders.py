"""Built-in encoders: a CLIP-style ViT image tower, a causal text Transformer and a 3-D DenseNet.

Only the hook lives here; the implementations are imported inside it so that importing this
module (the plugin manager always does) does not import torch.
"""

from clipkit.hookspecs import hookimpl


@hookimpl
def register_encoders(register):
    from clipkit.plugins import densenet3d, text_transformer, vit

    register("vit", vit.vit)
    register("vit_b16", vit.vit_b16)
    register("vit_b32", vit.vit_b32)
    register("vit_tiny", vit.vit_tiny)
    register("text_transformer", text_transformer.text_transformer)
    register("clip_text", text_transformer.clip_text)
    register("text_transformer_tiny", text_transformer.text_transformer_tiny)
    register("densenet3d", densenet3d.densenet3d)
    register("densenet3d_121", densenet3d.densenet3d_121)
    register("densenet3d_tiny", densenet3d.densenet3d_tiny)
