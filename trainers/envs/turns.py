"""Turns: from text episodes to token turns, the tokenizer-facing side of :mod:`rollkit.trajectory`.

A multi-turn rollout must train on *exactly* the tokens the model sampled and saw. Decoding the
actions to text and re-tokenizing the whole conversation afterwards does not guarantee that
(a tokenizer may merge characters across the action / observation boundary differently), so
the context here is built **incrementally in token space**: the model's action tokens are kept
as sampled, and only each new observation is encoded and appended. Then
``build_trajectory(episode.turns).input_ids[:bounds[k, 1]]`` *is* the context of turn ``k``.

:class:`TurnEncoder` encodes observations, with or without the tokenizer's chat template;
:func:`run_episode` plays one episode of an :class:`~trainers.envs.base.Env` with a policy
``generate(context_ids, max_new_tokens) -> (action_ids, logprobs)`` (:func:`engine_policy`
adapts a :class:`~trainers.engines.base.RolloutEngine`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollkit.trajectory import Turn
from trainers.envs.base import Env, stable_state_id

__all__ = ["Episode", "TurnEncoder", "engine_policy", "run_episode"]

Policy = Callable[[list[int], int], tuple[Sequence[int], Sequence[float]]]


class TurnEncoder:
    """Observation text -> the token ids appended to the context.

    Args:
        tokenizer: a Hugging Face tokenizer.
        chat_template: wrap observations as user messages with the tokenizer's chat template
            (``None``: when the tokenizer has one). Later observations are encoded as the
            *difference* the template adds after an assistant message (the end-of-turn glue
            the model did not write itself, the user message, the generation prompt).
        system_prompt: a system message for the first prompt (chat template only).
        separator: plain mode: the text between turns (``"obs\\n" act "\\nobs\\n" act ...``).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: bool | None = None,
        system_prompt: str | None = None,
        separator: str = "\n",
    ) -> None:
        self.tokenizer = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template and not has_template:
            raise ValueError("chat_template: the tokenizer has no chat template")
        self.chat_template = has_template if chat_template is None else bool(chat_template)
        self.system_prompt = system_prompt
        self.separator = separator

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _render(self, messages: list[dict[str, str]], gen: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def prompt_ids(self, observation: str) -> list[int]:
        """Turn 0: the whole initial prompt."""
        if not self.chat_template:
            return self._encode(observation + self.separator)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return self._encode(self._render([*messages, {"role": "user", "content": observation}], True))

    def obs_ids(self, observation: str, previous_action: Sequence[int]) -> list[int]:
        """A later turn: what follows the model's ``previous_action`` tokens."""
        if not self.chat_template:
            return self._encode(self.separator + observation + self.separator)
        base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        before = self._render(base, False)
        after = self._render([*base, {"role": "user", "content": observation}], True)
        if not after.startswith(before):
            raise ValueError(
                "chat_template: the template re-renders earlier turns; incremental encoding is impossible"
            )
        closing = before[before.rindex("A") + 1 :]  # e.g. "<|im_end|>\n" after an assistant message
        last = self.tokenizer.decode(list(previous_action)[-1:]) if len(previous_action) else ""
        if last and closing.startswith(last):  # the model already wrote the end-of-turn token
            closing = closing[len(last) :]
        return self._encode(closing + after[len(before) :])


@dataclass
class Episode:
    """One played episode: :class:`~rollkit.trajectory.Turn` s for ``build_trajectory`` and the
    text transcript.

    ``terminated`` / ``truncated`` are the environment's last flags; ``context_full`` says the
    episode was stopped because the next observation would not fit in ``max_context``.
    """

    turns: list[Turn] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    context_full: bool = False
    infos: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total_reward(self) -> float:
        return sum(t.reward for t in self.turns)


def engine_policy(engine: Any, params: Any) -> Policy:
    """A :func:`run_episode` policy from a rollout engine and its ``SamplingParams`` (``n=1``);
    ``max_tokens`` is capped by the room left in the context."""
    if getattr(params, "n", 1) != 1:
        raise ValueError(f"params.n: one sample per turn, got n={params.n}")

    def generate(context: list[int], room: int) -> tuple[list[int], list[float]]:
        p = dataclasses.replace(params, max_tokens=max(1, min(params.max_tokens, room)))
        g = engine.generate([context], p)[0]
        return list(g.token_ids), list(g.logprobs)

    return generate


def run_episode(
    env: Env,
    policy: Policy,
    encoder: TurnEncoder,
    *,
    seed: int | None = None,
    max_turns: int | None = None,
    max_context: int | None = None,
) -> Episode:
    """Play one episode; the turns hold exactly the sampled tokens (module docstring).

    Each turn: ``state_id = stable_state_id(env.state_key())`` of the state the model acts
    from, ``action_ids, logprobs = policy(context, room)`` (``room``: tokens left before
    ``max_context``), the action decoded without special tokens is ``env.step``-ed. The
    episode ends when the environment says so, after ``max_turns`` turns, or when the next
    observation would leave no room for an action (``context_full``).
    """
    obs, info = env.reset(seed=seed)
    ep = Episode(observations=[obs], infos=[info])
    obs_ids = encoder.prompt_ids(obs)
    context: list[int] = list(obs_ids)
    limit = max_context if max_context is not None else 1 << 62
    for _ in range(max_turns if max_turns is not None else 1 << 62):
        if len(context) >= limit:
            ep.context_full = True
            break
        state_id = stable_state_id(env.state_key())
        action_ids, logprobs = policy(list(context), limit - len(context))
        action_ids = list(action_ids)[: limit - len(context)]
        logprobs = list(logprobs)[: len(action_ids)]
        text = encoder.tokenizer.decode(action_ids, skip_special_tokens=True)
        obs, reward, terminated, truncated, info = env.step(text)
        ep.turns.append(Turn(obs_ids, action_ids, logprobs, reward=float(reward), state_id=state_id))
        ep.actions.append(text)
        ep.observations.append(obs)
        ep.infos.append(info)
        ep.terminated, ep.truncated = bool(terminated), bool(truncated)
        if terminated or truncated:
            break
        obs_ids = encoder.obs_ids(obs, action_ids)
        context += action_ids
        if len(context) + len(obs_ids) >= limit:  # no room for the next action
            ep.context_full = True
            break
        context += obs_ids
    return ep
