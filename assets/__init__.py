"""Small data and tiny weights made by our own scripts (see assets/README.md), shipped as ``gyremedia.assets``."""
