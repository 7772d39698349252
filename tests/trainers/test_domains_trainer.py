"""Multi-domain RLVR in the trainers (issue 32): ``data.domains``, quotas per step, refills within
the domain, a verifier per domain routed by the prompt's tag, per-domain normalisation and
metrics, pass@k / mean@k evaluation, and resume of every domain's position.

Runs on the tiny Qwen2 + character tokenizer (1-digit addition as two or three domains, 1-3
steps); the verifiers chosen by name are real ones (exact match, the code sandbox) or test
doubles registered for the test (named ``test_*``).
"""

import copy
import dataclasses
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from rollkit.rewards import RunningRewardNormalizer, normalize_rewards
from trainers.config import load_config, validate
from trainers.data import Prompt
from trainers.domains import DomainIterator, build_domain_prompts, choice_task, formats_task, functions_task
from trainers.engines import HFRolloutEngine, TorchTrainEngine
from trainers.loops import AsyncTrainer, SyncTrainer
from trainers.models import char_tokenizer, tiny_qwen2
from trainers.rewards import VERIFIERS, get_verifier
from trainers.rewards.routing import DomainVerifier, domain_verifiers

BASE = [
    "--model",
    "tiny",
    "eval.before=false",
    "eval.every=0",
    "eval.max_tokens=3",
    "rollout.prompts_per_step=4",
    "rollout.n=2",
    "rollout.max_tokens=3",
    "train.micro_batch_size=8",
    "logging.progress=false",
]

TWO = {
    "a": {
        "task": "addition",
        "task_options": {"digits": 1},
        "eval_size": 6,
        "weight": 3,
        "verifier": "test_one",
    },
    "b": {
        "task": "addition",
        "task_options": {"digits": 1},
        "eval_size": 4,
        "weight": 1,
        "verifier": "test_zero",
    },
}


def _one(completion, prompt):
    return 1.0


def _zero(completion, prompt):
    return 0.0


class _Alternate:
    """1, 0, 1, ... per prompt: every group of two samples has one of each (never filtered)."""

    def __init__(self):
        self.calls = {}

    def __call__(self, completion, prompt):
        k = self.calls[prompt.text] = self.calls.get(prompt.text, -1) + 1
        return float(k % 2 == 0)


@pytest.fixture(autouse=True)
def doubles():
    """Two verifier doubles chosen by name: every sample scores 1 (``test_one``) or 0 (``test_zero``)."""
    VERIFIERS["test_one"], VERIFIERS["test_zero"], VERIFIERS["test_alternate"] = (
        (lambda: _one),
        (lambda: _zero),
        _Alternate,
    )
    yield
    for name in ("test_one", "test_zero", "test_alternate"):
        VERIFIERS.pop(name)


def cfg_of(tmp_path, domains, *overrides):
    return load_config(
        [*BASE, f"logging.dir={tmp_path / 'run'}", f"data.domains={json.dumps(domains)}", *overrides]
    )


def make(tmp_path, domains=TWO, *overrides, cls=SyncTrainer):
    cfg = cfg_of(tmp_path, domains, *overrides)
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    return cls(
        cfg,
        rollout=HFRolloutEngine(copy.deepcopy(model), tok),
        train=TorchTrainEngine(model, lr=1e-3),
        tokenizer=tok,
    )


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "domains, field",
    [
        ({"a": {"task": "addition", "weight": -1}}, "data.domains.a.weight"),
        ({"a": {"task": "addition", "weight": "x"}}, "data.domains.a.weight"),
        ({"a": {"task": "nope"}}, "data.domains.a.task"),
        ({"a": {"task": "addition", "colour": 1}}, "data.domains.a"),
        ({"a": {"task": "addition", "eval_size": 1.5}}, "data.domains.a.eval_size"),
        ({"a": {"task": "addition", "verifier_options": 3}}, "data.domains.a.verifier_options"),
        ({"a": {"task": "addition", "train_file": "x.jsonl"}}, "data.domains.a"),
        ({"a": {"train_file": "/no/such.jsonl"}}, "data.domains.a.train_file"),
        ({"a": {}}, "data.domains.a"),
        ({"a b": {"task": "addition"}}, "data.domains"),
        ([1, 2], "data.domains"),
    ],
)
def test_bad_domain_entries_raise_naming_the_field(tmp_path, domains, field):
    with pytest.raises(ValueError) as e:
        validate(cfg_of(tmp_path, domains))
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["eval.n=0"], "eval.n"),
        (["eval.n=4", "eval.temperature=0"], "eval.temperature"),
        (["eval.n=4", "eval.k=[5]"], "eval.k"),
        (["eval.n=4", "eval.k=[0]"], "eval.k"),
        (["eval.k=[1]"], "eval.k"),
        (["algorithm.batch_reward_norm=maybe"], "algorithm.batch_reward_norm"),
        (["tail_batching.enabled=true"], "tail_batching.enabled"),
    ],
)
def test_new_keys_reject_bad_values_by_name(tmp_path, overrides, field):
    with pytest.raises(ValueError) as e:
        validate(cfg_of(tmp_path, TWO, *overrides))
    assert str(e.value).startswith(field)


