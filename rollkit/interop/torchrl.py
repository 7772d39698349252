"""The former location of :mod:`rollkit.integrations.torchrl`, re-exported unchanged."""

from rollkit.integrations.torchrl import __all__, __getattr__  # noqa: F401
