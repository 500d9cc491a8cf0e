"""Save a (sharded) model as a consolidated Hugging Face checkpoint, every rank writing a share of it.

The export is planned first, alike on every rank (`export_plan`): transformers' on-disk names, files
split at ``max_shard_size`` with transformers' names and index (``model-00001-of-00002.safetensors``,
``model.safetensors.index.json``), and each file's writer, files being shared out by bytes among the
ranks that hold its tensors (every rank; or, under pipeline parallelism, the ranks of the stage). They
are then written in parallel (`parallel_export`): each round moves one gather unit onto each writer
(`owner_gather`: only the rank that writes a tensor receives it), and the writers stream them out from
a writer thread while the ranks gather the next round, so no rank holds more than the tensors of one
unit and a few on their way to disk beyond its shards. The folder gets ``config.json`` (plus
``generation_config.json`` when the model has one), so ``AutoModelForCausalLM.from_pretrained`` loads
it. Saves are atomic (`atomic`).
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from automodel_checkpoint.atomic import prepare_staging_dir
from automodel_checkpoint.convert import built_class
from automodel_checkpoint.export_plan import plan_export, plan_shards
from automodel_checkpoint.keys import (
    DEFAULT_KEY_RULES,
    KeyRules,
)
from automodel_checkpoint.materialize import initializable_hf_model
from automodel_checkpoint.parallel_export import gather_order, write_files
from automodel_checkpoint.ranks import rank_of, world_of
from automodel_checkpoint.write_errors import publish_or_explain, write_failure
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


def save_hf_checkpoint(
    model: nn.Module | Sequence[nn.Module],
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
    Every rank gathers the tensors it holds; ``writers`` ranks of each group holding the same tensors
    (all of ``process_group``; a pipeline stage's ranks) write a share of that group's files (the
    tensors written are the same for any number of writers); rank 0 also writes the index and configs.

    Preconditions: every rank of ``process_group`` calls this, with the same arguments, each with the
    model parts it holds. Collectives: one ``all_gather_object`` (the plan); per round of gather
    units with distinct writers, one ``batch_isend_irecv`` moving their tensors' blocks onto the writers
    (and a ``full_tensor()`` for a tensor whose shards are not boxes), in an order every holder computes
    alike (`parallel_export.gather_order`); those of the atomic publish (failure agreement, checksums shared
    out among the ranks). Nothing in the model is mutated (FSDP2 modules are resharded first).

    Args:
        model: The model to save, or this rank's parts of it (its pipeline stages).
        path: The checkpoint folder to publish.
        max_shard_size: Largest file size (bytes or e.g. ``"5GB"``); bigger tensors get their own file.
        dtype: Cast floating-point tensors to this dtype when saving (and record it in config.json).
        overwrite: Replace an existing folder at ``path``.
        save_config: Also write config.json (and generation_config.json).
        rules: Model-name rewrites.
        process_group: Ranks that save together (default: the world).
        writers: How many ranks of each holder group write files (default: all; 1: the group's first
            rank alone, the single-writer export).

    Returns:
        The published folder.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        ValueError: An unreadable ``max_shard_size`` or ``writers`` out of range; on the other ranks when
            one rank's write failed (naming the path and the ranks).
        CheckpointWriteError: This rank's write failed (a full disk), naming the path and the cause;
            nothing is published and the staging folder is removed.
    """
    limit = parse_size(max_shard_size)
    world = world_of(process_group)
    writers = world if writers is None else writers
    if not 1 <= writers <= world:
        raise ValueError(f"writers={writers}: give between 1 and the {world} rank(s) of the process group")
    parts = [model] if isinstance(model, nn.Module) else list(model)
    for part in parts:
        reshard_fsdp_units(part)
    plan = plan_export(parts, limit, dtype, rules, writers, process_group)
    rank = rank_of(process_group)
    staging = prepare_staging_dir(path, overwrite=overwrite, group=process_group)
    order = gather_order([f for f in plan.files if f[0] in plan.held], plan.disk, plan.owner)
    error, checksums = write_files(
        staging,
        order,
        plan.layouts,
        plan.disk,
        plan.tensors,
        plan.owner,
        group=process_group,
        write_hook=_write_hook,
        model=plan.model,
    )
    if rank == 0 and error is None:
        try:
            if len(plan.files) > 1:
                index = {
                    "metadata": {"total_size": plan.total_size},
                    "weight_map": {k: name for name, keys in plan.files for k in keys},
                }
                (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            if save_config:
                _write_configs(staging, parts[0], dtype)
        except Exception as exc:  # shared with every rank by the publish step
            error = exc
    if error is not None:
        error = write_failure(error, staging, process_group)
    return publish_or_explain(
        staging, Path(path), kind="hf", group=process_group, write_error=error, known_checksums=checksums
    )
