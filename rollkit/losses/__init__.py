"""Losses: policy objectives (PPO family, off-policy, IPA's chunk-level ratio), KL, entropy, value, and aggregation;
distillation (:mod:`~rollkit.losses.distill`), preference (:mod:`~rollkit.losses.preference`)
and SFT (:mod:`~rollkit.losses.sft`) objectives.

Every loss returns a :class:`rollkit.types.LossOutput` whose ``loss`` is the ``[B, T]``
per-token matrix; :func:`aggregate` turns it into a scalar.

Registered by name (:mod:`rollkit.registry`): ``POLICY_LOSSES``, ``KL_ESTIMATORS``,
``AGGREGATIONS`` (write ``"loss_objective"``; optional ``"sample_weights"``), ``REGULARIZERS``
(``"kl"`` -> ``"kl_loss"``, ``"entropy"`` -> ``"entropy_loss"``), ``VALUE_LOSSES``
(``"clipped"`` -> ``"value_loss"``) and ``IS_CORRECTIONS`` (``"importance_weights"`` ->
``"is_weights"``, which ``"ppo"`` reads when present).
"""

from rollkit.losses.aggregation import *  # noqa: F403
from rollkit.losses.aggregation import __all__ as _agg_all
from rollkit.losses.distill import *  # noqa: F403
from rollkit.losses.distill import __all__ as _distill_all
from rollkit.losses.entropy import *  # noqa: F403
from rollkit.losses.entropy import __all__ as _ent_all
from rollkit.losses.ipa import *  # noqa: F403
from rollkit.losses.ipa import __all__ as _ipa_all
from rollkit.losses.kl import *  # noqa: F403
from rollkit.losses.kl import __all__ as _kl_all
from rollkit.losses.policy import *  # noqa: F403
from rollkit.losses.policy import __all__ as _policy_all
from rollkit.losses.preference import *  # noqa: F403
from rollkit.losses.preference import __all__ as _preference_all
from rollkit.losses.sft import *  # noqa: F403
from rollkit.losses.sft import __all__ as _sft_all
from rollkit.losses.value import *  # noqa: F403
from rollkit.losses.value import __all__ as _value_all

__all__ = [
    *_policy_all,
    *_ipa_all,
    *_kl_all,
    *_ent_all,
    *_value_all,
    *_agg_all,
    *_distill_all,
    *_preference_all,
    *_sft_all,
]
