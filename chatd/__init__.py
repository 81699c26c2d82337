"""chatd: a session-aware chat backend."""

__version__ = "0.1.0"
