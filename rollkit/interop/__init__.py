"""Interop with other RL libraries (optional dependencies, imported lazily)."""
