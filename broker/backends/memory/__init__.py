"""The in-memory backend (one process, the embedded default); see ``backend`` for the design."""

from __future__ import annotations

from broker.backends.memory.backend import MemoryBackend

__all__ = ["MemoryBackend"]
