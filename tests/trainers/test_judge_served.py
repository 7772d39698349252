"""The served LLM judge (``JudgeReward(server_url=...)``, ``reward.judge_url``): its settings, its
deadline, the OpenAI-style answers it reads (a small stand-in server on the standard library),
and one real ``vllm serve`` of the tiny Qwen2 (CPU build; skipped without vLLM), whose
judgments equal the in-process judge's of the same weights.

Why they can be compared exactly: decoding is greedy on both sides, both run the same float32
weights (vLLM's processed log-probs agree with the trainer's to about 1e-6 on CPU,
test_server_engine.py), the judge prompt is the same plain text (the tiny model has no chat
template, so ``chat_template="auto"`` falls back to ``/v1/completions``, sent without special
tokens, as the in-process judge encodes it), and the character tokenizer decodes one character
per token on both sides. A near-tie between two logits could still split them; it has not here.
The tiny random model's judgments are noise (it repeats the prompt's last character until
``max_tokens``: every judgment is ``truncated``), so what is compared is the judgment text,
its parse and the counters, not a meaningful grade.
"""

import json
import os
import pickle
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytest.importorskip("transformers")

from trainers.config import load_config
from trainers.data import Prompt
from trainers.engines import HFRolloutEngine
from trainers.engines.vllm_server import ServerError, free_port
from trainers.models import char_tokenizer, save_model, tiny_qwen2
from trainers.rewards import RewardPool, get_verifier
from trainers.rewards.judge import DEFAULT_TIMEOUT_S, INVALID_REASONS, JudgeReward

Q = Prompt("12+34=", "46")
SAMPLES = [("46", Prompt("What is 12+34?", "46")), ("the sum is 45", Prompt("What is 12+34?", "46"))]

# --------------------------------------------------------------------------- settings


def test_served_judge_settings_are_checked_by_name():
    url = "http://127.0.0.1:1"
    tok = char_tokenizer()
    for kwargs, match in (
        ({"server_url": "127.0.0.1:8000"}, "server_url must look like http://host:port"),
        ({"server_url": 8000}, "server_url must look like"),
        ({"server_url": url, "model": "tiny"}, "judge_model: 'tiny' contradicts server_url"),
        ({"server_url": url, "engine": object()}, "engine: not used by a served judge"),
        ({"server_url": url, "tokenizer": tok}, "tokenizer: not used by a served judge"),
        ({"server_url": url, "device": "cuda"}, "device: not used by a served judge"),
        ({"server_url": url, "max_batch_size": 4}, "max_batch_size: not used by a served judge"),
        ({"server_url": url, "served_model": ""}, "served_model must be a non-empty str"),
        ({"server_url": url, "timeout_s": 0}, "timeout_s must be a finite number > 0"),
        ({"server_url": url, "timeout_s": float("inf")}, "timeout_s must be a finite number > 0"),
        ({"server_url": url, "timeout_s": True}, "timeout_s must be a finite number > 0"),
        ({"model": "tiny", "served_model": "judge"}, "served_model: only for a served judge"),
        ({"model": "tiny", "timeout_s": 5}, "timeout_s: only for a served judge"),
        ({"server_url": url, "max_tokens": 0}, "max_tokens must be an int >= 1"),
        ({}, "exactly one"),
    ):
        with pytest.raises(ValueError, match=match):
            JudgeReward(**kwargs)
    judge = JudgeReward(server_url=url + "/", model="")  # "": the config's default judge_model
    assert (judge.server_url, judge.model, judge.timeout_s) == (url, None, DEFAULT_TIMEOUT_S)


def test_served_judge_from_config_pickles_as_settings():
    cfg = load_config(
        ["reward.verifier=llm_judge", "reward.judge_url=http://127.0.0.1:1", "reward.judge_max_tokens=6"]
    )
    judge = get_verifier(cfg.reward.verifier, **cfg.reward.verifier_options())
    assert isinstance(judge, JudgeReward) and judge.server_url == "http://127.0.0.1:1"
    assert judge.model is None and judge.engine is None and judge.max_tokens == 6
    judge.setup()  # nothing to build, nothing asked
    assert judge.engine is None
    clone = pickle.loads(pickle.dumps(judge))
    assert (clone.server_url, clone.timeout_s, clone.max_tokens) == (judge.server_url, DEFAULT_TIMEOUT_S, 6)
    bad = load_config(["reward.verifier=llm_judge", "reward.judge_url=http://h:1", "reward.judge_model=tiny"])
    with pytest.raises(ValueError, match="judge_model: 'tiny' contradicts server_url"):
        get_verifier(bad.reward.verifier, **bad.reward.verifier_options())


