"""Save a (sharded) model as a consolidated Hugging Face checkpoint, every rank writing a share of it.

Files are split at ``max_shard_size`` with transformers' names and index
(``model-00001-of-00002.safetensors``, ``model.safetensors.index.json``) and laid out in advance; they
are then shared out among the ranks by bytes and written in parallel (`parallel_export`): tensors are
gathered one unit at a time (``DTensor.full_tensor()``, every rank), and the rank that owns a tensor's
file streams it out from a writer thread while all ranks gather the next, so no rank holds more than the
tensors of one gather and a few on their way to disk beyond its shards. The folder gets ``config.json``
(plus ``generation_config.json`` when the model has one), so ``AutoModelForCausalLM.from_pretrained``
loads it. Saves are atomic (`atomic`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from automodel_checkpoint.parallel_export import assign_files, gather_order, write_files
from automodel_checkpoint.ranks import rank_of, world_of
from automodel_modules import reshard_fsdp_units

__all__ = ["parse_size", "plan_shards", "save_hf_checkpoint"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


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


@dataclass(frozen=True)
class _ExportPlan:
    """What an export writes, the same on every rank.

    Attributes:
        files: Each file's name and on-disk keys, in order (`plan_shards`).
        sizes: Each on-disk key's bytes.
        layouts: Each file's declared tensors (key, on-disk dtype, shape).
        disk: Each on-disk key's boxes of model tensors.
        tensors: The model tensors by model key (DTensors where sharded).
    """

    files: list[tuple[str, list[str]]]
    sizes: dict[str, int]
    layouts: dict[str, list[tuple[str, torch.dtype, tuple[int, ...]]]]
    disk: dict[str, DiskTensor]
    tensors: dict[str, torch.Tensor]


def _plan_export(model: nn.Module, limit: int, dtype: torch.dtype | None, rules: KeyRules) -> _ExportPlan:
    """The files, keys and on-disk dtypes of ``model``'s export (no collective)."""
    hf = initializable_hf_model(model)
    tied_targets = set((getattr(hf, "all_tied_weights_keys", None) or {}).keys())
    tensors: dict[str, torch.Tensor] = {}
    for slot in collect_tensor_slots(model, rules):
        tensors[_saved_key(slot.keys, tied_targets)] = slot.tensor
    # transformers' on-disk names (per-expert MoE weights, fused qkv), as save_pretrained writes them
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    layout = disk_layout(hf, shapes) or [
        DiskTensor(k, shape, (DiskPiece(k, None, (0,) * len(shape), shape),)) for k, shape in shapes.items()
    ]
    disk = {d.key: d for d in layout}
    declared = {}
    for key, entry in disk.items():
        source = tensors[entry.pieces[0].model_key]
        cast = dtype if dtype is not None and source.dtype.is_floating_point else source.dtype
        declared[key] = (key, cast, entry.shape)
    sizes = {key: math.prod(shape) * cast.itemsize for key, cast, shape in declared.values()}
    files = plan_shards(list(sizes.items()), limit)
    layouts = {name: [declared[k] for k in keys] for name, keys in files}
    return _ExportPlan(files, sizes, layouts, disk, tensors)


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
    writers: int | None = None,
    _write_hook: Callable[[str], None] | None = None,
) -> Path:
    """Save ``model``'s base weights as a consolidated Hugging Face safetensors checkpoint.

    Keys are the model's checkpoint keys (wrapper segments removed; LoRA adapters excluded: their
    owner saves them, ``automodel_peft.save_adapters``); a tied weight is saved once, under its source
    name. Tensors that transformers keeps fused in memory but stores apart (MoE experts) are written in
    the layout ``save_pretrained`` writes (``experts.{e}.gate_proj.weight``...; `convert.disk_layout`),
    each fused tensor gathered once; tensors that transformers splits on load (a fused ``attn.qkv`` that
    the model holds as ``q_proj`` / ``k_proj`` / ``v_proj``) are written fused again.
    Every rank gathers; the first ``writers`` ranks of ``process_group`` each write a share of the files
    (the output is the same for any number of writers); rank 0 also writes the index and configs.

    Preconditions: every rank of the model's meshes calls this, with the same arguments. Collectives:
    one ``full_tensor()`` all-gather per sharded tensor over its mesh, in an order every rank computes
    alike (`parallel_export.gather_order`); those of the atomic publish (failure agreement, checksums
    shared out among the ranks). Nothing in the model is mutated (FSDP2 modules are resharded first).

    Args:
        model: The model to save.
        path: The checkpoint folder to publish.
        max_shard_size: Largest file size (bytes or e.g. ``"5GB"``); bigger tensors get their own file.
        dtype: Cast floating-point tensors to this dtype when saving (and record it in config.json).
        overwrite: Replace an existing folder at ``path``.
        save_config: Also write config.json (and generation_config.json).
        rules: Model-name rewrites.
        process_group: Ranks that save together (default: the world).
        writers: How many ranks write files (default: every rank of ``process_group``; 1: rank 0
            alone, as a single-writer export).

    Returns:
        The published folder.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        ValueError: An unreadable ``max_shard_size`` or ``writers`` out of range; OSError from writing
            (on every rank).
    """
    limit = parse_size(max_shard_size)
    world = world_of(process_group)
    writers = world if writers is None else writers
    if not 1 <= writers <= world:
        raise ValueError(f"writers={writers}: give between 1 and the {world} rank(s) of the process group")
    reshard_fsdp_units(model)
    plan = _plan_export(model, limit, dtype, rules)
    owner = assign_files([(name, sum(plan.sizes[k] for k in keys)) for name, keys in plan.files], writers)
    rank = rank_of(process_group)
    mine = {name for name, _ in plan.files if owner[name] == rank}
    staging = prepare_staging_dir(path, overwrite=overwrite, group=process_group)
    order = gather_order(plan.files, plan.disk, owner)
    error = write_files(staging, order, plan.layouts, plan.disk, plan.tensors, mine, _write_hook)
    if rank == 0 and error is None:
        try:
            if len(plan.files) > 1:
                index = {
                    "metadata": {"total_size": sum(plan.sizes.values())},
                    "weight_map": {k: name for name, keys in plan.files for k in keys},
                }
                (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            if save_config:
                _write_configs(staging, model, dtype)
        except Exception as exc:  # shared with every rank by the publish step
            error = exc
    return publish_staging_dir(staging, path, kind="hf", group=process_group, write_error=error)
