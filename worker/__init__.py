"""Celery workers that join the training core (``training/``) to the run store (``app/``)."""
