"""colibri_convert: Hugging Face checkpoint -> Colibri container, resumable, one module per model family."""
