"""Stage 1, data: sources become WebDataset shards (``shard_writer``, ``download``), shards become
batches (``shard`` reads them, ``loader`` streams them, ``transforms``/``batched_augment`` make
the images the towers see)."""
