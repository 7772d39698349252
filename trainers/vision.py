"""Images in prompts: loading, the processor path, the model inputs the engines carry, a tiny VLM.

Modality lives at the edges (``docs/vision.md``). A prompt with images is encoded by the model's
own processor (``AutoProcessor``: its chat template and image processor) into

* the token ids, with each image's placeholder already **expanded** to the image's tokens
  (Qwen2-VL: ``<|vision_start|>`` + ``(t * h * w) / merge**2`` x ``<|image_pad|>`` +
  ``<|vision_end|>``), and
* the image inputs of the model's forward (Qwen2-VL: ``pixel_values`` ``[patches, C * t * p * p]``
  and ``image_grid_thw`` ``[images, 3]``),

held together by :class:`ImagePrompt`, a ``list[int]`` of the ids that also carries the images
and their inputs. Everything that handles token ids keeps working on it (the loops, the request
queues, :func:`trainers.engines.base.pack`); the engines that can take images look for the
inputs (:func:`image_inputs`) and hand them to the model: the transformers rollout engine
(prefill), vLLM (``multi_modal_data``), the training engines' forward (``inputs=``), the
reference. The samples' :class:`~trainers.engines.base.PackedBatch` keeps each row's inputs
(``batch.images``) and :func:`collate` joins a micro-batch's rows.

Positions: a model with multimodal rotary positions (Qwen2-VL's M-RoPE: temporal / height /
width ids for image tokens) gets them from its own ``get_rope_index`` through
:func:`position_ids` (``[3, B, L]``); other models the usual ``cumsum(mask) - 1``.

Image tokens never enter the loss: they sit in the prompt, and the loss covers response tokens
only (``response_mask``).

Nothing here downloads anything: :func:`tiny_qwen2_vl` builds a small random Qwen2-VL with the
character tokenizer (:func:`vision_tokenizer`) and an image processor from their configs.
"""

from __future__ import annotations

import io
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainers.deps import require
from trainers.models import attach_processor, char_tokenizer, processor_of

__all__ = [
    "VISION_TOKENS",
    "ImagePrompt",
    "attach_processor",
    "checkpoint_config",
    "collate",
    "encode_images",
    "freeze_vision",
    "image_inputs",
    "is_vision_checkpoint",
    "is_vision_model",
    "load_image",
    "load_vision_model",
    "load_vision_tokenizer",
    "position_ids",
    "processor_of",
    "shape_image",
    "tiny_idefics3",
    "tiny_qwen2_vl",
    "text_only_response",
    "to_device",
    "vision_base",
    "vision_processor",
    "vision_token_ids",
    "vision_tokenizer",
]

#: Qwen2-VL's vision tokens (added to the character tokenizer by :func:`vision_tokenizer`).
VISION_TOKENS: tuple[str, ...] = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

#: A ChatML template with images (``{"type": "image"}`` content items), as Qwen2-VL's.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Idefics3 / SmolVLM's image tokens (tile grid tokens for up to 6 x 6 tiles).
IDEFICS3_TOKENS: tuple[str, ...] = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
)

#: Idefics3's chat format ("User:<image>question<end_of_utterance>\nAssistant:").
IDEFICS3_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)

#: Module names of image towers and projectors (Qwen2-VL ``visual``; Idefics3 ``vision_model``,
#: ``connector``; LLaVA-style ``vision_tower``, ``multi_modal_projector``).
VISION_MODULES: tuple[str, ...] = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "connector")

# Processor outputs that are not forward inputs of the image tower.
_TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


class ImagePrompt(list):
    """Token ids of a prompt with images (a ``list[int]``, image placeholders expanded), carrying
    ``images`` (the PIL images, for engines that process them themselves, e.g. vLLM), ``inputs``
    (the processor's image tensors for this prompt, e.g. ``pixel_values`` and
    ``image_grid_thw``) and ``raw_ids``: the ids before expansion (one placeholder per image, what
    vLLM's own processor expands; ``None``: unknown).

    >>> p = ImagePrompt([5, 6, 7], images=[], inputs={"image_grid_thw": torch.tensor([[1, 2, 2]])})
    >>> list(p), sorted(p.inputs)
    ([5, 6, 7], ['image_grid_thw'])
    """

    def __init__(
        self,
        ids: Sequence[int],
        images: Sequence[Any],
        inputs: dict[str, Tensor],
        raw_ids: Sequence[int] | None = None,
    ) -> None:
        super().__init__(int(t) for t in ids)
        self.images = list(images)
        self.inputs = dict(inputs)
        self.raw_ids = None if raw_ids is None else [int(t) for t in raw_ids]

    def __reduce__(self) -> tuple[Any, ...]:
        return (ImagePrompt, (list(self), self.images, self.inputs, self.raw_ids))


