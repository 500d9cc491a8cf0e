"""Save adapters in the Hugging Face PEFT format, from plain or sharded models; map base keys to HF keys.

The format is what ``peft.PeftModel.from_pretrained(base_model, directory)`` reads:
``adapter_model.safetensors`` (keys ``base_model.model.<module>.lora_A.weight``, ...) and
``adapter_config.json`` (a ``peft.LoraConfig``).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_modules import find_hf_model, is_dtensor, unwrap
from automodel_peft._names import ADAPTER_SEGMENTS, clean_fqn, hf_checkpoint_key, is_adapter_name
from automodel_peft.apply import ADAPTER_STATE_ATTR, AdapterState
from automodel_peft.matching import is_causal_lm

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "PEFT_PREFIX",
    "adapter_state_dict",
    "hf_key_mapping",
    "peft_adapter_key",
    "peft_reload_problem",
    "save_adapters",
]

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
#: Prefix of every key in a PEFT adapter file (``PeftModel`` -> ``LoraModel`` -> the base model).
PEFT_PREFIX = "base_model.model."


def hf_key_mapping(model: nn.Module) -> dict[str, str]:
    """Base (non-adapter) state-dict key of ``model`` -> its key in the model's HF checkpoint. Pure.

    Only keys that differ are listed (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``); a
    checkpoint loader applies the inverse to load a transformers checkpoint into an adapted model.
    """
    out: dict[str, str] = {}
    for key in model.state_dict(keep_vars=True):
        if is_adapter_name(key):
            continue
        hf_key = hf_checkpoint_key(key)
        if hf_key != key:
            out[key] = hf_key
    return out


def _state(model: nn.Module) -> AdapterState | None:
    state: AdapterState | None = getattr(model, ADAPTER_STATE_ATTR, None)
    return state


def _adapter_name(model: nn.Module, adapter_name: str | None) -> str:
    if adapter_name is not None:
        return adapter_name
    state = _state(model)
    return state.adapter_name if state is not None else "default"


def peft_adapter_key(name: str, adapter_name: str) -> str | None:
    """The PEFT-file key of an adapter parameter, or None if it belongs to another adapter (or none).

    ``model.layers.0.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.q_proj.lora_A.weight``; DoRA's
    ``lora_magnitude_vector.default.weight`` -> ``lora_magnitude_vector`` (peft's file format).
    Wrapper segments are dropped first.
    """
    parts = clean_fqn(name).split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ADAPTER_SEGMENTS and parts[i + 1] == adapter_name:
            rest = parts[: i + 1] + parts[i + 2 :]
            if part == "lora_magnitude_vector" and rest[-1] == "weight":
                rest = rest[:-1]
            return PEFT_PREFIX + ".".join(rest)
    return None


def _check_savable(model: nn.Module, adapter_name: str) -> None:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or adapter_name not in configs:
        raise ValueError(f"the model has no LoRA adapter {adapter_name!r} to save; apply_lora first")
    config = configs[adapter_name]
    if getattr(config, "bias", "none") != "none" or getattr(config, "modules_to_save", None):
        raise ValueError(
            "save_adapters writes LoRA matrices (and DoRA magnitudes) only; this adapter also trains biases "
            "or modules_to_save: use bias='none' and no modules_to_save, or save with peft itself"
        )


def adapter_state_dict(model: nn.Module, *, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights as full CPU tensors, with PEFT-format keys (``base_model.model.`` prefix).

    Collective when the model holds DTensors (FSDP2 / TP): every rank must call it; each gets the same
    full tensors (``full_tensor()`` of each adapter parameter, in the same order on every rank). Names
    are taken from the state dict, so wrappers (activation checkpointing, compile) do not matter.

    Args:
        model: A model adapted by `apply_lora` (plain, or sharded after it).
        adapter_name: Which adapter; default the one `apply_lora` recorded.

    Returns:
        Key -> tensor, named as ``peft.get_peft_model_state_dict`` names them.

    Raises:
        ValueError: The model has no such adapter, or it trains biases / ``modules_to_save``.
    """
    model = find_hf_model(unwrap(model))[1]  # DDP, compile, a PeftModel: the adapted model inside
    name = _adapter_name(model, adapter_name)
    out = _full_adapters(model, name)
    if not out:
        raise ValueError(f"the model has no parameters of LoRA adapter {name!r}; apply_lora first")
    return out


def _full_adapters(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """``model``'s tensors of adapter ``name``, full and on the CPU, by PEFT key (collective on DTensors)."""
    _check_savable(model, name)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        peft_key = peft_adapter_key(key, name)
        if peft_key is None:
            continue
        full = value.full_tensor() if is_dtensor(value) else value
        out[peft_key] = full.detach().to("cpu", copy=True).contiguous()
    return out


def _collect_on(writer: int, tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor] | None:
    """Every rank's adapter tensors merged on ``writer`` (None elsewhere); collective.

    Ranks that hold the same adapters as a lower rank (data or tensor parallel peers) send nothing:
    only one rank per pipeline stage does. One ``all_gather_object`` of the key sets, one
    ``gather_object`` of the tensors.

    Raises:
        ValueError: No rank holds a tensor of adapter ``name`` (on every rank).
    """
    keys: list[tuple[str, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, tuple(sorted(tensors)))
    if not any(keys):
        raise ValueError(f"the model has no parameters of LoRA adapter {name!r}; apply_lora first")
    me = dist.get_rank()
    send = tensors if keys.index(keys[me]) == me else None
    received: list[dict[str, torch.Tensor] | None] | None = [None] * len(keys) if me == writer else None
    dist.gather_object(send, received, dst=writer)
    if received is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in received:
        merged.update(part or {})
    return merged


def peft_reload_problem(model: nn.Module, *, adapter_name: str | None = None) -> str | None:
    """Why ``PeftModel.from_pretrained`` would not load this model's adapters where they are (None: it would).

    With transformers 5, PEFT converts a saved adapter on load with the model's checkpoint conversion
    (``peft.utils.transformers_weight_conversion``), two ways that can lose adapters silently:

    - its ``target_modules`` (``convert_peft_config_for_transformers``): for the MoE families whose
      checkpoints transformers converts it reads ``gate_proj`` / ``up_proj`` / ``down_proj`` (``w1`` /
      ``w2`` / ``w3`` for Mixtral) as the fused experts and stops targeting modules of those names, so
      the adapters of a dense MLP or of shared experts would be loaded nowhere;
    - its keys (``convert_peft_adapter_state_dict_for_transformers``): the checkpoint renamings meant
      for the on-disk names also rewrite names the model already has (Laguna's ``mlp.shared_expert.``
      renaming turns ``mlp.shared_experts.down_proj`` into ``mlp.shared_experts..down_proj``), so those
      adapters would be dropped and stay at their initial values.

    Both are run here as PeftModel's loader runs them, on the config `save_adapters` writes and on its
    keys (meta tensors of the adapters' shapes; no collective; nothing is mutated). PEFT versions
    without them load what was saved.

    Args:
        model: A model adapted by `apply_lora` (plain or sharded), or one of its pipeline stages.
        adapter_name: Which adapter; default the one `apply_lora` recorded.
    """
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # transformers < 5 or a PEFT without the conversion: loads what was saved
        return None
    hf = find_hf_model(unwrap(model))[1]
    name = _adapter_name(hf, adapter_name)
    _check_savable(hf, name)
    config = _saved_config(hf, name)
    saved = {
        key: torch.empty(value.shape, dtype=value.dtype, device="meta")
        for k, value in hf.state_dict(keep_vars=True).items()
        if (key := peft_adapter_key(k, name)) is not None
    }
    try:
        converted = conversion.convert_peft_adapter_state_dict_for_transformers(hf, config, dict(saved))
    except Exception as exc:  # PeftModel.from_pretrained would fail alike
        return f"PEFT cannot convert these adapters' keys as PeftModel.from_pretrained does: {exc}"
    lost = sorted(
        {key.removeprefix(PEFT_PREFIX).split(".lora_", 1)[0] for key in set(saved) - set(converted)}
    )
    reasons = [f"renames their keys with {type(hf).__name__}'s checkpoint conversion"] if lost else []
    before = {str(t) for t in config.target_modules or ()}
    conversion.convert_peft_config_for_transformers(config, model=hf, conversions=None)
    dropped = before - {str(t) for t in config.target_modules or ()}
    if dropped:
        names = sorted({t.rsplit(".", 1)[-1] for t in dropped})
        reasons.append(f"reads the names {names} of {type(hf).__name__} as its fused experts")
    adapted = {clean_fqn(k).rsplit(".lora_A", 1)[0] for k in hf.state_dict(keep_vars=True) if ".lora_A." in k}
    lost += sorted(
        m for m in adapted if any(m == t or m.endswith(f".{t}") for t in dropped) and m not in lost
    )
    if not lost:
        return None
    import peft

    more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
    return (
        f"the LoRA adapters of {lost[0]}{more} cannot be saved in the PEFT format: with transformers 5, PEFT "
        f"{peft.__version__} {' and '.join(reasons)}, so PeftModel.from_pretrained would load these adapters "
        "nowhere; leave those modules out of the LoRA targets (peft.exclude_modules, or peft.target_modules "
        "naming the others)"
    )


def _saved_config(model: nn.Module, adapter_name: str) -> Any:
    peft_configs: Any = model.peft_config
    lora_config: Any = copy.deepcopy(peft_configs[adapter_name])
    lora_config.inference_mode = True
    if lora_config.task_type is None and is_causal_lm(model):
        lora_config.task_type = "CAUSAL_LM"
    if not lora_config.base_model_name_or_path:
        config = getattr(model, "config", None)
        lora_config.base_model_name_or_path = getattr(config, "_name_or_path", None) or None
    return lora_config


def _write(
    directory: Path, tensors: dict[str, torch.Tensor], lora_config: Any, metadata: dict[str, Any]
) -> None:
    from safetensors.torch import save_file

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        lora_config.save_pretrained(str(tmp))
        (tmp / "automodel_adapter.json").write_text(json.dumps(metadata, indent=2, sort_keys=True))
        old = None
        if directory.exists():
            old = directory.parent / f".{directory.name}.old-{os.getpid()}"
            os.replace(directory, old)
        os.replace(tmp, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_adapters(
    model: nn.Module | Sequence[nn.Module],
    directory: str | os.PathLike[str],
    *,
    adapter_name: str | None = None,
    rank: int | None = None,
) -> Path:
    """Write the model's adapters in the HF PEFT format (loadable by ``PeftModel.from_pretrained``).

    Works for plain and sharded (FSDP2 / TP) models, and for the stages of a pipeline (each rank passes
    its parts). With a process group, it is a collective: every rank gathers the adapter tensors it
    holds (``full_tensor``), one rank per stage sends them to global rank 0 (or ``rank``), which
    writes, and all ranks wait at a barrier until the folder exists. The folder is written atomically:
    into a temporary sibling folder that is then renamed over ``directory`` (an existing folder is
    replaced).

    Files: ``adapter_model.safetensors``, ``adapter_config.json`` (``task_type="CAUSAL_LM"`` for causal
    LMs, ``inference_mode=True``) and ``automodel_adapter.json`` (what `PeftConfig` it came from).

    Args:
        model: A model adapted by `apply_lora` (plain, or sharded after it), or this rank's pipeline
            stages of it.
        directory: The adapter folder.
        adapter_name: Which adapter; default the one `apply_lora` recorded.
        rank: The global rank that writes; default 0.

    Returns:
        The folder.

    Raises:
        ValueError: No rank holds a parameter of the adapter, or PEFT would load the saved adapter into
            other modules (`peft_reload_problem`; ``automodel train`` checks it before training); on
            every rank, before anything is gathered or written.
    """
    parts = [find_hf_model(unwrap(p))[1] for p in ([model] if isinstance(model, nn.Module) else model)]
    name = _adapter_name(parts[0], adapter_name)
    distributed = dist.is_available() and dist.is_initialized()
    problem = next((found for part in parts if (found := peft_reload_problem(part, adapter_name=name))), None)
    if distributed:  # every rank raises, before any gather, when one rank's stage has such modules
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((found for found in problems if found), None)
    if problem is not None:
        raise ValueError(problem)
    held: dict[str, torch.Tensor] = {}
    for part in parts:
        held.update(_full_adapters(part, name))
    path = Path(directory)
    writer = rank if rank is not None else 0
    tensors = _collect_on(writer, held, name) if distributed else held
    if not tensors and not distributed:
        raise ValueError(f"the model has no parameters of LoRA adapter {name!r}; apply_lora first")
    if tensors is not None:
        state = _state(parts[0])
        metadata = {
            "adapter_name": name,
            "peft_config": state.config.to_dict() if state is not None and state.config is not None else None,
            "num_tensors": len(tensors),
        }
        _write(path, tensors, _saved_config(parts[0], name), metadata)
    if distributed:
        dist.barrier()
    return path
