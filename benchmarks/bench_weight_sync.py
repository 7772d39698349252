"""Seconds, bytes and extra memory of one weight sync: today's path vs buckets vs delta.

Side by side in one run, on the same local ``vllm serve`` processes (rollkit starts them; every
one has rollkit's weight-transfer backend), for each model and rollout dtype and for one and two
servers: the trainer (a torch engine, Adam at lr 1e-5) takes a real optimizer step on a random
batch, then the weights go to the servers with

- ``reload`` (today's path): one safetensors file every server re-reads;
- ``buckets``: streamed in ``--bucket-mb`` buckets over gloo behind vLLM's weight-transfer routes;
- ``delta``: the same, as sparse patches of the elements whose bits changed.

Each mode's first sync is not counted (buckets and delta open their gloo groups there, and delta
sends it dense).

Per mode: the median seconds per sync over ``--repeats`` steps, the bytes on the wire (the file's
size for reload, per server), the share of a dense update they are (``sync/delta_frac``), and the
extra resident memory a sync needs: the peak RSS during the sync minus the RSS just before it,
sampled every 5 ms, for the trainer's process and for the worst server process. The seconds
ratio is against reload (1.00). Printed, never asserted.

    python benchmarks/bench_weight_sync.py                               # smollm-135m and qwen2-0.5b, float32 and bfloat16
    python benchmarks/bench_weight_sync.py --models tiny --servers 1 --repeats 2   # a quick look

Models: ``tiny`` (the test model), ``smollm-135m`` (the embedded SmolLM2-135M-Instruct, GGUF Q4_1
dequantised), ``qwen2-0.5b`` / ``qwen2-1.5b`` (Qwen2's shapes, random weights, vocabulary 151936).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil  # noqa: E402
import torch  # noqa: E402

from trainers.engines import TorchTrainEngine  # noqa: E402
from trainers.engines.server_rollout import ServerRolloutEngine  # noqa: E402
from trainers.engines.vllm_server import launch_servers, stop_servers  # noqa: E402
from trainers.models import char_tokenizer, save_model, tiny_qwen2  # noqa: E402

QWEN2 = {  # Qwen2-0.5B / 1.5B shapes (config.json of the released models)
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2),
}


def build(name: str) -> tuple[torch.nn.Module, object]:
    """(model in float32, tokenizer)."""
    if name == "tiny":
        tok = char_tokenizer()
        return tiny_qwen2(tok, seed=0, heads=2, kv_heads=1), tok
    if name == "smollm-135m":
        from trainers.config import load_config
        from trainers.engines.build import build_model

        return build_model(load_config([]))
    if name in QWEN2:
        import transformers

        cfg = transformers.Qwen2Config(vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=512,
                                       rope_theta=1e6, **QWEN2[name])
        torch.manual_seed(0)
        return transformers.Qwen2ForCausalLM(cfg).float().eval(), char_tokenizer()
    raise SystemExit(f"--models: unknown model {name!r} (tiny, smollm-135m, qwen2-0.5b, qwen2-1.5b)")


class Peak:
    """Peak RSS of some processes (each with its children) while a block runs, sampled every 5 ms."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {k: psutil.Process(p) for k, p in pids.items()}

    def _rss(self) -> dict[str, int]:
        out = {}
        for k, p in self.procs.items():
            try:
                tree = [p, *p.children(recursive=True)] if k != "trainer" else [p]
                out[k] = sum(q.memory_info().rss for q in tree)
            except psutil.Error:
                out[k] = 0
        return out

    def __enter__(self) -> Peak:
        self.before = self._rss()
        self.peak = dict(self.before)
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.005):
                for k, v in self._rss().items():
                    self.peak[k] = max(self.peak[k], v)

        self._t = threading.Thread(target=sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        for k, v in self._rss().items():
            self.peak[k] = max(self.peak[k], v)

    def extra(self, key: str) -> float:
        return (self.peak[key] - self.before[key]) / 2**20


def rl_step(train: TorchTrainEngine, vocab: int, seed: int) -> None:
    """One real optimizer step: the mean log-likelihood of a random batch (4 x 32 tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (4, 32), generator=g)
    logits = train.model(input_ids=ids).logits.float()
    train.backward(-logits.log_softmax(-1).gather(-1, ids[..., None]).mean())
    train.step()


def bench(name: str, dtype: str, servers: int, repeats: int, bucket_mb: float, run: Path, sgd: bool = False) -> list[tuple]:
    model, tok = build(name)
    path = save_model(model, tok, run / "model")
    vocab = model.config.vocab_size
    # Adam (the RL optimizer: it moves every weight) or, with --sgd, plain SGD (no optimizer state:
    # 8 bytes per parameter less, for the rows that do not fit otherwise)
    factory = (lambda params: torch.optim.SGD(params, lr=1e-3)) if sgd else None
    train = TorchTrainEngine(model, lr=1e-5, optimizer_factory=factory)
    local = launch_servers(path, servers, run / "servers", dtype=dtype, max_model_len=256, startup_timeout_s=1800)
    rows = []
    try:
        urls = [s.url for s in local]
        pids = {"trainer": os.getpid(), **{f"server{i}": s.process.pid for i, s in enumerate(local)}}
        seed = 0
        for mode in ("reload", "buckets", "delta"):
            eng = ServerRolloutEngine(urls, tokenizer=None, model_path=path, dtype=dtype, weights_dir=run / "w",
                                      weight_sync=mode, weight_bucket_mb=bucket_mb, request_timeout_s=1800)
            try:
                # a first sync, not counted: buckets and delta open their groups, delta sends it dense
                eng.update_weights(train.export_weights(), version=seed)
                secs, extra_t, extra_s, nbytes, frac = [], [], [], [], []
                for _ in range(repeats):
                    seed += 1
                    rl_step(train, vocab, seed)
                    with Peak(pids) as peak:
                        t0 = time.perf_counter()
                        eng.update_weights(train.export_weights(), version=seed)
                        secs.append(time.perf_counter() - t0)
                    extra_t.append(peak.extra("trainer"))
                    extra_s.append(max(peak.extra(f"server{i}") for i in range(servers)))
                    m = eng.metrics()
                    if mode == "reload":
                        size = (run / "w" / "model.safetensors").stat().st_size
                        nbytes.append(size)
                        frac.append(1.0)
                    else:
                        nbytes.append(m["sync/bytes"] / servers)
                        frac.append(m["sync/delta_frac"])
                rows.append((name, dtype, servers, mode, statistics.median(secs), statistics.median(nbytes) / 2**20,
                             statistics.median(frac), max(extra_t), max(extra_s)))
            finally:
                eng.shutdown()
    finally:
        stop_servers(local)
    return rows


def main(argv: list[str] | None = None) -> list[tuple]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm-135m,qwen2-0.5b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--servers", default="1,2", help="comma-separated numbers of servers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--threads", type=int, default=0, help="the trainer's torch threads (0: as is)")
    ap.add_argument("--sgd", action="store_true", help="SGD (lr 1e-3) instead of Adam (lr 1e-5): less memory")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[tuple] = []
    print(f"command: python benchmarks/bench_weight_sync.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"cpu: {cpu_name()}, {os.cpu_count()} cores; bucket {args.bucket_mb:g} MiB; median of {args.repeats} syncs; "
          f"{'SGD lr 1e-3' if args.sgd else 'Adam lr 1e-5'}")
    print(f"{'model':<12} {'dtype':<9} {'srv':>3} {'mode':<8} {'s/sync':>8} {'ratio':>6} {'MiB/srv':>9} {'frac':>6} "
          f"{'+RSS trainer MiB':>17} {'+RSS server MiB':>16}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rollkit-bench-sync-") as tmp:
        for name in args.models.split(","):
            for dtype in args.dtypes.split(","):
                for k in (int(x) for x in args.servers.split(",")):
                    run = Path(tmp) / f"{name}-{dtype}-{k}"
                    new = bench(name, dtype, k, args.repeats, args.bucket_mb, run, args.sgd)
                    base = new[0][4]  # reload's seconds
                    for n, dt, kk, mode, s, mib, frac, xt, xs in new:  # printed as measured
                        print(f"{n:<12} {dt:<9} {kk:>3} {mode:<8} {s:>8.3f} {s / base:>6.2f} {mib:>9.1f} {frac:>6.3f} "
                              f"{xt:>17.0f} {xs:>16.0f}", flush=True)
                    rows += new
    return rows


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
