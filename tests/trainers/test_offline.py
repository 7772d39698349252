"""Offline SFT and DPO (trainers.loops.offline) on the tiny Qwen2 + character tokenizer, CPU.

Data: 1-digit addition pairs (trainers.data_pairs.addition_pairs): chosen the right sum,
rejected a wrong one.
"""

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch

from trainers.config import load_config
from trainers.data import addition_task
from trainers.data_pairs import Example, Pair, addition_pairs, addition_pairs_file, load_examples, load_pairs
from trainers.engines import TorchTrainEngine
from trainers.loops.offline import OfflineConfig, OfflineTrainer
from trainers.models import char_tokenizer, tiny_qwen2


@pytest.fixture(scope="module")
def records():
    train, _ = addition_task(digits=1, eval_size=20, seed=0)
    return addition_pairs(train, seed=0)


def make(records, loss, *overrides, lr=1e-3, optimizer=None, n=None):
    cfg = load_config(
        [
            "--model",
            "tiny",
            f"offline.loss={loss}",
            "offline.batch_size=32",
            "train.micro_batch_size=16",
            *overrides,
        ],
        base=OfflineConfig(),
    )
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0)
    kw = {"optimizer_factory": optimizer} if optimizer else {"lr": lr}
    train = TorchTrainEngine(model, grad_clip=None, **kw)
    recs = records[:n] if n else records
    if loss == "sft":
        data = [Example(r["prompt"], r["chosen"]) for r in recs]
    else:
        data = [Pair(r["prompt"], r["chosen"], r["rejected"]) for r in recs]
    return OfflineTrainer(cfg, train=train, tokenizer=tok, train_data=data, eval_data=data[:20])


def test_sft_lowers_its_loss(records):
    tr = make(records, "sft", lr=3e-3)
    before = tr.evaluate(tr.train_data)["eval/loss"]
    ms = [tr.step() for _ in range(6)]
    after = tr.evaluate(tr.train_data)["eval/loss"]
    for k in ("loss", "entropy", "num_tokens", "grad_norm", "learning_rate", "epoch"):
        assert k in ms[0], k
    assert ms[-1]["loss"] < ms[0]["loss"]
    assert after < before - 0.5, (before, after)


def test_dpo_raises_margin_and_preference(records):
    tr = make(records, "dpo", "offline.beta=0.1")
    before = tr.evaluate(tr.train_data)
    ms = [tr.step() for _ in range(8)]
    after = tr.evaluate(tr.train_data)
    for k in (
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
    ):
        assert k in ms[0], k
    # the reference is the initial policy: step 0's implicit rewards are 0, the loss log 2
    assert abs(ms[0]["loss"] - 0.6931) < 1e-3 and abs(ms[0]["rewards/margins"]) < 1e-5
    assert after["eval/loss"] < before["eval/loss"] - 0.02, (before, after)
    assert after["eval/rewards/margins"] > before["eval/rewards/margins"] + 0.03
    assert after["eval/rewards/accuracies"] > before["eval/rewards/accuracies"] + 0.3
    # the policy now gives the chosen answer the higher sequence log-prob on more pairs
    assert after["eval/accuracy"] > before["eval/accuracy"] + 0.1, (
        before["eval/accuracy"],
        after["eval/accuracy"],
    )


@pytest.mark.parametrize("loss", ["sft", "dpo", "orpo"])
def test_step_gradient_does_not_depend_on_the_micro_batch_split(records, loss):
    """One SGD step with 1 micro-batch of 12 and with micro-batches of 5 (5 + 5 + 2): same weights."""
    sgd = lambda p: torch.optim.SGD(p, lr=0.5)  # noqa: E731
    runs = []
    for mbs in (12, 5):
        tr = make(
            records, loss, f"train.micro_batch_size={mbs}", "offline.batch_size=12", optimizer=sgd, n=24
        )
        w0 = [p.detach().clone() for p in tr.train.model.parameters()]
        m = tr.step()
        runs.append((m, [p.detach().clone() for p in tr.train.model.parameters()], w0))
    (m1, w1, w0), (m2, w2, _) = runs
    assert abs(m1["loss"] - m2["loss"]) < 1e-5
    moved = max(float((a - b).abs().max()) for a, b in zip(w1, w0))
    assert moved > 1e-4
    for a, b in zip(w1, w2):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_fit_writes_metrics_and_model(records, tmp_path):
    tr = make(records, "dpo", f"logging.dir={tmp_path}", "train.steps=2", "logging.progress=false", n=40)
    out = tr.fit()
    assert out["steps"] == 2 and out["accuracy_after"] is not None
    rows = [json.loads(line) for line in open(out["metrics_file"])]
    assert any("rewards/margins" in r for r in rows)
    assert (tmp_path / "model" / "config.json").exists()


