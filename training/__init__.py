"""Collage's multi-image GRPO/RLOO training core: a library that knows nothing of the app or the workers."""
