"""ModelForge: a GPU admission scheduler on Temporal."""

__version__ = "0.1.0"
