"""Built-in interop (``read_model``, ``convert_model``): plain CLIP models in the layouts
researchers already have — open_clip directories, OpenAI/open_clip-layout ``.safetensors`` state
dicts, Hugging Face ``CLIPModel`` directories — read into clipkit and written back
(:mod:`.layouts`; key maps in :mod:`.keys`, shapes in :mod:`.spec`, formats in :mod:`.open_clip`
and :mod:`.hf`). Neither open_clip nor transformers is imported; no pickle is ever loaded.

Which plugins convert (the rest have no plain-CLIP counterpart; docs/interop.md):
encoders vit*, text_transformer*, clip_text (output cls/eos, no weight head), clip_resnet, rn*;
tokenizer clip_bpe; similarity dot (no bias). Hugging Face CLIPModel has no ResNet image tower.
"""

from clipkit.contract.hookspecs import hookimpl


@hookimpl(trylast=True)
def read_model(path, registry, options):
    from clipkit.plugins.interop import layouts

    return layouts.read_foreign(path, registry, options)


@hookimpl(trylast=True)
def convert_model(source, out, layout, registry, options):
    from pathlib import Path

    from clipkit.plugins.interop import layouts

    if layout not in layouts.LAYOUTS:
        return None
    return layouts.convert(
        Path(source),
        Path(out),
        layout,
        registry,
        quick_gelu=options.get("quick_gelu"),
        overwrite=bool(options.get("overwrite", False)),
    )
