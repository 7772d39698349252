"""Agents over HTTP: the OpenAI-compatible endpoint, token-exact recording, and training an
agent written with the plain ``openai`` package through real ``vllm serve`` processes.

The agent is a calculator-tool user: it asks the policy a multiplication (``"Q 3*7"``); a reply
``"C 3*7"`` calls the calculator, whose result goes back as a tool message (``"R 21"``); a
reply ``"A 21"`` answers (reward 1 if right). The fast tests run the endpoint over the
transformers engine; the training test (slow) over one vLLM server on CPU. An endpoint that
listens beyond loopback requires its bearer token.
"""

import copy
import os
import random
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytest.importorskip("transformers")
pytest.importorskip("openai")

import httpx
import openai
import torch

from rollkit.trajectory import build_trajectory
from trainers.config import AgenticConfig, load_config
from trainers.engines import Generation, HFRolloutEngine, SamplingParams
from trainers.engines.build import make_train_engine
from trainers.envs.http_agent import AgentEndpoint, ChatDriftError, ChatRecorder, collect_agent_episodes
from trainers.models import char_tokenizer, default_model_path, tiny_qwen2

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
from agent_http import calculator_agent  # the recipe's agent: the user's code

MODEL_KW = {"hidden_size": 64, "heads": 2, "kv_heads": 1}
RL_STEPS = 3


