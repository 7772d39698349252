"""rollkit reference trainers (Ray actors, rollout and training engines, sync/async loops).

This layer imports heavy backends (ray, vllm, deepspeed, transformers) only where they are
used; :func:`trainers.deps.require` turns a missing backend into an error naming the extra.
"""