def test_task_options_and_verifier_errors_name_the_domain(tmp_path):
    cfg = cfg_of(tmp_path, {"a": {"task": "addition", "task_options": {"digits": 9}}})
    with pytest.raises(ValueError, match=r"^data\.domains\.a\.task_options: .*digits"):
        build_domain_prompts(cfg)
    cfg = cfg_of(tmp_path, {"a": {"task": "addition", "verifier": "no_such_verifier"}})
    with pytest.raises(ValueError, match=r"^data\.domains\.a\.verifier: .*no_such_verifier"):
        domain_verifiers(cfg)
    cfg = cfg_of(tmp_path, {"a": {"task": "addition", "verifier": "code", "verifier_options": {"colour": 1}}})
    with pytest.raises(ValueError, match=r"^data\.domains\.a\.verifier: .*colour"):
        domain_verifiers(cfg)


# --------------------------------------------------------------------------- data and routing


def test_records_are_tagged_and_a_records_own_tag_routes_it(tmp_path):
    f = tmp_path / "mixed.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "domain": "a" if i % 3 else "b"} for i in range(12)]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = cfg_of(tmp_path, {"a": {"eval_size": 2}, "b": {"eval_size": 1}}, f"data.train_file={f}")
    train, held = build_domain_prompts(cfg)
    assert sorted(p.domain for p in train + held) == sorted(r["domain"] for r in rows)
    assert [p.domain for p in held] == ["a", "a", "b"]
    # a record in domain c's own file tagged "a" is a's: its verifier, its quota
    g = tmp_path / "c.jsonl"
    g.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4", "domain": "a"}\n')
    cfg = cfg_of(
        tmp_path, {"a": {"task": "addition", "eval_size": 5}, "c": {"train_file": str(g), "eval_size": 0}}
    )
    train, _ = build_domain_prompts(cfg)
    assert {p.text: p.domain for p in train if p.text in ("1+1=", "2+2=")} == {"1+1=": "c", "2+2=": "a"}
    g.write_text('{"prompt": "1+1=", "answer": "2", "domain": "zzz"}\n')
    with pytest.raises(ValueError, match=r"data\.domains\.c\.train_file: .*zzz"):
        build_domain_prompts(cfg)


def test_domain_verifier_routes_each_record_to_its_domains_verifier(tmp_path):
    v = DomainVerifier({"a": _one, "b": _zero})
    assert [v("x", Prompt("q", "1", domain=d)) for d in ("a", "b", "a")] == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match=r"prompt\.domain: 'c'"):
        v("x", Prompt("q", "1", domain="c"))
    cfg = cfg_of(
        tmp_path,
        {
            "m": {"task": "addition", "verifier": "exact_match"},
            "c": {"task": "functions", "verifier": "code"},
        },
        "reward.code_timeout_s=7",
        "reward.code_mode=fraction",
    )
    dv = domain_verifiers(cfg)
    assert dv.verifiers["m"] is get_verifier("exact_match")
    assert (dv.verifiers["c"].timeout_s, dv.verifiers["c"].mode) == (7.0, "fraction")  # reward.* defaults
    cfg.data.domains["c"]["verifier_options"] = {"timeout_s": 3.0}
    assert domain_verifiers(cfg).verifiers["c"].timeout_s == 3.0  # the domain's own options win


