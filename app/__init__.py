"""Collage's web app, REST API and command line."""
