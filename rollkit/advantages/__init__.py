"""Advantage estimators: token-level (GAE, discounted returns, REINFORCE++), outcome /
group-relative (GRPO, Dr.GRPO, LitePPO, RLOO, ReMax, OPO, GPG, pass@k, ReBN) and step-level
for agents (GiGPO, StarPO, IPA's chunk-level returns).

Every estimator is a pure, vectorised function over tensors; the registry
:data:`rollkit.registry.ADVANTAGE_ESTIMATORS` lists them by name.
"""

from rollkit.advantages.agentic import *  # noqa: F403
from rollkit.advantages.agentic import __all__ as _agentic_all
from rollkit.advantages.gae import *  # noqa: F403
from rollkit.advantages.gae import __all__ as _gae_all
from rollkit.advantages.ipa import *  # noqa: F403
from rollkit.advantages.ipa import __all__ as _ipa_all
from rollkit.advantages.outcome import *  # noqa: F403
from rollkit.advantages.outcome import __all__ as _outcome_all

__all__ = [*_gae_all, *_outcome_all, *_agentic_all, *_ipa_all]