# --------------------------------------------------------------------------- deadlines


def test_a_server_that_never_answers_raises_within_the_deadline_naming_the_url():
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        judge = JudgeReward(server_url=url, served_model="judge", timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(
            ServerError, match=f"llm judge: server {url}: POST /v1/.*timed out.*timeout_s=0.5"
        ):
            judge.score_batch([c for c, _ in SAMPLES], [p for _, p in SAMPLES])
        assert time.monotonic() - t0 < 5  # two requests, one deadline each, concurrently after the first
    assert judge.metrics()["judged"] == 0 and judge.last_judgments == []


def test_a_dead_url_scores_zero_in_a_reward_pool_as_an_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused at once
    judge = JudgeReward(server_url=url, timeout_s=2)
    with pytest.raises(ServerError, match=f"server {url}: GET /v1/models failed"):
        judge("46", Q)
    with RewardPool(judge, backend="inline", timeout_s=30) as pool:
        pool.submit("a", "46", Q)
        assert pool.gather() == {"a": 0.0}
        m = pool.metrics()
        assert m["errors"] == 1
        assert url in pool.recent_errors[-1]


# --------------------------------------------------------------------------- a stand-in server


class _Fake(BaseHTTPRequestHandler):
    """vLLM's answers, as the judge reads them: /v1/models, the chat endpoint (400 without a chat
    template) and the completions endpoint; each request's body is recorded."""

    models: ClassVar[list[str]] = ["judge"]
    chat = True
    seen: ClassVar[list] = []

    def log_message(self, *args):
        pass

    def _send(self, code, body):
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self._send(200, {"data": [{"id": m} for m in self.models] + [{"id": "lora", "parent": "judge"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.seen.append((self.path, body))
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        ok = "Fine.\nScore: 7" if "46" in text.split("[Response]")[1] else "Score: 1"
        if body["max_tokens"] < 4:
            ok, reason = "Sco", "length"
        else:
            reason = "stop"
        if self.path == "/v1/chat/completions":
            if not self.chat:
                self._send(
                    400,
                    {
                        "error": {
                            "message": "As of transformers v4.44, default chat template is no longer allowed"
                        }
                    },
                )
            else:
                self._send(
                    200,
                    {"choices": [{"message": {"role": "assistant", "content": ok}, "finish_reason": reason}]},
                )
        else:
            self._send(200, {"choices": [{"text": ok, "finish_reason": reason}]})


@pytest.fixture
def fake():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Fake.models, _Fake.chat, _Fake.seen = ["judge"], True, []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_served_judge_reads_chat_and_plain_answers(fake):
    completions, prompts = ["46", "45", "it is 46"], [Q] * 3
    judge = JudgeReward(server_url=fake, max_tokens=8)
    assert judge.score_batch(completions, prompts) == [0.7, 0.1, 0.7]
    assert judge.served_model == "judge"  # the base model of /v1/models (not its LoRA adapter)
    assert [p for p, _ in _Fake.seen] == ["/v1/chat/completions"] * 3
    body = _Fake.seen[0][1]
    assert body["messages"] == [{"role": "user", "content": judge.judge_prompt("46", Q)}]
    assert (body["model"], body["temperature"], body["max_tokens"], body["n"]) == ("judge", 0.0, 8, 1)
    m = judge.metrics()
    assert (m["judged"], m["valid"], m["invalid"]) == (3.0, 3.0, 0.0)
    # no chat template on the server: "auto" falls back to the plain prompt, once
    _Fake.chat, _Fake.seen = False, []
    plain = JudgeReward(server_url=fake, max_tokens=8, served_model="judge")
    assert plain.score_batch(completions, prompts) == [0.7, 0.1, 0.7]
    assert [p for p, _ in _Fake.seen] == ["/v1/chat/completions"] + ["/v1/completions"] * 3
    assert (
        _Fake.seen[1][1]["prompt"] == plain.judge_prompt("46", Q)
        and not _Fake.seen[1][1]["add_special_tokens"]
    )
    with pytest.raises(
        ServerError, match=f"server {fake}: POST /v1/chat/completions answered 400: .*chat template"
    ):
        JudgeReward(server_url=fake, chat_template="on")("46", Q)
    # a judgment cut at max_tokens is truncated, counted like in process
    cut = JudgeReward(server_url=fake, max_tokens=3, chat_template="off", invalid_score=-1.0)
    assert cut("46", Q) == -1.0 and cut.metrics()["invalid/truncated"] == 1.0
    _Fake.models = ["a", "b"]
    with pytest.raises(ServerError, match=r"serves \['a', 'b'\]; name the judge with served_model"):
        JudgeReward(server_url=fake)("46", Q)


# --------------------------------------------------------------------------- a real vllm serve

# head size 32: vLLM's CPU attention has no head size 16 (the tiny model's default)
MODEL_KW = {"hidden_size": 64, "heads": 2, "kv_heads": 1}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One ``vllm serve`` of the tiny Qwen2 (seed 0), its model and tokenizer."""
    pytest.importorskip("vllm")
    from trainers.engines.vllm_server import launch_servers, stop_servers

    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0, **MODEL_KW)
    root = tmp_path_factory.mktemp("judge")
    path = save_model(model, tok, root / "model")
    servers = launch_servers(path, 1, root / "run", max_model_len=512, startup_timeout_s=600)
    try:
        yield servers[0].url, model, tok
    finally:
        stop_servers(servers)


@pytest.mark.slow
def test_a_served_judge_judges_as_the_in_process_judge_of_the_same_weights(served):
    url, model, tok = served
    completions, prompts = [c for c, _ in SAMPLES], [p for _, p in SAMPLES]
    local = JudgeReward(HFRolloutEngine(model, tok), max_tokens=16, invalid_score=-1.0)
    remote = JudgeReward(server_url=url, max_tokens=16, invalid_score=-1.0, timeout_s=120)
    expected = local.score_batch(completions, prompts)
    got = remote.score_batch(completions, prompts)
    assert remote.served_model == "rollkit" and remote._served_chat is False  # no chat template: plain
    assert [(s, t) for s, t, _ in remote.last_judgments] == [(s, t) for s, t, _ in local.last_judgments]
    assert [j for *_, j in remote.last_judgments] == [j for *_, j in local.last_judgments]
    assert got == expected and remote.metrics() == local.metrics()
    m = remote.metrics()
    assert m["judged"] == 2 and m["valid"] + m["invalid"] == 2
    assert sum(m[f"invalid/{r}"] for r in INVALID_REASONS) == m["invalid"]
    # the random model repeats the prompt's last character (the default template ends with "."):
    # a template that ends with the response gives each sample its own judgment, so the
    # concurrent requests' answers are checked to come back in the samples' order
    kw = {"template": "{question}{response}", "max_tokens": 8, "chat_template": "off"}
    completions, prompts = ["46", "45", "x9"], [Q] * 3
    local, remote = (
        JudgeReward(HFRolloutEngine(model, tok), **kw),
        JudgeReward(server_url=url, timeout_s=120, **kw),
    )
    assert remote.score_batch(completions, prompts) == local.score_batch(completions, prompts)
    judgments = [t for _, t, _ in remote.last_judgments]
    assert judgments == [t for _, t, _ in local.last_judgments] and len(set(judgments)) == 3
    # pickled (no connection in its state), it judges the same in a worker process
    fresh = JudgeReward(server_url=url, max_tokens=16, invalid_score=-1.0, timeout_s=120)
    with RewardPool(fresh, backend="process", num_workers=1, timeout_s=120) as pool:
        for k, (c, p) in enumerate(SAMPLES):
            pool.submit(k, c, p)
        out = pool.gather()
        assert pool.metrics()["errors"] == 0
    assert [out[k] for k in range(len(SAMPLES))] == expected


def test_config_fields_reach_the_served_judge():
    from trainers.config import load_config, validate
    from trainers.rewards import get_verifier

    cfg = load_config(
        [
            "reward.verifier=llm_judge",
            "reward.judge_url=http://127.0.0.1:9",
            "reward.judge_timeout_s=2.5",
            "reward.judge_served_model=judge",
        ]
    )
    validate(cfg)
    judge = get_verifier(cfg.reward.verifier, **cfg.reward.verifier_options())
    assert (judge.server_url, judge.timeout_s, judge.served_model) == ("http://127.0.0.1:9", 2.5, "judge")
    cfg.reward.judge_timeout_s = 0.0
    with pytest.raises(ValueError, match=r"^reward\.judge_timeout_s must be > 0"):
        validate(cfg)