def test_builtin_tasks_are_checked_by_their_verifiers():
    code = get_verifier("code", timeout_s=10.0)
    train, held = functions_task(eval_size=3, seed=1)
    for p in train[::40]:  # 8 of the 292 train prompts
        expr = json.loads(p.answer)["problem_id"].removeprefix("f(x)=")  # the reference expression
        assert code(f"```python\ndef f(x):\n    return {expr}\n```", p) == 1.0, expr
        assert code(f"```python\ndef f(x):\n    return {expr} + 1\n```", p) == 0.0, expr
    assert len(train) + len(held) == 295 and not {q.answer for q in train} & {q.answer for q in held}
    mc = get_verifier("multiple_choice") if "multiple_choice" in VERIFIERS else None
    c_train, _ = choice_task(eval_size=5, seed=0)
    q = c_train[0]
    text = q.text[0]["content"]
    nums = {line[0]: int(line[3:]) for line in text.splitlines() if line[1:3] == ") "}
    best = (max if "largest" in text else min)(nums, key=nums.get)
    assert q.answer == best
    if mc is not None:
        assert mc(f"The answer is {best}.", q) == 1.0
    f_train, f_held = formats_task(eval_size=10, seed=0)
    assert len(f_train) + len(f_held) == 24 * 13
    spec = json.loads(f_train[0].answer)
    assert len(spec["instruction_id_list"]) == len(spec["kwargs"]) == 1


# --------------------------------------------------------------------------- quotas, refills, resume


def test_each_step_draws_exact_quotas_and_refills_stay_in_the_domain(tmp_path):
    domains = {**TWO, "a": {**TWO["a"], "verifier": "test_alternate"}}
    tr = make(tmp_path, domains, "filter.zero_variance=true", "filter.max_rounds=3")
    try:
        for _ in range(2):
            m = tr.step()
            # weights 3:1 of 4 prompts: 3 of a (one 1 and one 0 per group: kept), 1 of b (all 0:
            # filtered); the 2 refill rounds draw b again (a draw from the next step's quotas
            # would start with a, which would be kept)
            assert (m["domain/a/kept_groups"], m["domain/a/filtered_groups"]) == (3, 0)
            assert (m["domain/b/kept_groups"], m["domain/b/filtered_groups"]) == (0, 3)
            assert m["rollout/rounds"] == 3
    finally:
        tr.close()


def test_step_metrics_per_domain(tmp_path):
    domains = {**TWO, "b": {**TWO["b"], "verifier": "exact_match"}}
    tr = make(tmp_path, domains)
    try:
        m = tr.step()
    finally:
        tr.close()
    for d in ("a", "b"):
        for key in ("reward", "accuracy", "response_length", "truncated_frac", "advantage_abs_mean", "samples",
                    "kept_groups", "filtered_groups", "reward_busy_s"):  # fmt: skip
            assert f"domain/{d}/{key}" in m, key
    assert m["domain/a/reward"] == m["domain/a/accuracy"] == 1.0
    assert (m["domain/a/samples"], m["domain/b/samples"]) == (6.0, 2.0)
    assert m["domain/a/advantage_abs_mean"] == 0.0  # all-equal groups: no advantage


def test_domain_iterator_resume_restores_every_domains_position():
    ps = [Prompt(f"{d}{i}", "0", domain=d) for d, k in (("x", 5), ("y", 7), ("z", 3)) for i in range(k)]
    it = DomainIterator(ps, ["x", "y", "z"], [0.5, 0.3, 0.2], 4, seed=3)
    it.next_batch(6)  # mid-step: part of the second step is still pending
    it.next_like([ps[0], ps[-1]])
    state = json.loads(json.dumps(it.state_dict()))  # plain values, as the checkpoint holds them
    want = [p.text for p in it.next_batch(13) + it.next_like(ps[4:9])]
    it2 = DomainIterator(ps, ["x", "y", "z"], [0.5, 0.3, 0.2], 4, seed=3)
    it2.load_state_dict(state)
    assert [p.text for p in it2.next_batch(13) + it2.next_like(ps[4:9])] == want
    it3 = DomainIterator(ps, ["x", "z", "y"], [0.5, 0.3, 0.2], 4, seed=3)
    with pytest.raises(ValueError, match="domains"):
        it3.load_state_dict(state)


def test_trainer_checkpoint_resumes_the_domains_draws(tmp_path):
    tr = make(tmp_path, TWO, "algorithm.reward_normalizer=true")
    try:
        tr.step()
        state = copy.deepcopy(tr.state_dict())
        want = [p.text for p in tr.iterator.next_batch(8)]
        norm = tr.update.domain_normalizers["a"].state_dict()
    finally:
        tr.close()
    tr2 = make(tmp_path, TWO, "algorithm.reward_normalizer=true")
    try:
        tr2.load_state_dict(state)
        assert [p.text for p in tr2.iterator.next_batch(8)] == want
        assert tr2.update.domain_normalizers["a"].state_dict() == norm
    finally:
        tr2.close()


