"""Conversations with images (``data.format: image_messages``), rendered through the model's processor.

A record is a conversation in the transformers chat format whose ``content`` is a list of parts:
``{"type": "image", "path": "cat.png"}`` (or ``"url"``, or ``"image"``) and ``{"type": "text",
"text": "..."}``. A relative image path is resolved against the data's folder (``data.path`` itself when
it is a folder, else the folder holding the file), so a folder of images with a ``train.jsonl`` beside
them is a dataset. Each record is rendered by the model's processor
(``processor.apply_chat_template(..., tokenize=True, return_assistant_tokens_mask=True)``): the
processor expands each image placeholder into as many image tokens as the vision tower yields and
returns the pixels (``pixel_values``, ``image_grid_thw``, ...), so no family is named here. Only the
assistant's tokens are targets, which needs a processor chat template with ``{% generation %}`` markers.

A record's image tokens must match its pixels, so records are never packed or cut: one record per row
(``data.packing: padded``), and a record longer than ``data.seq_len + 1`` tokens is refused. The pixels
of each row are kept beside the rows (`automodel_all.cli.packing.TokenRows.media`).

``data.path: builtin:image_chat`` is the embedded example: `write_image_chat_example` draws small
pictures of coloured shapes from a fixed seed and writes them with ``train.jsonl`` and
``validation.jsonl`` (questions about the picture's colour and shape, one answer each).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from automodel_all.cli.packing import IGNORE_INDEX, PackReport, TokenRows

__all__ = [
    "IMAGE_CHAT_SPLITS",
    "IMAGE_KEYS",
    "encode_image_records",
    "has_image_parts",
    "write_image_chat_example",
]

IMAGE_KEYS: tuple[str, ...] = ("path", "url", "image")
"""Keys of an image part that name the image (transformers' chat format)."""

IMAGE_CHAT_SPLITS: dict[str, tuple[int, int]] = {"train": (96, 0), "validation": (16, 1)}
"""Split -> (conversations, seed offset) of the embedded example."""

_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")
_COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
_SHAPES = ("square", "circle")


def _image_of(part: Mapping[str, Any]) -> Any:
    return next((part[k] for k in IMAGE_KEYS if part.get(k) is not None), None)


def has_image_parts(messages: Any) -> bool:
    """Whether a conversation holds an image part (``{"type": "image", ...}``)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
            isinstance(p, Mapping) and p.get("type") == "image" for p in content
        ):
            return True
    return False


def _clean(messages: Any, root: Path, where: str) -> list[dict[str, Any]]:
    """The conversation with explicit parts only (Arrow fills absent fields with None), paths resolved."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of {{role, content}} messages")
    out = []
    for index, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise ValueError(f"{where}: message {index} has no string 'role'")
        if isinstance(content, str):
            out.append({"role": role, "content": [{"type": "text", "text": content}]})
            continue
        if not isinstance(content, list):
            raise ValueError(f"{where}: message {index}: 'content' must be a string or a list of parts")
        parts: list[dict[str, Any]] = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                image = _image_of(part)
                if isinstance(image, str) and not image.startswith(("http://", "https://", "data:")):
                    path = Path(image) if Path(image).is_absolute() else root / image
                    if not path.is_file():
                        raise ValueError(f"{where}: message {index}: image {image!r} not found ({path})")
                    parts.append({"type": "image", "path": str(path)})
                elif image is not None and not isinstance(image, str):
                    parts.append({"type": "image", "image": image})
                else:
                    raise ValueError(
                        f"{where}: message {index}: an image part needs a local 'path' (no network), got "
                        f"{image!r:.80}"
                    )
            else:
                raise ValueError(f"{where}: message {index}: unsupported part {dict(part)!r:.80}")
        out.append({"role": role, "content": parts})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: the conversation has no assistant message, so nothing to learn from")
    return out