def image_inputs(ids: Any) -> dict[str, Tensor] | None:
    """The image inputs ``ids`` carries (an :class:`ImagePrompt`), else ``None``."""
    return getattr(ids, "inputs", None) or None


def collate(rows: Sequence[dict[str, Tensor] | None]) -> dict[str, Tensor] | None:
    """The image inputs of a batch from its rows' (``None``: a row without images): every key
    concatenated along dim 0 in row order (Qwen2-VL's ``pixel_values`` ``[patches, D]`` and
    ``image_grid_thw`` ``[images, 3]`` list the batch's images in order of appearance; a
    processor with a leading batch dim of 1 per prompt, Idefics3's ``pixel_values``
    ``[1, images, 3, H, W]``, gets its rows stacked, rows with fewer images padded with all-zero
    images, which Idefics3 skips). ``None`` when no row has images.

    >>> a = {"image_grid_thw": torch.tensor([[1, 2, 2]]), "pixel_values": torch.zeros(4, 3)}
    >>> out = collate([a, None, a])
    >>> out["image_grid_thw"].shape, out["pixel_values"].shape
    (torch.Size([2, 3]), torch.Size([8, 3]))
    """
    present = [r for r in rows if r]
    if not present:
        return None
    keys = list(present[0])
    if any(list(r) != keys for r in present):
        raise ValueError(f"image inputs: rows have different keys ({sorted(keys)} vs others)")
    out = {}
    for k in keys:
        ts = [r[k] for r in present]
        if ts[0].dim() >= 3 and len({t.shape[1:] for t in ts}) > 1:  # [1, images, ...]: pad the images
            n = max(t.shape[1] for t in ts)
            ts = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, n - t.shape[1])) for t in ts]
        out[k] = torch.cat(ts, dim=0)
    return out


# --------------------------------------------------------------------------- images


def load_image(value: Any, *, where: str, base: Path | None = None) -> Any:
    """A PIL image (RGB) from a file path (relative to ``base``), bytes, a PIL image or a
    ``datasets`` image dict (``{"bytes": ..., "path": ...}``). A missing or unreadable image
    raises ``ValueError`` naming ``where`` (the file and record) and the image."""
    Image = require("PIL.Image")
    name = "image"
    try:
        if isinstance(value, Image.Image):
            img = value
        elif isinstance(value, dict) and value.get("bytes") is not None:
            name = str(value.get("path") or "image bytes")
            img = Image.open(io.BytesIO(value["bytes"]))
        elif isinstance(value, dict) and value.get("path"):
            return load_image(value["path"], where=where, base=base)
        elif isinstance(value, (bytes, bytearray)):
            name = "image bytes"
            img = Image.open(io.BytesIO(bytes(value)))
        elif isinstance(value, (str, os.PathLike)):
            path = Path(value)
            if base is not None and not path.is_absolute():
                path = base / path
            name = str(path)
            if not path.is_file():
                raise ValueError("no such file")
            img = Image.open(path)
        else:
            raise ValueError(
                f"expected a path, bytes, a PIL image or {{'bytes', 'path'}}, got {type(value).__name__}"
            )
        img.load()
    except ValueError as e:
        raise ValueError(f"{where}: {name}: {e}") from None
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError...
        raise ValueError(
            f"{where}: {name}: not a readable image ({type(e).__name__}: {str(e)[:120]})"
        ) from None
    return img.convert("RGB")


# --------------------------------------------------------------------------- processor


def _messages(text: Any, n_images: int) -> list[dict[str, Any]]:
    """Chat messages with ``n_images`` image items: at the ``<image>`` markers of the text when it
    has as many, else before the text of the first user message."""

    def content(s: str, k: int) -> list[dict[str, str]]:
        parts = s.split("<image>")
        if len(parts) - 1 == k:
            items: list[dict[str, str]] = []
            for i, part in enumerate(parts):
                if i:
                    items.append({"type": "image"})
                if part:
                    items.append({"type": "text", "text": part})
            return items
        return [{"type": "image"}] * k + [{"type": "text", "text": s.replace("<image>", "")}]

    if isinstance(text, str):
        return [{"role": "user", "content": content(text, n_images)}]
    out, placed = [], False
    for m in text:
        if not placed and m["role"] == "user":
            out.append({"role": "user", "content": content(m["content"], n_images)})
            placed = True
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if not placed:
        raise ValueError("a prompt with images needs a user message")
    return out


