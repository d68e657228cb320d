"""Built-in convolutional image encoders: CLIP's modified ResNet (:mod:`.clip_resnet`) and the
standard ResNet (:mod:`.resnet`).

Only the hook lives here; the implementations are imported inside it so that importing this
module (the plugin manager always does) does not import torch. Each implementation module exposes
``ENCODERS`` (registered name -> factory); to add one, import it in the hook and append it to the
tuple.
"""

from clipkit.hookspecs import hookimpl


@hookimpl
def register_encoders(register):
    from clipkit.plugins import clip_resnet, resnet

    for module in (clip_resnet, resnet):
        for name, factory in module.ENCODERS.items():
            register(name, factory)
