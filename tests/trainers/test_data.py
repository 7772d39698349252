"""Prompts (JSONL, Parquet, procedural addition), encoding, the iterator."""

import importlib.util
import json

import pytest

pytest.importorskip("transformers")

from trainers.data import (
    Prompt,
    PromptIterator,
    addition_task,
    encode_prompt,
    load_prompts,
)
from trainers.models import char_tokenizer


def test_addition_splits_are_disjoint_and_seeded():
    train, held = addition_task(digits=2, eval_size=100, seed=0)
    assert len(train) + len(held) == 90 * 90 and len(held) == 100
    assert not {p.text for p in train} & {p.text for p in held}
    assert addition_task(digits=2, eval_size=100, seed=0)[1] == held
    assert addition_task(digits=2, eval_size=100, seed=1)[1] != held
    p = held[0]
    a, b = p.text[:-1].split("+")
    assert int(a) + int(b) == int(p.answer) and p.data_source == "addition_2d"
    with pytest.raises(ValueError, match="digits"):
        addition_task(digits=5)
    with pytest.raises(ValueError, match="eval_size"):
        addition_task(digits=1, eval_size=100)


def test_jsonl_verl_fields(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [
        {"prompt": "1+1=", "answer": "2", "data_source": "toy"},
        {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}},
        {"prompt": "3+3=", "ground_truth": 6},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ps = load_prompts(f)
    assert ps[0] == Prompt("1+1=", "2", "toy")
    assert ps[1].answer == "4" and ps[1].data_source == "default" and isinstance(ps[1].text, list)
    assert ps[2].answer == "6"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 1: no answer"):
        load_prompts(bad)
    with pytest.raises(ValueError, match="no such file"):
        load_prompts(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match=r"\.jsonl or \.parquet"):
        (tmp_path / "x.csv").write_text("a")
        load_prompts(tmp_path / "x.csv")


def test_parquet(tmp_path):
    f = tmp_path / "d.parquet"
    if importlib.util.find_spec("pyarrow") is None:
        f.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pyarrow"):
            load_prompts(f)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "1+2=", "answer": "3", "data_source": "s"}]), f)
    assert load_prompts(f) == [Prompt("1+2=", "3", "s")]


def test_encode_plain_for_char_tokenizer():
    tok = char_tokenizer()
    ids = encode_prompt(tok, Prompt("12+34=", "46"))
    assert tok.decode(ids) == "12+34="
    with pytest.raises(ValueError, match="chat_template"):
        encode_prompt(tok, Prompt("1+1=", "2"), "maybe")


def test_iterator_is_checkpointable():
    it = PromptIterator(list(range(7)), seed=3)
    first = it.next_batch(10)  # crosses an epoch
    assert sorted(first[:7]) == list(range(7))
    state = it.state_dict()
    rest = it.next_batch(9)
    it2 = PromptIterator(list(range(7)), seed=3)
    it2.load_state_dict(state)
    assert it2.next_batch(9) == rest
    with pytest.raises(ValueError, match="items"):
        PromptIterator([])


def test_datasets_directory_and_hub_names_as_prompt_data(tmp_path, monkeypatch):
    """data.train_file may be a ``datasets`` directory (save_to_disk; a DatasetDict's split by
    data.train_split / eval_split) or a hub dataset name (offline here: one line saying why)."""
    datasets = pytest.importorskip("datasets")
    from trainers.config import load_config, validate
    from trainers.data import build_prompts, load_prompts

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "data_source": "add"} for i in range(6)]
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:4]), "test": datasets.Dataset.from_list(rows[4:])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    cfg = load_config(
        ["--model", "tiny", f"data.train_file={tmp_path / 'dd'}", f"data.eval_file={tmp_path / 'dd'}"]
    )
    validate(cfg)
    train, held = build_prompts(cfg)
    assert [p.answer for p in train] == ["1", "2", "3", "4"] and [p.answer for p in held] == ["5", "6"]
    with pytest.raises(ValueError, match=r"^data\.train_file: could not load the dataset .* no split 'dev'"):
        load_prompts(tmp_path / "dd", field="data.train_file", split="dev")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # datasets and huggingface_hub read these once, at their import: set their flags too, or a
    # process that imported them earlier tries the network (and waits on its retries)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(pytest.importorskip("huggingface_hub.constants"), "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ValueError, match=r"^data\.train_file: could not load the dataset 'nobody/no-such-set'"
    ):
        load_prompts("nobody/no-such-set", field="data.train_file")
