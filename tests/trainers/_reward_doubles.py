"""Verifiers for the RewardPool tests, in a module of their own so that worker processes
(forkserver / spawn) and Ray actors can import them by name.

``scripted`` follows instructions written in the completion, so one verifier exercises every
failure mode; anything else is scored by the real ``exact_match`` rule.
"""

import os
import threading
import time
import uuid

from trainers.rewards import exact_match


def scripted(completion, prompt):
    """``sleep:S:R`` sleeps S seconds then returns R; ``wait:PATH:R`` returns R once PATH exists
    (the test releases it; at most 120 s); ``raise``; ``exit`` (the process dies); ``started:PATH``
    (creates PATH, then hangs); ``nan``; ``main-thread?`` (1.0 on the main thread, else 0.0); else
    ``exact_match``."""
    if completion.startswith("sleep:"):
        _, s, r = completion.split(":")
        time.sleep(float(s))
        return float(r)
    if completion.startswith("wait:"):
        _, path, r = completion.split(":")
        end = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < end:
            time.sleep(0.01)
        return float(r)
    if completion.startswith("started:"):  # tell the test that scoring began, then hang
        open(completion.split(":", 1)[1], "w").close()
        time.sleep(60)
        return 1.0
    if completion == "raise":
        raise RuntimeError("verifier failed on purpose")
    if completion == "exit":
        os._exit(3)
    if completion == "nan":
        return float("nan")
    if completion == "main-thread?":
        return 1.0 if threading.current_thread() is threading.main_thread() else 0.0
    return exact_match(completion, prompt)


def sleep_20ms(completion, prompt):
    """A toy rule that costs 20 ms per sample (the benchmark's verifier)."""
    time.sleep(0.02)
    return exact_match(completion, prompt)


class FailingSetup:
    """A verifier whose per-worker setup fails (e.g. a missing model file)."""

    def setup(self):
        raise RuntimeError("cannot load the reward model")

    def __call__(self, completion, prompt):
        return 1.0


class BatchScripted:
    """A verifier with ``score_batch`` (the pool hands it batches of up to 3): each sample scores
    ``len(completion)``; ``sleep`` in a batch makes it take 6 s, ``exit`` kills the process.

    ``setup`` waits for a token: a file the test puts in the directory ``gate`` (each worker
    takes one, at most 120 s after it starts), so that the samples the test submits before
    giving the token are queued, whatever the machine's speed, when the worker asks for its
    first batch (``add_tokens``)."""

    batch_size = 3

    def __init__(self, gate):
        self.gate = str(gate)

    def setup(self):
        end = time.monotonic() + 120
        while time.monotonic() < end:
            for name in sorted(os.listdir(self.gate)):
                try:
                    os.unlink(os.path.join(self.gate, name))  # taken by this worker alone
                    return
                except FileNotFoundError:  # another worker took it first
                    continue
            time.sleep(0.01)

    @staticmethod
    def add_tokens(gate, n):
        """Let ``n`` more workers finish their setup."""
        for _ in range(n):
            open(os.path.join(str(gate), uuid.uuid4().hex), "w").close()

    def score_batch(self, completions, prompts):
        if "exit" in completions:
            os._exit(3)
        if "sleep" in completions:
            time.sleep(6)
        return [float(len(c)) for c in completions]

    def __call__(self, completion, prompt):
        return self.score_batch([completion], [prompt])[0]