def test_pairs_file_round_trip(tmp_path):
    train_f, eval_f = addition_pairs_file(tmp_path, digits=1, seed=0)
    pairs = load_pairs(train_f, field="data.train_file")
    assert len(pairs) == 80 and all(p.chosen != p.rejected for p in pairs)
    assert all(int(p.chosen) == sum(int(x) for x in p.prompt[:-1].split("+")) for p in pairs)
    ex = load_examples(eval_f, field="data.eval_file")
    assert len(ex) == 20 and ex[0].completion == load_pairs(eval_f)[0].chosen


@pytest.mark.parametrize(
    "content, loader, message",
    [
        (None, load_pairs, "data.train_file: no such file: "),
        ('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{not json\n', load_pairs, "line 2 is not JSON"),
        (
            '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "1+2=", "rejected": "4"}\n',
            load_pairs,
            "line 2: 'chosen' must be a string, got missing",
        ),
        ('{"chosen": "2", "rejected": "3"}\n', load_pairs, "line 1 has no 'prompt' field"),
        ('{"prompt": "1+1=", "rejected": "3"}\n', load_examples, "line 1 has no completion field"),
        ("", load_pairs, "holds no records"),
    ],
)
def test_bad_files_give_one_line_errors(tmp_path, content, loader, message):
    f = tmp_path / "pairs.jsonl"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ValueError) as e:
        loader(f, field="data.train_file")
    msg = str(e.value)
    assert "\n" not in msg and message in msg and str(f) in msg, msg


def test_bad_config_and_missing_file_name_the_field(records):
    with pytest.raises(
        ValueError, match=r"^offline.loss must be one of sft, dpo, ipo, simpo, orpo, rm, got 'kto'$"
    ):
        make(records, "kto")
    cfg = load_config(
        ["--model", "tiny", "offline.loss=dpo", "--data", "/nonexistent/p.jsonl"], base=OfflineConfig()
    )
    with pytest.raises(ValueError, match=r"^data.train_file: no such file: /nonexistent/p.jsonl$"):
        OfflineTrainer(cfg)


def _recipe():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
    import sft_dpo

    return sft_dpo


def test_recipe_runs_sft_then_dpo_from_its_model(tmp_path):
    sft_dpo = _recipe()
    common = ["train.steps=2", "logging.progress=false", "eval.every=0", "logging.tensorboard=false"]
    out = sft_dpo.main([f"logging.dir={tmp_path / 'sft'}", *common])
    assert out["steps"] == 2 and (tmp_path / "sft" / "data" / "train.jsonl").exists()
    out = sft_dpo.main(
        [f"logging.dir={tmp_path / 'dpo'}", "offline.loss=dpo", "--model", out["model_dir"], *common]
    )
    assert out["accuracy_after"] is not None


def test_recipe_bad_input_is_one_line(tmp_path):
    sft_dpo = _recipe()
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "1+2=", "chosen": 3}\n')
    for argv, message in (
        (["offline.loss=kto"], "error: offline.loss must be one of"),
        (
            ["--data", str(bad), "offline.loss=dpo"],
            f"error: data.train_file: {bad} line 2: 'chosen' must be a string",
        ),
        (
            ["--data", str(tmp_path / "none.jsonl")],
            f"error: data.train_file: no such file: {tmp_path / 'none.jsonl'}",
        ),
    ):
        with pytest.raises(SystemExit) as e:
            sft_dpo.main(argv)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
