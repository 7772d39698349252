"""Former home of the framework adapters, now in :mod:`rollkit.integrations` (``rollkit.interop.torchrl`` re-exports ``rollkit.integrations.torchrl``)."""