def encode_images(processor: Any, text: Any, images: Sequence[Any]) -> ImagePrompt:
    """Encode a prompt (``text``: a string or chat messages) with ``images`` through the model's
    processor: its chat template (with the generation prompt), then ``processor(text, images)``.
    Returns the ids (placeholders expanded) with the images and their inputs."""
    messages = _messages(text, len(images))
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = processor(text=[rendered], images=[list(images)], return_tensors="pt")
    inputs = {k: v for k, v in enc.items() if k not in _TEXT_KEYS and isinstance(v, Tensor)}
    raw = processor.tokenizer(rendered, add_special_tokens=False).input_ids
    return ImagePrompt(enc["input_ids"][0].tolist(), images, inputs, raw_ids=raw)


# --------------------------------------------------------------------------- model side


def is_vision_model(model: Any) -> bool:
    """Whether ``model`` (a module, or a DeepSpeed / FSDP wrapper of one) has an image tower
    (its config has a ``vision_config``)."""
    hf = getattr(model, "module", model)
    return getattr(getattr(hf, "config", None), "vision_config", None) is not None


def vision_base(model: Any) -> Any:
    """The multimodal base model (``model.model`` of a ``...ForConditionalGeneration``)."""
    hf = getattr(model, "module", model)
    return getattr(hf, "model", hf)


def position_ids(
    model: Any, input_ids: Tensor, attention_mask: Tensor, inputs: dict[str, Tensor] | None
) -> Tensor:
    """Position ids of a ``[B, L]`` (left-padded) batch for ``model``: with image inputs and a
    model with multimodal rotary positions (``get_rope_index``, Qwen2-VL's M-RoPE) its own
    ``[3, B, L]`` ids (text tokens: the same id on the three axes); else ``[B, L]``
    ``cumsum(mask) - 1`` clamped at 0."""
    if inputs and "image_grid_thw" in inputs and hasattr(vision_base(model), "get_rope_index"):
        cfg = getattr(model, "module", model).config
        types = (input_ids == cfg.image_token_id).to(torch.int32)
        pos, _ = vision_base(model).get_rope_index(
            input_ids, mm_token_type_ids=types, image_grid_thw=inputs["image_grid_thw"],
            attention_mask=attention_mask,
        )  # fmt: skip
        return pos.masked_fill(attention_mask[None] == 0, 0)
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def vision_token_ids(model: Any) -> tuple[int, ...]:
    """The ids of the image / video placeholder and vision start / end tokens of ``model``'s
    config (or of a config) (``()`` for a text model). A rollout of a vision-language model stops at any of them
    (:func:`text_only_response`)."""
    m = getattr(model, "module", model)
    cfg = getattr(m, "config", m)  # a model, or its config
    keys = (
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "image_token_index",
    )
    return tuple(sorted({int(v) for k in keys if isinstance(v := getattr(cfg, k, None), int)}))


def text_only_response(model: Any, input_ids: Tensor, T: int) -> Tensor:
    """``input_ids`` ``[B, L]`` with the vision tokens of the last ``T`` columns (the responses)
    replaced by token 0, for the forward only.

    A model that samples its own image placeholder would make the forward count one image
    token too many (and M-RoPE take it for an image). The rollout engines stop a sample at such a
    token (:func:`vision_token_ids`), so it is the sample's last token: its input embedding only
    feeds the logits at its own position, which predict nothing that is trained. Its log-prob is
    still gathered from the unmodified ids: the values are exact."""
    ids = vision_token_ids(model)
    if not ids or T == 0:
        return input_ids
    tail = input_ids[:, -T:]
    bad = torch.isin(tail, torch.tensor(ids, device=tail.device))
    if not bool(bad.any()):
        return input_ids
    return torch.cat([input_ids[:, :-T], tail.masked_fill(bad, 0)], dim=1)


def to_device(inputs: dict[str, Tensor] | None, device: Any) -> dict[str, Tensor]:
    """``inputs`` on ``device`` (``{}`` for none); the models cast the pixels to their own dtype."""
    return {k: v.to(device) for k, v in (inputs or {}).items()}


def vision_parameters(model: Any) -> list[tuple[str, Any]]:
    """``(name, parameter)`` of the image tower and its projector (names with ``visual``,
    ``vision_tower``, ``vision_model``, ``multi_modal_projector`` or ``connector``)."""
    return [(n, p) for n, p in model.named_parameters() if any(f"{k}." in n for k in VISION_MODULES)]


