"""rollkit losses and advantage estimators inside TRL, verl, OpenRLHF and torchrl.

One module per framework; each imports its framework lazily (inside the functions that need
it), so importing ``rollkit.integrations.*`` needs only rollkit's core. Every adapter reads the
framework's own settings and refuses, with a one-line ``ValueError`` naming the setting, what
rollkit cannot honour. The guide, with the mapping tables and the tested versions, is
``docs/integrations.md``.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

from rollkit.registry import POLICY_LOSSES

__all__ = ["require"]

PINS = {"trl": "trl==1.16.0", "verl": "verl==0.9.1", "openrlhf": "openrlhf==0.11.2"}

# rollkit hyper-parameters that each adapter derives from the framework's own settings
CLIP_KEYS = ("clip_low", "clip_high", "dual_clip")


def require(module: str) -> ModuleType:
    """Import a framework module lazily, or raise a one-line ImportError naming the install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise ImportError(f"{module} is needed here: pip install {PINS.get(top, top)} ({e})") from e


def loss_params(name: str) -> dict[str, inspect.Parameter]:
    """The keyword parameters of rollkit's policy loss ``name`` (``ValueError`` if unknown)."""
    return dict(inspect.signature(POLICY_LOSSES.get(name)).parameters)


def uses_behavior(name: str) -> bool:
    """Whether the rollkit loss ``name`` takes the rollout engine's log-probs."""
    return "behavior_logprobs" in POLICY_LOSSES.entry(name).in_keys


def clip_hyper(
    name: str,
    hyper: dict[str, Any],
    *,
    low: float | None,
    high: float | None,
    dual: float | None,
    settings: tuple[str, str, str],
) -> dict[str, Any]:
    """rollkit keywords ``hyper`` plus the framework's clip range mapped onto loss ``name``.

    ``settings`` names the framework's (low, high, dual) settings for the error messages. The
    clip keywords come from the framework only: passing them in ``hyper`` is refused, and so
    is a dual clip for a loss that has none.
    """
    given = sorted(set(hyper) & set(CLIP_KEYS))
    if given:
        raise ValueError(
            f"{given[0]}: set it through the framework's {', '.join(settings)}, not as a rollkit keyword"
        )
    params = loss_params(name)
    out = dict(hyper)
    if "clip_low" in params and low is not None:
        out["clip_low"] = low
    if "clip_high" in params and high is not None:
        out["clip_high"] = high
    if dual is not None:
        if "dual_clip" not in params:
            raise ValueError(
                f"{settings[2]}={dual}: rollkit's {name!r} has no dual clip (unset it or use 'ppo')"
            )
        out["dual_clip"] = dual
    return out
