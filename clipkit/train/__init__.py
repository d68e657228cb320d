"""Stage 2, training: ``loop`` (the one loop), ``objective`` (the loss pass), ``accumulate``
(exact gradient accumulation), ``build`` (everything the loop touches, from a recipe),
``checkpoint``; ``runtime/`` is the only package that knows about processes, DeepSpeed and
precision."""
