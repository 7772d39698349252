"""Rewards routed by domain: one verifier per ``data.domains`` entry, chosen by the prompt's tag.

:class:`DomainVerifier` is itself a verifier ``(completion, prompt) -> float``: it hands each
sample to ``verifiers[prompt.domain]``, so the reward pool (inline, worker processes or Ray
actors) scores a multi-domain batch as it scores one domain, each sample as soon as it finishes.
:func:`domain_verifiers` builds the verifiers of a config's domains by name, each with its
options (a domain's options default to the ``reward.*`` settings of its verifier).

>>> from trainers.data import Prompt
>>> from trainers.rewards.verifiers import exact_match
>>> v = DomainVerifier({"math": exact_match, "echo": lambda c, p: float(c == p.answer)})
>>> v("7", Prompt("3+4=", "7", domain="math")), v("hi", Prompt("say hi", "hi", domain="echo"))
(1.0, 1.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from rollkit.registry import UnknownNameError
from trainers.config import Config, domain_specs
from trainers.data import Prompt
from trainers.rewards.verifiers import Verifier, get_verifier

__all__ = ["DomainVerifier", "domain_verifiers"]


class DomainVerifier:
    """Score each sample with the verifier of its prompt's domain (module docstring).

    Args:
        verifiers: domain name -> verifier. A prompt whose ``domain`` is not a key raises
            ``ValueError`` naming it (the reward pool counts an error and scores 0).

    ``setup()`` sets up every verifier that has a ``setup`` (pool workers call it once);
    picklable when the verifiers are, so it runs in process and Ray reward pools.
    """

    def __init__(self, verifiers: Mapping[str, Verifier]) -> None:
        if not verifiers:
            raise ValueError("verifiers: expected at least one domain")
        for name, v in verifiers.items():
            if not callable(v):
                raise TypeError(
                    f"verifiers[{name!r}]: expected a verifier (completion, prompt) -> float, got {type(v).__name__}"
                )
        self.verifiers = dict(verifiers)

    def setup(self) -> None:
        for v in self.verifiers.values():
            if callable(getattr(v, "setup", None)):
                v.setup()

    def __call__(self, completion: str, prompt: Prompt) -> float:
        v = self.verifiers.get(prompt.domain)
        if v is None:
            raise ValueError(
                f"prompt.domain: {prompt.domain!r} has no verifier (domains: {', '.join(self.verifiers)})"
            )
        return v(completion, prompt)


def domain_verifiers(cfg: Config) -> DomainVerifier | None:
    """The :class:`DomainVerifier` of ``cfg.data.domains`` (``None`` without domains). Each
    domain's ``verifier`` (``""``: ``reward.verifier``) is built by
    :func:`~trainers.rewards.verifiers.get_verifier` with the ``reward.*`` options of that
    verifier (``reward.code_timeout_s``, ``reward.judge_model``, ...) overridden by the domain's
    ``verifier_options``; a bad name or option raises naming ``data.domains.<name>``."""
    specs = domain_specs(cfg)
    if not specs:
        return None
    out = {}
    for s in specs:
        name = s.verifier or cfg.reward.verifier
        defaults = dataclasses.replace(cfg.reward, verifier=name).verifier_options()
        try:
            out[s.name] = get_verifier(name, **{**defaults, **s.verifier_options})
        except (UnknownNameError, TypeError, ValueError) as e:
            raise ValueError(f"data.domains.{s.name}.verifier: {e}") from None
    return DomainVerifier(out)
