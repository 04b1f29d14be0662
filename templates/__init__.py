"""The dashboard's Jinja2 pages, shipped as package data of ``collage.templates``."""
