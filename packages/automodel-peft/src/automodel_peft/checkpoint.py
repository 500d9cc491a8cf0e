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
    _check_savable(model, name)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        peft_key = peft_adapter_key(key, name)
        if peft_key is None:
            continue
        full = value.full_tensor() if is_dtensor(value) else value
        out[peft_key] = full.detach().to("cpu", copy=True).contiguous()
    if not out:
        raise ValueError(f"the model has no parameters of LoRA adapter {name!r}; apply_lora first")
    return out


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
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    adapter_name: str | None = None,
    rank: int | None = None,
) -> Path:
    """Write the model's adapters in the HF PEFT format (loadable by ``PeftModel.from_pretrained``).

    Works for plain and sharded (FSDP2 / TP) models. With a process group, it is a collective: every
    rank gathers the adapter tensors (``full_tensor``), global rank 0 (or ``rank``) writes, and all ranks
    wait at a barrier until the folder exists. The folder is written atomically: into a temporary
    sibling folder that is then renamed over ``directory`` (an existing folder is replaced).

    Files: ``adapter_model.safetensors``, ``adapter_config.json`` (``task_type="CAUSAL_LM"`` for causal
    LMs, ``inference_mode=True``) and ``automodel_adapter.json`` (what `PeftConfig` it came from).

    Args:
        model: A model adapted by `apply_lora` (plain, or sharded after it).
        directory: The adapter folder.
        adapter_name: Which adapter; default the one `apply_lora` recorded.
        rank: The global rank that writes; default 0.

    Returns:
        The folder.
    """
    model = find_hf_model(unwrap(model))[1]
    name = _adapter_name(model, adapter_name)
    tensors = adapter_state_dict(model, adapter_name=name)
    path = Path(directory)
    distributed = dist.is_available() and dist.is_initialized()
    writer = rank if rank is not None else 0
    if not distributed or dist.get_rank() == writer:
        state = _state(model)
        metadata = {
            "adapter_name": name,
            "peft_config": state.config.to_dict() if state is not None and state.config is not None else None,
            "num_tensors": len(tensors),
        }
        _write(path, tensors, _saved_config(model, name), metadata)
    if distributed:
        dist.barrier()
    return path