def talkative_agent(base_url, task, api_key="unused"):
    """Three calls whatever the answers (a tool message after each): multi-turn episodes even
    with a random policy."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=60, max_retries=0)
    messages = [{"role": "user", "content": f"Q {task[0]}*{task[1]}"}]
    for k in range(3):
        text = (
            client.chat.completions.create(model="rollkit", messages=messages, max_tokens=6)
            .choices[0]
            .message.content
        )
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": f"R {k}"}]
    return 0.5


def whole(tok, msgs):
    """The conversation rendered whole by the template and tokenised at once."""
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_recorder_extends_prompts_token_exact_with_a_chat_template():
    """Turn k+1's prompt ids extend turn k's prompt + sampled ids (SmolLM2's chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    rec = ChatRecorder(tok)
    assert rec.chat_template
    msgs = [{"role": "user", "content": "What is 3*7?"}]
    new, p0 = rec.prompt(msgs)
    assert p0 == whole(tok, msgs)
    ans = [*tok("C 3*7", add_special_tokens=False).input_ids, tok.convert_tokens_to_ids("<|im_end|>")]
    rec.record(msgs, new, Generation(0, p0, ans, [0.0] * len(ans), "stop"))
    msgs = [*msgs, {"role": "assistant", "content": "C 3*7"}, {"role": "user", "content": "R 21"}]
    new1, p1 = rec.prompt(msgs)
    assert p1[: len(p0) + len(ans)] == p0 + ans and p1 == p0 + ans + new1
    # the same conversation rendered whole gives the same ids here (no drift for this template)
    assert p1 == whole(tok, msgs)
    with pytest.raises(ChatDriftError, match="does not extend"):
        rec.prompt([{"role": "user", "content": "What is 3*8?"}, *msgs[1:]])


def test_endpoint_serves_an_openai_client_and_records_trajectories(tok):
    model = tiny_qwen2(tok, seed=0, **MODEL_KW)
    engine = HFRolloutEngine(model, tok)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    with AgentEndpoint(engine, tok, params=params, max_context=96) as ep:
        client = openai.OpenAI(base_url=ep.base_url("nope"), api_key="x", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["rollkit"]
        with pytest.raises(openai.NotFoundError, match="unknown session"):
            client.chat.completions.create(model="rollkit", messages=[{"role": "user", "content": "hi"}])
        tasks = [(3, 7), (4, 5)]
        assert len(collect_agent_episodes(ep, calculator_agent, tasks, group_size=2).episodes) == 4
        batch = collect_agent_episodes(ep, talkative_agent, tasks, group_size=2)
    assert batch.metrics["agent/errors"] == 0 and len(batch.episodes) == 4
    assert all(len(e.turns) == 3 and e.turns[-1].reward == 0.5 for e in batch.episodes)
    assert batch.group_ids == [0, 0, 1, 1]
    for e in batch.episodes:
        traj = build_trajectory(e.turns)
        ids = traj.input_ids.tolist()
        # the trajectory is the last prompt the engine saw plus the last answer, token for token
        for k, t in enumerate(e.turns):
            obs_start, start, end = traj.bounds[k].tolist()
            assert ids[obs_start:start] == list(t.obs_ids) and ids[start:end] == list(t.action_ids)
            assert not traj.response_mask[obs_start:start].any()  # the agent's / tool's tokens are masked
        assert int(traj.response_mask.sum()) == sum(len(t.action_ids) for t in e.turns)
    tb = batch.to_batch(max_context=96, pad_token_id=tok.pad_token_id)
    assert tb.response_mask.shape[0] == 4


def test_an_endpoint_beyond_loopback_requires_its_token(tok, capsys):
    """Bound to every interface (reached here over 127.0.0.1), the endpoint generates a token and
    says so in one line; a call without it, or with a wrong one, gets 401 and nothing is
    recorded; the real openai client with ``api_key=token`` works, and ``collect_agent_episodes``
    hands the token to agents that take an ``api_key`` argument. A loopback endpoint given a
    token requires it too; one without a token answers any caller (the tests above)."""
    engine = HFRolloutEngine(tiny_qwen2(tok, seed=0, **MODEL_KW), tok)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    msgs = [{"role": "user", "content": "Q 3*7"}]
    with AgentEndpoint(engine, tok, params=params, max_context=96, host="0.0.0.0") as ep:
        said = capsys.readouterr().err.strip().splitlines()
        assert ep.api_key and len(ep.api_key) >= 40
        assert len(said) == 1 and "beyond loopback" in said[0] and "AgentEndpoint.api_key" in said[0]
        assert ep.api_key not in said[0]
        sid = ep.open_session()
        base = f"http://127.0.0.1:{ep.port}/s/{sid}/v1"
        for key in ("unused", "not-" + ep.api_key):
            client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)
            with pytest.raises(openai.AuthenticationError, match="Authorization: Bearer"):
                client.chat.completions.create(model="rollkit", messages=msgs)
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        with httpx.Client(timeout=30) as http:  # no Authorization header at all
            raw = http.post(base + "/chat/completions", json={"model": "rollkit", "messages": msgs})
        assert raw.status_code == 401 and raw.headers["www-authenticate"] == "Bearer"
        assert raw.json()["error"]["code"] == 401
        s = ep._sessions[sid]
        assert s.recorder.turns == [] and s.errors == [] and s.calls == 0  # nothing recorded
        client = openai.OpenAI(base_url=base, api_key=ep.api_key, max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["rollkit"]
        reply = client.chat.completions.create(model="rollkit", messages=msgs)
        assert len(ep.close_session(sid).recorder.turns) == 1 and reply.choices[0].message.content is not None
        batch = collect_agent_episodes(ep, calculator_agent, [(3, 7)], group_size=2)
        assert batch.metrics["agent/errors"] == 0 and len(batch.episodes) == 2
        # an agent that takes no api_key never gets the token: its calls are refused
        batch = collect_agent_episodes(ep, lambda url, task: calculator_agent(url, task), [(3, 7)])
        assert batch.metrics["agent/errors"] == 1 and batch.episodes == []
    with AgentEndpoint(engine, tok, params=params, api_key="s3cret-token") as ep:  # loopback, a token given
        assert capsys.readouterr().err == ""
        root = f"{ep.url}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=root, api_key="unused", max_retries=0, timeout=30).models.list()
        assert openai.OpenAI(base_url=root, api_key="s3cret-token", max_retries=0, timeout=30).models.list()
    with pytest.raises(ValueError, match="api_key: expected a non-empty str"):
        AgentEndpoint(engine, tok, params=params, api_key="")


@pytest.mark.slow
def test_agent_trains_through_vllm_servers(tok, tmp_path):
    """A few RL steps of the openai-client agent through a real vLLM server (success before/after)."""
    pytest.importorskip("vllm")
    from trainers.engines.server_rollout import ServerRolloutEngine
    from trainers.loops import AgenticTrainer
    from trainers.models import save_model

    cfg = load_config(
        [
            "--model", "tiny", "model.tiny_heads=2", "model.tiny_kv_heads=1", "train.lr=5e-4",
            "rollout.groups_per_step=4", "rollout.group_size=4", "rollout.temperature=1.0",
            "rollout.max_tokens=8", "env.max_context=96", f"logging.dir={tmp_path}",
        ],
        base=AgenticConfig(),
    )  # fmt: skip
    model = tiny_qwen2(tok, seed=0, **MODEL_KW)
    train = make_train_engine(cfg, model, device="cpu")
    rng = random.Random(0)
    pairs = [(a, b) for a in range(2, 10) for b in range(2, 10)]
    # no warm-up here (the tiny model needs about 150 supervised steps, minutes on 2 cores, to use
    # the tool: recipes/agent_http.py does it); this test checks the plumbing of a training run
    path = save_model(copy.deepcopy(model), tok, tmp_path / "model")
    with ServerRolloutEngine.launch(
        path, num_servers=1, run_dir=tmp_path / "srv", tokenizer=tok, seeded=False
    ) as eng:
        eng.update_weights(train.export_weights(), version=0)
        params = SamplingParams(temperature=1.0, max_tokens=8)
        with AgentEndpoint(eng, tok, params=params, max_context=96) as ep:
            tr = AgenticTrainer(cfg, rollout_engine=eng, train_engine=train, tokenizer=tok)
            tr.collect = lambda: collect_agent_episodes(
                ep, calculator_agent, rng.sample(pairs, 4), group_size=4
            )
            greedy = SamplingParams(temperature=0.0, max_tokens=8)

            def success():
                return collect_agent_episodes(ep, calculator_agent, pairs[::3], params=greedy).metrics[
                    "agent/success_rate"
                ]

            before = success()
            hist = [tr.step() for _ in range(RL_STEPS)]
            after = success()
            tr.close()
        print(
            f"greedy success {before:.3f} -> {after:.3f}; train success",
            [round(h["agent/success_rate"], 2) for h in hist],
        )
        assert all(torch.isfinite(torch.tensor(h["loss/policy"])) for h in hist if "loss/policy" in h)
        assert eng.policy_version == RL_STEPS
        assert hist[-1]["agent/episodes"] == 16 and 0 <= after <= 1
