"""Tools the model calls during a multi-turn rollout, and the environments that hold a rollout's state."""
