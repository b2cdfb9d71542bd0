"""ModelForge: a GPU admission scheduler on Temporal."""

__version__ = "0.2.0"
