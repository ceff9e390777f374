"""gyremedia: a plugin-based reinforcement-learning trainer for generative media models."""

import pluggy

__version__ = "0.1.0"

#: Marker for hook implementations: ``@gyremedia.hookimpl def gyremedia_register_rewards(register): ...``
hookimpl = pluggy.HookimplMarker("gyremedia")

__all__ = ["hookimpl", "__version__"]
