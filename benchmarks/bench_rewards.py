"""Benchmark: generate-then-score vs streaming (score each sample as it finishes), side by side.

A tiny Qwen2 (:func:`trainers.models.tiny_qwen2`, hidden 128, 4 layers) samples ``--prompts`` x ``--n`` answers to
addition questions with :class:`~trainers.engines.HFRolloutEngine` (a sample stops at a digit
or a space, so lengths vary as real answers do, up to ``--tokens``). A toy verifier that costs
20 ms per sample (``--verify-ms``: ``time.sleep`` then the exact-match rule) scores them on a
:class:`~trainers.rewards.RewardPool` of ``--workers`` processes. Two ways, alternated over
``--repeats`` rounds on the same warm engine and pool, same seed (so the same samples):

* **sequential**: ``engine.generate(...)``, then submit every sample and ``gather()``;
* **streaming**: :func:`~trainers.rewards.rollout_and_score`: each sample is submitted the
  moment ``generate_iter`` yields it, so scoring overlaps the rest of the generation.

Prints the median seconds of each (rollout + reward) and the ratio sequential / streaming.
Streaming can save at most the smaller of the two costs (generation alone, scoring alone),
both printed for reference. ``--threads 1`` (the default) keeps torch's thread pool from
fighting the other processes of a busy machine, which makes CPU timings swing by several x.

    python benchmarks/bench_rewards.py            # about a minute on a laptop CPU
    python benchmarks/bench_rewards.py --quick    # under 30 s

Results are printed, not asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = Path(__file__).resolve().parent
try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from trainers.data import Prompt  # noqa: E402
from trainers.engines import HFRolloutEngine, SamplingParams  # noqa: E402
from trainers.models import char_tokenizer, tiny_qwen2  # noqa: E402
from trainers.rewards import RewardPool, exact_match_reward, rollout_and_score  # noqa: E402

VERIFY_S = 0.02


class SleepyVerifier:
    """exact match after ``seconds`` of sleep: stands in for a verifier that costs time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, completion: str, prompt: Prompt) -> float:
        time.sleep(self.seconds)
        return exact_match_reward(completion, prompt.answer)


def _verifier(seconds: float) -> SleepyVerifier:
    """The verifier as an instance of ``bench_rewards.SleepyVerifier``, a name that worker
    processes can import whether this file runs as a script or is loaded as a module."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import bench_rewards

    return bench_rewards.SleepyVerifier(seconds)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=48, help="the most tokens per sample")
    ap.add_argument("--workers", type=int, default=2, help="reward worker processes")
    ap.add_argument("--verify-ms", type=float, default=VERIFY_S * 1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128, help="tiny_qwen2 hidden size")
    ap.add_argument("--layers", type=int, default=4, help="tiny_qwen2 layers")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: steady timings on a shared machine)",
    )
    ap.add_argument("--quick", action="store_true", help="a small run, under 30 s")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.repeats = 16, 4, 3

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    tok = char_tokenizer()
    engine = HFRolloutEngine(tiny_qwen2(tok, hidden_size=args.hidden, layers=args.layers, seed=0), tok)
    questions = [Prompt(f"{a}+{b}=", str(a + b)) for a, b in zip(range(10, 99, 7), range(3, 90, 11))]
    questions = (questions * (args.prompts // len(questions) + 1))[: args.prompts]
    token_prompts = [tok(q.text).input_ids for q in questions]
    stops = tuple(tok.convert_tokens_to_ids(list("0123456789 ")))
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.tokens, stop_token_ids=stops, seed=0)

    def sequential(pool: RewardPool) -> list[float]:
        gens = engine.generate(token_prompts, params)
        for k, g in enumerate(gens):
            pool.submit(k, tok.decode(g.token_ids), questions[g.prompt_index])
        scores = pool.gather()
        return [scores[k] for k in range(len(gens))]

    def streaming(pool: RewardPool) -> list[float]:
        return rollout_and_score(engine, token_prompts, params, questions, pool, tok.decode)[1]

    verifier = _verifier(args.verify_ms / 1000)
    times: dict[str, list[float]] = {"sequential": [], "streaming": []}
    with RewardPool(verifier, backend="process", num_workers=args.workers, timeout_s=30) as pool:
        sequential(pool)  # warm-up: workers started, model caches warm
        gen_s = []
        ways = [("sequential", sequential), ("streaming", streaming)]
        for r in range(args.repeats):
            t0 = time.perf_counter()
            gens = engine.generate(token_prompts, params)
            gen_s.append(time.perf_counter() - t0)
            for name, fn in ways if r % 2 == 0 else ways[::-1]:  # alternate which goes first
                t0 = time.perf_counter()
                rewards = fn(pool)
                times[name].append(time.perf_counter() - t0)
                assert len(rewards) == len(gens)
        m = pool.metrics()
    n_samples = len(token_prompts) * args.n
    lengths = [len(g.token_ids) for g in gens]
    seq, stream = statistics.median(times["sequential"]), statistics.median(times["streaming"])
    gen = statistics.median(gen_s)
    print(
        f"tiny_qwen2 hidden {args.hidden} x {args.layers} layers, {args.threads} torch thread(s); "
        f"{n_samples} samples ({len(token_prompts)} prompts x {args.n}), lengths {min(lengths)}..{max(lengths)} "
        f"(mean {statistics.mean(lengths):.1f}), verifier {args.verify_ms:g} ms, {args.workers} worker processes, "
        f"median of {args.repeats}"
    )
    print(f"  generation alone      {gen:7.3f} s")
    print(f"  scoring alone (ideal) {n_samples * args.verify_ms / 1000 / args.workers:7.3f} s")
    print(f"  sequential            {seq:7.3f} s   (generate, then score)")
    print(f"  streaming             {stream:7.3f} s   (score as samples finish)")
    print(f"  ratio sequential / streaming: {seq / stream:.2f}x")
    print(
        f"  pool: scored {m['scored']:.0f}, errors {m['errors']:.0f}, queue high-water {m['queue_hwm']:.0f}"
    )
    return {"sequential_s": seq, "streaming_s": stream, "generation_s": gen, "ratio": seq / stream}


if __name__ == "__main__":
    main()
