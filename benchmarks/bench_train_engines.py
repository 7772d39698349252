"""Benchmark: time per training step of DeepSpeedTrainEngine (ZeRO-0/2/3) and FSDP2TrainEngine vs TorchTrainEngine.

One process, CPU, float32, the same tiny Qwen2 (:func:`trainers.models.tiny_qwen2`; default
hidden 64, 2 layers, about 80 thousand parameters), the same batch (``--batch`` rows of a
``--prompt``-token prompt and a ``--response``-token response) split into ``--micro``
micro-batches. A step is what the trainer does: ``logprobs`` + ``backward`` per micro-batch,
then ``step`` (AdamW). After ``--warmup`` untimed steps, the median of ``--steps`` timed
steps per engine; the engines take turns step by step, so machine load affects them alike.
Prints seconds per step and the ratio to TorchTrainEngine. Results are printed, not asserted.

    python benchmarks/bench_train_engines.py            # about a minute
    python benchmarks/bench_train_engines.py --quick    # smoke run, well under 30 s

DeepSpeed runs in this process on its CPU accelerator over a one-process gloo group (the
engine sets ``DS_ACCELERATOR=cpu`` when there is no GPU); FSDP2 (``fully_shard``) shares it. Without deepspeed installed only
the TorchTrainEngine line is printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

try:
    import trainers  # noqa: F401
except ImportError:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def make_batch(vocab: int, batch: int, prompt: int, response: int, seed: int = 0):
    from trainers.engines.base import pack

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, vocab, (batch, prompt), generator=g).tolist()
    responses = torch.randint(4, vocab, (batch, response), generator=g).tolist()
    return pack(prompts, responses, pad_token_id=0)


def one_step(engine, b, micro: int) -> None:
    from rollkit.losses import aggregate, global_normalizers

    norms = global_normalizers(b.response_mask)
    B = b.input_ids.shape[0]
    size = -(-B // micro)
    for lo in range(0, B, size):
        mb = b[lo : lo + size]
        lp = engine.logprobs(mb.input_ids, mb.attention_mask, mb.response_mask)
        engine.backward(aggregate(-lp, mb.response_mask, "token-mean", **norms))
    engine.step()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=24)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--stages", default="0,2,3", help="ZeRO stages to time, comma-separated")
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    a = p.parse_args(argv)
    if a.quick:
        a.batch, a.micro, a.warmup, a.steps = 8, 2, 1, 3

    from trainers.engines import TorchTrainEngine
    from trainers.models import char_tokenizer, tiny_qwen2

    tok = char_tokenizer()

    def model():
        return tiny_qwen2(tok, hidden_size=a.hidden, layers=a.layers, seed=0)

    engines = {"TorchTrainEngine": TorchTrainEngine(model(), lr=1e-4)}
    if importlib.util.find_spec("deepspeed") is not None:
        from trainers.engines.deepspeed_train import DeepSpeedTrainEngine

        for s in (int(x) for x in a.stages.split(",")):
            engines[f"DeepSpeed ZeRO-{s}"] = DeepSpeedTrainEngine(model(), zero_stage=s, lr=1e-4)
    else:
        print("deepspeed is not installed: only TorchTrainEngine and FSDP2 are timed")
    from trainers.engines.fsdp2_train import FSDP2TrainEngine

    engines["FSDP2"] = FSDP2TrainEngine(model(), lr=1e-4)
    b = make_batch(len(tok), a.batch, a.prompt, a.response)
    params = sum(p.numel() for p in model().parameters())
    times: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(a.warmup + a.steps):
        for name, e in engines.items():
            t0 = time.perf_counter()
            one_step(e, b, a.micro)
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["TorchTrainEngine"])
    print(
        f"tiny Qwen2: {params / 1e3:.0f}K params, batch {a.batch} x ({a.prompt} + {a.response}) tokens, "
        f"{a.micro} micro-batches, AdamW, float32, {torch.get_num_threads()} threads, "
        f"median of {a.steps} steps"
    )
    print(f"{'engine':<20} {'s/step':>9} {'vs torch':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<20} {med:>9.4f} {med / base:>8.2f}x")


if __name__ == "__main__":
    main()
