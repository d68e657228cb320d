"""clipkit: contrastive multimodal pretraining research toolkit."""

__version__ = "0.1.0"
