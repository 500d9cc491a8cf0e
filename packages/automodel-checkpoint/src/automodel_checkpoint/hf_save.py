"""Save a (sharded) model as a consolidated Hugging Face checkpoint, or its LoRA adapters as HF-PEFT.

Tensors are gathered one at a time (``DTensor.full_tensor()``, every rank in turn) and streamed by
rank 0 into safetensors files laid out in advance (`SafetensorsStreamWriter`), so no rank ever holds
more than one full tensor beyond its shards. Files are split at ``max_shard_size`` with transformers'
names and index (``model-00001-of-00002.safetensors``, ``model.safetensors.index.json``), and the
folder gets ``config.json`` (plus ``generation_config.json`` when the model has one), so
``AutoModelForCausalLM.from_pretrained(folder)`` loads it. Saves are atomic (`atomic`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from automodel_checkpoint.atomic import prepare_staging_dir, publish_staging_dir
from automodel_checkpoint.convert import DiskPiece, DiskTensor, built_class, disk_layout
from automodel_checkpoint.keys import (
    DEFAULT_KEY_RULES,
    KeyRules,
    collect_tensor_slots,
)
from automodel_checkpoint.materialize import initializable_hf_model
from automodel_checkpoint.ranks import rank_of
from automodel_checkpoint.safetensors_io import SafetensorsStreamWriter
from automodel_modules import is_dtensor, reshard_fsdp_units

__all__ = ["parse_size", "plan_shards", "save_hf_checkpoint"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})

_Entry = tuple[str, torch.Tensor]


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"5GB"`` (decimal) or ``"2GiB"`` (binary), as transformers.

    Raises:
        ValueError: An unreadable size or one below 1 byte.
    """
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
        if match is None:
            raise ValueError(f"max_shard_size={size!r} is not a size; use e.g. 5GB, 500MB or an int of bytes")
        value = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if value < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, got {size!r}")
    return value


