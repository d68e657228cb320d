"""Built-in encoders (``register_encoders``): image towers (CLIP ViT, CLIP's modified ResNet, the
standard ResNet, a 3-D DenseNet) and text towers (CLIP's text Transformer, BERT-family).

Every built-in plugin kind is a package like this one: the hook lives in ``__init__`` and
imports the implementation modules inside the hook, so building the plugin manager (which
imports every built-in) does not import torch. Presets are data: each implementation module
exposes ``ENCODERS`` (registered name -> factory), presets made with :func:`clipkit.registry.preset`.
"""

from clipkit.hookspecs import hookimpl


@hookimpl
def register_encoders(register):
    from clipkit.plugins.encoders import bert, clip_resnet, densenet3d, resnet, text_transformer, vit

    for module in (vit, text_transformer, clip_resnet, resnet, densenet3d, bert):
        for name, factory in module.ENCODERS.items():
            register(name, factory)