def freeze_vision(model: Any) -> int:
    """Freeze the image tower (``requires_grad=False``); returns the number of frozen parameters."""
    n = 0
    for _, p in vision_parameters(model):
        p.requires_grad_(False)
        n += p.numel()
    return n


# --------------------------------------------------------------------------- tiny model


def vision_tokenizer(family: str = "qwen2_vl") -> Any:
    """:func:`trainers.models.char_tokenizer` with a VLM family's special tokens and image chat
    template: ``"qwen2_vl"``: Qwen2-VL's chat and vision tokens (:data:`VISION_TOKENS`, ids
    100-105); ``"idefics3"``: Idefics3 / SmolVLM's (:data:`IDEFICS3_TOKENS`)."""
    if family not in ("qwen2_vl", "idefics3"):
        raise ValueError(f"family must be 'qwen2_vl' or 'idefics3', got {family!r}")
    tok = char_tokenizer()
    tokens = VISION_TOKENS if family == "qwen2_vl" else IDEFICS3_TOKENS
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    tok.chat_template = CHAT_TEMPLATE if family == "qwen2_vl" else IDEFICS3_TEMPLATE
    return tok


def _images_only_processor_class() -> type:
    transformers = require("transformers")

    class Qwen2VLImagesProcessor(transformers.Qwen2VLProcessor):
        """Qwen2-VL's processor without its video processor (which needs torchvision)."""

        def __init__(
            self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw: Any
        ):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            transformers.ProcessorMixin.__init__(
                self, image_processor, tokenizer, chat_template=chat_template
            )

    return Qwen2VLImagesProcessor


def vision_processor(tokenizer: Any, image_processor: Any) -> Any:
    """A Qwen2-VL processor over ``tokenizer`` and ``image_processor``: transformers' own where it
    can be built (it wants a video processor, which needs torchvision), else an images-only
    subclass of it (the same ``__call__``, chat template and token expansion)."""
    transformers = require("transformers")
    template = tokenizer.chat_template or CHAT_TEMPLATE
    try:
        video = transformers.Qwen2VLVideoProcessor()  # needs torchvision
        return transformers.Qwen2VLProcessor(image_processor, tokenizer, video, chat_template=template)
    except Exception:  # ImportError / ValueError / AttributeError without torchvision
        return _images_only_processor_class()(image_processor, tokenizer, chat_template=template)