def _tokenizer_of(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


def encode_image_records(
    records: Sequence[Mapping[str, Any]],
    processor: Any,
    *,
    messages_key: str,
    root: Path,
    seq_len: int,
    where: str,
) -> TokenRows:
    """One padded row per record, with the processor's pixels of each row (see the module docstring).

    Args:
        records: The records, in order.
        processor: The model's processor (``AutoProcessor``), with a chat template that has
            ``{% generation %}`` markers.
        messages_key: The field holding the conversation (``data.messages_key``).
        root: The folder relative image paths are resolved against.
        seq_len: Slots per row (``data.seq_len``).
        where: Names the source in messages; record ``i`` is ``where record i``.

    Raises:
        ValueError: Not a processor with a suitable chat template, a record that does not fit the
            format (naming it), an image that is missing, or a record longer than ``seq_len + 1``.
    """
    template = getattr(processor, "chat_template", None)
    tokenizer = _tokenizer_of(processor)
    if tokenizer is processor or not isinstance(template, str) or not _GENERATION.search(template):
        raise ValueError(
            f"data.format=image_messages needs the model's processor with a chat template that marks the "
            f"assistant's tokens ({{% generation %}}); {type(processor).__name__} "
            f"({getattr(processor, 'name_or_path', '?')}) has none: save one with the model (processor."
            "chat_template) or point data.tokenizer at a processor folder that has one"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    count = len(records)
    input_ids = torch.full((count, seq_len), int(pad or 0), dtype=torch.int32, device="cpu")
    labels = torch.full((count, seq_len), IGNORE_INDEX, dtype=torch.int32, device="cpu")
    tokens = torch.empty(count, dtype=torch.int32, device="cpu")
    per_token: dict[str, torch.Tensor] = {}
    media: list[dict[str, torch.Tensor]] = []
    for index, record in enumerate(records):
        label = f"{where} record {index}"
        messages = _clean(record.get(messages_key), root, label)
        out = processor.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, return_tensors="pt"
        )
        ids = out["input_ids"][0]
        mask = torch.as_tensor(out["assistant_masks"], device="cpu").reshape(-1).bool()
        if len(ids) > seq_len + 1:
            raise ValueError(
                f"{label}: {len(ids)} tokens (image tokens included) do not fit data.seq_len + 1 = "
                f"{seq_len + 1}; records with images are never cut (the image tokens must match the "
                "pixels): raise data.seq_len"
            )
        if not bool(mask[1:].any()):
            raise ValueError(f"{label}: no assistant token to learn from")
        width = len(ids) - 1
        input_ids[index, :width] = ids[:-1].to(torch.int32)
        labels[index, :width] = torch.where(mask[1:], ids[1:], torch.full_like(ids[1:], IGNORE_INDEX)).to(
            torch.int32
        )
        tokens[index] = width
        row: dict[str, torch.Tensor] = {}
        for name, value in out.items():
            if name in ("input_ids", "attention_mask", "assistant_masks") or not isinstance(
                value, torch.Tensor
            ):
                continue
            if value.dim() == 2 and value.shape == out["input_ids"].shape:  # per token (token_type_ids)
                per_token.setdefault(name, torch.zeros((count, seq_len), dtype=torch.int32, device="cpu"))
                per_token[name][index, :width] = value[0, :-1].to(torch.int32)
            else:  # per image or per patch: first dimension counts them
                row[name] = value
        media.append(row)
    positions = torch.arange(seq_len, dtype=torch.int32, device="cpu").expand(count, seq_len).contiguous()
    report = PackReport(documents=count, rows=count, fill=float(tokens.sum()) / max(1, count * seq_len))
    return TokenRows(input_ids, labels, positions, tokens, report, per_token=per_token, media=media)


def _picture(colour: tuple[int, int, int], shape: str, size: int, rng: random.Random) -> Any:
    from PIL import Image, ImageDraw

    background = tuple(rng.randint(200, 255) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    margin = rng.randint(2, size // 4)
    box = (margin, margin, size - margin, size - margin)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=colour)
    return image


def write_image_chat_example(folder: str | Path, *, image_size: int = 32) -> Path:
    """Write the embedded example: PNG pictures and ``train.jsonl`` / ``validation.jsonl`` (see above).

    Deterministic (fixed seeds); an existing complete example in ``folder`` is reused. Returns ``folder``.
    """
    out = Path(folder)
    if all((out / f"{split}.jsonl").is_file() for split in IMAGE_CHAT_SPLITS):
        return out
    (out / "images").mkdir(parents=True, exist_ok=True)
    for split, (count, offset) in IMAGE_CHAT_SPLITS.items():
        rng = random.Random(20_261_201 + offset)
        lines = []
        for index in range(count):
            colour, shape = rng.choice(sorted(_COLOURS)), rng.choice(_SHAPES)
            name = f"images/{offset}{index:04d}.png"  # no split name: datasets would read it as data
            _picture(_COLOURS[colour], shape, image_size, rng).save(out / name)
            question, answer = rng.choice(
                (
                    ("What colour is the shape?", f"The {shape} is {colour}."),
                    ("What shape is in the picture?", f"A {colour} {shape}."),
                )
            )
            messages = [
                {
                    "role": "user",
                    "content": [{"type": "image", "path": name}, {"type": "text", "text": question}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ]
            lines.append(json.dumps({"messages": messages}))
        staging = out / f".{split}.jsonl.partial"
        staging.write_text("\n".join(lines) + "\n", encoding="utf-8")
        staging.replace(out / f"{split}.jsonl")
    return out
