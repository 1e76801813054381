"""Runtime families: one module per Hugging Face model_type."""