# --------------------------------------------------------------------------- normalisation


@pytest.mark.parametrize("running, batch", [(True, False), (False, True), (True, True)])
def test_per_domain_normalisation_equals_the_primitive_on_each_domain_alone(tmp_path, running, batch):
    tr = make(tmp_path, TWO, f"algorithm.reward_normalizer={running}", f"algorithm.batch_reward_norm={batch}")
    tr.close()
    g = torch.Generator().manual_seed(0)
    domains = ["a", "b", "a", "c", "b", "a", "c", "c", "a"]
    refs = {d: RunningRewardNormalizer() for d in "abc"}
    for _ in range(3):  # running statistics carry over between steps, per domain
        r = torch.rand(len(domains), generator=g) * 4
        got = tr.update.normalize(r, domains)
        for d in "abc":
            sel = torch.tensor([x == d for x in domains])
            want = r[sel]
            if running:
                want = refs[d].normalize(want)
            if batch:
                want = normalize_rewards(want, level="batch")
            torch.testing.assert_close(got[sel], want, rtol=0, atol=0)


# --------------------------------------------------------------------------- evaluation


def test_pass_at_k_per_domain(tmp_path):
    tr = make(tmp_path, TWO, "eval.n=3", "eval.k=[1, 2, 3]", "eval.temperature=1.0")
    try:
        m = tr.evaluate()
    finally:
        tr.close()
    # test_one scores every sample of a, test_zero none of b: pass@k and mean@k are 1 and 0
    for k in (1, 2, 3):
        assert m[f"eval/domain/a/pass@{k}"] == m[f"eval/domain/a/mean@{k}"] == 1.0
        assert m[f"eval/domain/b/pass@{k}"] == m[f"eval/domain/b/mean@{k}"] == 0.0
        assert m[f"eval/pass@{k}"] == pytest.approx(6 / 10)  # 6 held-out prompts of a, 4 of b
    assert m["eval/domain/a/accuracy"] == 1.0 and m["eval/domain/b/accuracy"] == 0.0


def test_async_trainer_draws_the_same_quotas(tmp_path):
    overrides = ("asynchronous.enabled=true", "asynchronous.deterministic=true", "asynchronous.ratio=0")
    tr = make(tmp_path, TWO, *overrides, cls=AsyncTrainer)
    try:
        m = tr.step()
    finally:
        tr.close()
    # admitted one group at a time from the same stream of quotas: 3 groups of a, 1 of b
    assert (m["domain/a/samples"], m["domain/b/samples"]) == (6.0, 2.0)
    assert m["domain/a/reward"] == 1.0 and m["domain/b/reward"] == 0.0


def test_the_config_knows_every_builtin_task():
    from trainers.config import TASK_NAMES
    from trainers.domains import TASKS

    assert TASK_NAMES == tuple(TASKS)  # config.py checks names before trainers.domains loads
    from trainers.domains import CODE_FORMAT
    from trainers.rewards.code import FORMAT

    assert CODE_FORMAT == FORMAT  # the functions task writes the code verifier's format


def test_domain_verifier_runs_in_worker_processes(tmp_path):
    from trainers.rewards import RewardPool

    cfg = cfg_of(
        tmp_path,
        {
            "m": {"task": "addition", "verifier": "exact_match"},
            "c": {"task": "functions", "verifier": "code"},
        },
    )
    problem = functions_task(eval_size=1, seed=0)[0][0]
    samples = [
        ("so 7", Prompt("3+4=", "7", domain="m")),
        ("8", Prompt("3+4=", "7", domain="m")),
        (
            "```python\ndef f(x):\n    return " + json.loads(problem.answer)["problem_id"][5:] + "\n```",
            problem,
        ),
        ("def f(x):\n    return None", problem),
    ]
    with RewardPool(domain_verifiers(cfg), backend="process", num_workers=2, timeout_s=30.0) as pool:
        for k, (text, p) in enumerate(samples):
            pool.submit(k, text, dataclasses.replace(p, domain=p.domain or "c"))
        got = pool.gather()
        busy = pool.busy_by_domain()
    assert [got[k] for k in range(4)] == [1.0, 0.0, 1.0, 0.0]
    assert set(busy) == {"m", "c"} and busy["c"] > 0
