"""Built-in encoders (``register_encoders``): image towers (CLIP ViT, CLIP's modified ResNet, the
standard ResNet, a 3-D DenseNet, the ImageNet-pretrained EfficientNet-Lite0) and text towers
(CLIP's text Transformer, BERT-family).

Every built-in plugin kind is a package like this one: the hook lives in ``__init__`` and
imports the implementation modules inside the hook, so building the plugin manager (which
imports every built-in) does not import torch. Each name is registered with one
``register(name, factory)`` call, exactly as docs/plugins.md shows third-party plugins doing;
presets (``vit_b16``) are factories made with :func:`clipkit.contract.registry.preset`.
"""

from clipkit.contract.hookspecs import hookimpl


@hookimpl
def register_encoders(register):
    from clipkit.plugins.encoders import (
        bert,
        clip_resnet,
        densenet3d,
        efficientnet,
        resnet,
        text_transformer,
        vit,
    )

    register("vit", vit.vit)
    register("vit_b16", vit.vit_b16)
    register("vit_b32", vit.vit_b32)
    register("vit_tiny", vit.vit_tiny)
    register("text_transformer", text_transformer.text_transformer)
    register("clip_text", text_transformer.clip_text)
    register("text_transformer_tiny", text_transformer.text_transformer_tiny)
    register("clip_resnet", clip_resnet.clip_resnet)
    register("rn50", clip_resnet.rn50)
    register("rn101", clip_resnet.rn101)
    register("rn50x4", clip_resnet.rn50x4)
    register("rn_tiny", clip_resnet.rn_tiny)
    register("resnet", resnet.resnet)
    register("resnet50", resnet.resnet50)
    register("resnet18_cifar", resnet.resnet18_cifar)
    register("resnet_tiny", resnet.resnet_tiny)
    register("densenet3d", densenet3d.densenet3d)
    register("densenet3d_121", densenet3d.densenet3d_121)
    register("densenet3d_tiny", densenet3d.densenet3d_tiny)
    register("distilbert", bert.distilbert)
    register("distilbert_tiny", bert.distilbert_tiny)
    register("minilm_l6", bert.minilm_l6)
    register("efficientnet_lite0", efficientnet.efficientnet_lite0)
