"""colibri_runtime: the lean runtime that memory-maps a Colibri container and runs the model."""
