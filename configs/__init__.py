"""Runnable yaml configs, shipped inside the package as ``gyremedia.configs``."""
