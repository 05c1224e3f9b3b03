"""Core-attention backends of the trainer, one module each."""