def plan_shards(
    sizes: Sequence[tuple[str, int]], max_shard_size: int, prefix: str = "model"
) -> list[tuple[str, list[str]]]:
    """Group keys (in order) into files of at most ``max_shard_size`` bytes, named as transformers does.

    A tensor bigger than the limit gets a file of its own.

    Returns:
        ``[(file name, keys)]``; a single ``<prefix>.safetensors`` when everything fits in one.
    """
    groups: list[list[str]] = []
    current: list[str] = []
    used = 0
    for key, nbytes in sizes:
        if current and used + nbytes > max_shard_size:
            groups.append(current)
            current, used = [], 0
        current.append(key)
        used += nbytes
    if current or not groups:
        groups.append(current)
    if len(groups) == 1:
        return [(f"{prefix}.safetensors", groups[0])]
    n = len(groups)
    return [(f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors", keys) for i, keys in enumerate(groups)]


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: ``full_tensor()`` for a DTensor (a collective over its mesh), else itself."""
    return t.full_tensor() if is_dtensor(t) else t


def _assemble(disk: DiskTensor, full: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The on-disk tensor ``disk`` from the full model tensors it reads (a view when it is one box)."""
    whole = disk.whole
    if whole is not None:
        return full[whole]
    if len(disk.pieces) == 1:
        (piece,) = disk.pieces
        assert piece.index is not None
        return full[piece.model_key][piece.index]
    first = full[disk.pieces[0].model_key]
    out = torch.empty(disk.shape, dtype=first.dtype, device=first.device)
    for piece in disk.pieces:
        source = full[piece.model_key]
        box = tuple(slice(s, s + n) for s, n in zip(piece.start, piece.shape, strict=True))
        out[box] = source if piece.index is None else source[piece.index]
    return out


def _stream_files(
    staging: Path,
    files: Sequence[tuple[str, list[str]]],
    disk: Mapping[str, DiskTensor],
    tensors: Mapping[str, torch.Tensor],
    cast_to: Callable[[torch.Tensor], torch.dtype | None],
    writer: bool,
    write_hook: Callable[[str], None] | None = None,
) -> BaseException | None:
    """Gather the model tensors of every on-disk tensor in file order (all ranks) and stream it to disk.

    ``disk`` maps each on-disk key to the boxes of model tensors (``tensors``, by model key) it is made
    of. A model tensor is gathered once for consecutive on-disk tensors that read it (the experts of a
    fused tensor), and freed once the next on-disk tensor does not. A write error stops the writing but
    not the gathering, so the other ranks are never left waiting.
    """
    error: BaseException | None = None
    gathered: dict[str, torch.Tensor] = {}  # model key -> its full value, for the current on-disk tensor

    for name, keys in files:
        stream: SafetensorsStreamWriter | None = None
        if writer and error is None:
            try:
                layout = []
                for k in keys:
                    source = tensors[disk[k].pieces[0].model_key]
                    layout.append((k, cast_to(source) or source.dtype, disk[k].shape))
                stream = SafetensorsStreamWriter(staging / name, layout, {"format": "pt"})
            except Exception as exc:  # keep gathering: the other ranks are in the collectives
                error = exc
        for key in keys:
            needed = disk[key].model_keys
            for stale in [k for k in gathered if k not in needed]:
                del gathered[stale]  # free the previous full tensors before gathering the next
            with torch.no_grad():
                for model_key in needed:
                    if model_key not in gathered:
                        gathered[model_key] = _full(tensors[model_key])
                full = _assemble(disk[key], gathered)
            if stream is not None and error is None:
                try:
                    stream.write(key, full)
                    if write_hook is not None:
                        write_hook(key)
                except Exception as exc:  # keep gathering: the other ranks are in the collectives
                    error = exc
            del full
        if stream is not None:
            try:
                stream.close()
            except Exception as exc:
                error = error or exc
    gathered.clear()
    return error


def _write_configs(staging: Path, model: nn.Module, dtype: torch.dtype | None) -> None:
    hf = initializable_hf_model(model)
    config = getattr(hf, "config", None)
    if hf is None or config is None:
        return
    config = copy.deepcopy(config)
    config.architectures = [built_class(hf).__name__]
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(staging)
    generation = getattr(hf, "generation_config", None)
    can_generate = getattr(hf, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(staging)


def _saved_key(keys: Sequence[str], tied_targets: set[str]) -> str:
    """The key a tied tensor is saved under: the first that is not a tie target (as transformers)."""
    return next((k for k in keys if k not in tied_targets), keys[0])


def save_hf_checkpoint(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    save_config: bool = True,
    rules: KeyRules = DEFAULT_KEY_RULES,
    process_group: dist.ProcessGroup | None = None,
    _write_hook: Callable[[str], None] | None = None,
) -> Path:
    """Save ``model``'s base weights as a consolidated Hugging Face safetensors checkpoint.

    Keys are the model's checkpoint keys (wrapper segments removed; LoRA adapters excluded: their
    owner saves them, ``automodel_peft.save_adapters``); a tied weight is saved once, under its source
    name. Tensors that transformers keeps fused in memory but stores apart (MoE experts) are written in
    the layout ``save_pretrained`` writes (``experts.{e}.gate_proj.weight``...; `convert.disk_layout`),
    each fused tensor gathered once; tensors that transformers splits on load (a fused ``attn.qkv`` that
    the model holds as ``q_proj`` / ``k_proj`` / ``v_proj``) are written fused again.
    Rank 0 of ``process_group`` writes; every rank gathers.

    Preconditions: every rank of the model's meshes calls this, with the same arguments. Collectives:
    one ``full_tensor()`` all-gather per sharded tensor over its mesh, in a fixed order; three
    ``all_gather_object`` for the atomic publish. Nothing in the model is mutated (FSDP2 modules are
    resharded first).

    Args:
        model: The model to save.
        path: The checkpoint folder to publish.
        max_shard_size: Largest file size (bytes or e.g. ``"5GB"``); bigger tensors get their own file.
        dtype: Cast floating-point tensors to this dtype when saving (and record it in config.json).
        overwrite: Replace an existing folder at ``path``.
        save_config: Also write config.json (and generation_config.json).
        rules: Model-name rewrites.
        process_group: Ranks that save together (default: the world).

    Returns:
        The published folder.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        ValueError: An unreadable ``max_shard_size``; OSError from writing (on every rank).
    """
    limit = parse_size(max_shard_size)
    reshard_fsdp_units(model)
    hf = initializable_hf_model(model)
    tied_targets = set((getattr(hf, "all_tied_weights_keys", None) or {}).keys())
    by_model_key: dict[str, torch.Tensor] = {}
    for slot in collect_tensor_slots(model, rules):
        by_model_key[_saved_key(slot.keys, tied_targets)] = slot.tensor
    # transformers' on-disk names (per-expert MoE weights, fused qkv), as save_pretrained writes them
    shapes = {k: tuple(t.shape) for k, t in by_model_key.items()}
    layout = disk_layout(hf, shapes) or [
        DiskTensor(k, shape, (DiskPiece(k, None, (0,) * len(shape), shape),)) for k, shape in shapes.items()
    ]
    disk = {d.key: d for d in layout}

    def cast_to(t: torch.Tensor) -> torch.dtype | None:
        return dtype if dtype is not None and t.dtype.is_floating_point else None

    def nbytes(key: str) -> int:
        t = by_model_key[disk[key].pieces[0].model_key]
        return math.prod(disk[key].shape) * (cast_to(t) or t.dtype).itemsize

    sizes = [(k, nbytes(k)) for k in disk]
    files = plan_shards(sizes, limit)
    staging = prepare_staging_dir(path, overwrite=overwrite, group=process_group)
    writer = rank_of(process_group) == 0
    error = _stream_files(staging, files, disk, by_model_key, cast_to, writer, _write_hook)
    if writer and error is None:
        try:
            if len(files) > 1:
                index = {
                    "metadata": {"total_size": sum(n for _, n in sizes)},
                    "weight_map": {k: name for name, keys in files for k in keys},
                }
                (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            if save_config:
                _write_configs(staging, model, dtype)
        except Exception as exc:  # shared with every rank by the publish step
            error = exc
    return publish_staging_dir(staging, path, kind="hf", group=process_group, write_error=error)
