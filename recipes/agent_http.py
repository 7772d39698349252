r"""Train an agent written with the plain ``openai`` client, through rollkit's HTTP endpoint and
``vllm serve`` processes: greedy success rate before, RL, success rate after.

The agent (:func:`calculator_agent`) is ordinary OpenAI-client code: it asks the policy a
multiplication (``"Q 3*7"``); a reply ``"C 3*7"`` calls its calculator tool, whose result goes
back as a tool message (``"R 21"``); a reply ``"A 21"`` answers, reward 1 if right. rollkit
serves ``/v1/chat/completions`` to it (:class:`trainers.envs.http_agent.AgentEndpoint`),
records every call token-exact, forwards it to the servers
(:class:`trainers.engines.server_rollout.ServerRolloutEngine`) and trains the episodes with the
agentic loop (StarPO advantages + PPO by default; ``algorithm.advantage=gigpo`` works too).

With no arguments: the tiny Qwen2 (character tokenizer), a supervised warm-up on the expert's
episodes (built token-exact by the same recorder) that leaves it partly able to use the tool,
one local ``vllm serve`` process on CPU, then ``train.steps`` (12) RL steps at ``train.lr=2e-4``
(5e-4 lowered the success rate in 8 steps: 0.36 -> 0.18 greedy, measured).

    python recipes/agent_http.py
    VLLM_API_KEY=... python recipes/agent_http.py --servers http://127.0.0.1:8000   # servers already running
    python recipes/agent_http.py --num-servers 2 algorithm.advantage=gigpo

docs/server.md ("Agents over HTTP") has the measured run.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from trainers.config import AgenticConfig, load_config, server_addresses
from trainers.deps import require
from trainers.engines import Generation, SamplingParams
from trainers.engines.build import make_train_engine
from trainers.engines.server_rollout import ServerRolloutEngine
from trainers.envs.calculator import format_number, safe_eval
from trainers.envs.http_agent import AgentEndpoint, ChatRecorder, collect_agent_episodes
from trainers.learner import nll_loss
from trainers.loops import AgenticTrainer
from trainers.models import char_tokenizer, save_model, tiny_qwen2

PAIRS = [(a, b) for a in range(2, 10) for b in range(2, 10)]
EVAL = PAIRS[::3]


def calculator_agent(
    base_url: str, task: tuple[int, int], *, max_calls: int = 3, api_key: str = "unused"
) -> float:
    """The user's agent: an ``openai`` client, a calculator tool, reward 1 for the right answer.
    ``api_key``: the endpoint's bearer token, which ``collect_agent_episodes`` passes when the
    endpoint requires one (it listens beyond loopback); a loopback endpoint ignores it."""
    openai = require("openai")
    client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=120, max_retries=0)
    messages = [{"role": "user", "content": f"Q {task[0]}*{task[1]}"}]
    for _ in range(max_calls):
        reply = client.chat.completions.create(model="rollkit", messages=messages, max_tokens=8)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        if m := re.fullmatch(r"\s*A\s*(-?\d+)\s*", text):
            return float(int(m.group(1)) == task[0] * task[1])
        if m := re.fullmatch(r"\s*C\s*([\d*+\- ]+)\s*", text):
            try:
                result = format_number(safe_eval(m.group(1)))
            except ValueError:
                result = "error"
            messages.append({"role": "tool", "tool_call_id": "calc", "content": f"R {result}"})
            continue
        return 0.0
    return 0.0


def expert_examples(tok, tasks):
    """``(context ids, action ids + EOS)`` of the expert's turns, in the endpoint's token layout."""
    contexts, actions = [], []
    for a, b in tasks:
        rec = ChatRecorder(tok)
        msgs = [{"role": "user", "content": f"Q {a}*{b}"}]
        for text, reply in ((f"C {a}*{b}", f"R {a * b}"), (f"A {a * b}", None)):
            new, prompt = rec.prompt(msgs)
            ids = [*tok(text, add_special_tokens=False).input_ids, tok.eos_token_id]
            contexts.append(prompt)
            actions.append(ids)
            rec.record(msgs, new, Generation(0, prompt, ids, [0.0] * len(ids), "stop"))
            msgs = [*msgs, {"role": "assistant", "content": text}]
            if reply:
                msgs.append({"role": "tool", "content": reply})
    return contexts, actions


def warmup(train, tok, steps: int, lr: float, seed: int) -> float:
    """Supervised warm-up on the expert's episodes with an AdamW of its own; returns the last loss."""
    rng = random.Random(seed)
    params = [p for p in train.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    loss_v = float("nan")
    for _ in range(steps):
        ctx, act = expert_examples(tok, rng.sample(PAIRS, 16))
        loss = nll_loss(train, ctx, act, tok.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_v = float(loss.detach())
    return loss_v


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="", help="comma-separated http://host:port of running servers")
    ap.add_argument("--num-servers", type=int, default=1, help="local servers to start (without --servers)")
    ap.add_argument("--warmup-steps", type=int, default=250)
    ap.add_argument("--warmup-lr", type=float, default=3e-3)
    ap.add_argument(
        "--run-dir", default="", help="servers' logs, model and weight files (default: a temp dir)"
    )
    args, overrides = ap.parse_known_args(argv)
    base = [
        "--model", "tiny", "model.tiny_heads=2", "model.tiny_kv_heads=1", "train.lr=2e-4",
        "train.steps=12", "rollout.groups_per_step=6", "rollout.group_size=4", "rollout.temperature=1.0",
        "rollout.max_tokens=8", "env.max_context=96", "logging.dir=runs/agent_http",
    ]  # fmt: skip
    cfg = load_config([*base, *overrides], base=AgenticConfig())
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=cfg.seed, hidden_size=64, heads=2, kv_heads=1)
    train = make_train_engine(cfg, model, device="cpu")
    t0 = time.perf_counter()
    loss = warmup(train, tok, args.warmup_steps, args.warmup_lr, cfg.seed)
    print(
        f"warm-up: {args.warmup_steps} steps, loss {loss:.3f}, {time.perf_counter() - t0:.0f} s", flush=True
    )
    run = Path(args.run_dir or tempfile.mkdtemp(prefix="rollkit-agent-http-"))
    path = save_model(copy.deepcopy(model), tok, run / "model")
    if args.servers:
        eng = ServerRolloutEngine(
            server_addresses(args.servers), tokenizer=tok, model_path=path, seeded=False
        )
    else:
        eng = ServerRolloutEngine.launch(
            path, num_servers=args.num_servers, run_dir=run, tokenizer=tok, seeded=False
        )
    rng = random.Random(cfg.seed)
    r = cfg.rollout
    params = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_tokens=r.max_tokens)
    greedy = SamplingParams(temperature=0.0, max_tokens=r.max_tokens)
    with eng, AgentEndpoint(eng, tok, params=params, max_context=cfg.env.max_context) as ep:
        eng.update_weights(train.export_weights(), version=0)
        trainer = AgenticTrainer(cfg, rollout_engine=eng, train_engine=train, tokenizer=tok)
        # the agentic loop's episodes come from the HTTP agent instead of an environment
        trainer.collect = lambda: collect_agent_episodes(
            ep, calculator_agent, rng.sample(PAIRS, r.groups_per_step), group_size=r.group_size
        )

        def success(p: SamplingParams, n: int) -> float:
            batch = collect_agent_episodes(ep, calculator_agent, EVAL, params=p, group_size=n)
            return batch.metrics["agent/success_rate"]

        before, sampled_before = success(greedy, 1), success(params, 4)
        print(
            f"success before RL: greedy {before:.3f}, sampled {sampled_before:.3f} ({len(EVAL)} tasks)",
            flush=True,
        )
        times = []
        for k in range(cfg.train.steps):
            m = trainer.step()
            times.append(m["time/step"])
            print(
                f"step {k + 1}: train success {m['agent/success_rate']:.3f}, reward {m['reward/mean']:.3f}, "
                f"turns {m['agent/turns_mean']:.2f}, {m['time/step']:.1f} s",
                flush=True,
            )
        after, sampled_after = success(greedy, 1), success(params, 4)
        trainer.close()
        s_step = sum(times) / max(len(times), 1)
        print(
            f"success after RL: greedy {after:.3f}, sampled {sampled_after:.3f}; {s_step:.1f} s/step",
            flush=True,
        )
        print(eng.metrics())
    return {
        "before": before,
        "after": after,
        "sampled_before": sampled_before,
        "sampled_after": sampled_after,
        "s_per_step": s_step,
    }


if __name__ == "__main__":
    main()