def tiny_qwen2_vl(
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate: int = 128,
    vision_dim: int = 32,
    vision_layers: int = 2,
    image_size: int = 56,
    max_positions: int = 1024,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    """``(model, processor)``: a randomly initialised ``Qwen2VLForConditionalGeneration``
    (deterministic from ``seed``; tied embeddings; M-RoPE sections ``[4, 6, 6]`` of the head
    size 32) and its processor (patch 14, merge 2, images resized to at most
    ``image_size x image_size`` pixels: a 56 x 56 image is 16 patches, 4 image tokens).
    ``tokenizer`` must have the vision tokens (:func:`vision_tokenizer`); the processor is
    attached to it (:func:`attach_processor`). Head size 32 (``heads=2`` at 64): vLLM's CPU
    attention has no head size 16."""
    transformers = require("transformers")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    head_dim = hidden_size // heads
    config = transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]},
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ),
        vision_config=dict(
            depth=vision_layers, embed_dim=vision_dim, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2VLForConditionalGeneration(config)
    model.config._attn_implementation = "sdpa"
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    pixels = image_size * image_size
    image_processor = transformers.Qwen2VLImageProcessor(
        min_pixels=28 * 28, max_pixels=pixels, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    processor = vision_processor(tokenizer, image_processor)
    attach_processor(tokenizer, processor)
    return model.to(dtype).eval(), processor


def checkpoint_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of the local checkpoint directory ``path`` (``{}`` when there is none or
    it is unreadable)."""
    f = Path(path) / "config.json"
    try:
        out = json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def is_vision_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the local checkpoint directory ``path`` holds a vision-language model (its
    ``config.json`` has a ``vision_config``)."""
    return "vision_config" in checkpoint_config(path)


def tiny_idefics3(
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 2,
    intermediate: int = 128,
    vision_dim: int = 32,
    vision_layers: int = 2,
    image_size: int = 64,
    max_positions: int = 1024,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    """``(model, processor)``: a randomly initialised ``Idefics3ForConditionalGeneration`` (the
    SmolVLM architecture: a SigLIP-style tower, pixel shuffle by 2, a Llama text model; 1-D
    positions), deterministic from ``seed``, and its processor (images resized to
    ``image_size`` on the longest edge, no tiling: 16 x 16 patches, 4 image tokens per image).
    ``tokenizer``: :func:`vision_tokenizer` ``("idefics3")``; the processor is attached to it.
    vLLM loads it with no patch (Qwen2-VL needs torchvision there)."""
    transformers = require("transformers")
    patch = 16
    config = transformers.Idefics3Config(
        text_config=dict(
            model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden_size,
            intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        ),
        vision_config=dict(
            hidden_size=vision_dim, intermediate_size=2 * vision_dim, num_hidden_layers=vision_layers,
            num_attention_heads=2, image_size=image_size, patch_size=patch,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=2,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Idefics3ForConditionalGeneration(config)
    model.config._attn_implementation = "sdpa"
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    size = {"longest_edge": image_size}
    image_processor = transformers.Idefics3ImageProcessor(size=size, max_image_size=size, do_image_splitting=False)
    seq = (image_size // patch) ** 2 // 4
    processor = transformers.Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq, chat_template=tokenizer.chat_template
    )
    attach_processor(tokenizer, processor)
    return model.to(dtype).eval(), processor


def load_vision_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer of a VLM checkpoint directory with its processor attached
    (:func:`processor_of`). Qwen2-VL checkpoints load their processor without torchvision too
    (images only)."""
    transformers = require("transformers")
    processor = None
    try:
        processor = transformers.AutoProcessor.from_pretrained(path)
    except Exception:  # a Qwen2-VL processor without torchvision (its video processor)
        pass
    if processor is None or not hasattr(processor, "image_processor"):
        tok = transformers.AutoTokenizer.from_pretrained(path)
        if not tok.chat_template:
            tpl = Path(path) / "chat_template.jinja"
            tok.chat_template = tpl.read_text() if tpl.is_file() else CHAT_TEMPLATE
        image_processor = transformers.AutoImageProcessor.from_pretrained(path)
        processor = vision_processor(tok, image_processor)
    tokenizer = processor.tokenizer
    attach_processor(tokenizer, processor)
    return tokenizer


def load_vision_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a VLM checkpoint directory (``AutoModelForImageTextToText``),
    with its processor attached to the tokenizer (:func:`load_vision_tokenizer`)."""
    transformers = require("transformers")
    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    return model.eval(), load_vision_tokenizer(path)


# --------------------------------------------------------------------------- a visual task

#: The colours of :func:`shapes_task` (answer 1-4) and its quadrants (answer 1-4).
SHAPE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 30),
    "blue": (30, 60, 220),
    "yellow": (230, 210, 20),
}
QUADRANTS: tuple[str, ...] = ("top left", "top right", "bottom left", "bottom right")
SHAPE_QUESTIONS: dict[str, str] = {
    "colour": "What colour is the square? 1 red, 2 green, 3 blue, 4 yellow. Answer with the number.",
    "position": "Where is the square? 1 top left, 2 top right, 3 bottom left, 4 bottom right. Answer with the number.",
    "count": "How many squares are there? Answer with the number.",
}


def shape_image(colour: int, quadrant: int, *, count: int = 1, size: int = 56, rng: Any = None) -> Any:
    """A ``size x size`` RGB image: ``count`` squares of colour ``colour`` (0-3, :data:`SHAPE_COLOURS`)
    on a grey background of random shade; with ``count == 1`` the square lies in quadrant
    ``quadrant`` (0-3, :data:`QUADRANTS`), else the squares sit in distinct random quadrants.
    Square size and offsets are random (``rng``: a ``random.Random``)."""
    Image = require("PIL.Image")
    draw_mod = require("PIL.ImageDraw")
    rng = rng or random.Random(0)
    bg = rng.randrange(90, 160)
    img = Image.new("RGB", (size, size), (bg, bg, bg))
    draw = draw_mod.Draw(img)
    half = size // 2
    quads = [quadrant] if count == 1 else rng.sample(range(4), count)
    rgb = list(SHAPE_COLOURS.values())[colour]
    for q in quads:
        side = rng.randrange(half // 2, half - 2)
        x0 = (q % 2) * half + rng.randrange(0, half - side)
        y0 = (q // 2) * half + rng.randrange(0, half - side)
        draw.rectangle([x0, y0, x0 + side - 1, y0 + side - 1], fill=rgb)
    return img
