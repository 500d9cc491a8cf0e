"""The end of a run: checkpoints kept on disk, the Hugging Face export, and a sample from it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_checkpoint import checkpoint_key, read_marker, save_hf_checkpoint

__all__ = ["export_hf", "generate_sample", "prune_checkpoints"]


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints under ``root`` (0 keeps all). Rank 0 only."""
    if keep <= 0 or not root.is_dir():
        return []
    done = []
    for child in root.iterdir():
        try:
            marker = read_marker(child)
        except (FileNotFoundError, ValueError):
            continue
        step = marker.get("step")
        done.append((step if isinstance(step, int) else -1, child))
    done.sort()
    removed = [path for _, path in done[:-keep]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _consolidate_from_dcp(dcp_path: Path, model_config: Any, dtype: torch.dtype, out: Path) -> None:
    """Rebuild the whole model on CPU from a distributed checkpoint and ``save_pretrained`` it (rank 0).

    Used under pipeline parallelism, where no rank holds every stage: each stage's tensors were saved
    under their original names (with a ``<i>.`` part prefix when a rank holds several stages).
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    wanted = model.state_dict()
    keys = FileSystemReader(str(dcp_path)).read_metadata().state_dict_metadata
    state: dict[str, torch.Tensor] = {}
    found: set[str] = set()
    for key in keys:
        if not key.startswith("model."):
            continue
        name = key.removeprefix("model.")
        head, _, rest = name.partition(".")
        if name not in wanted and head.isdigit():
            name = rest
        name = checkpoint_key(name)  # wrapper segments, and peft's base_layer, removed
        if name in wanted:
            state[key] = wanted[name]
            found.add(name)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = sorted(set(wanted) - found - tied)
    if missing:
        raise RuntimeError(f"the distributed checkpoint {dcp_path} lacks {missing[:5]} (and maybe more)")
    load(state, checkpoint_id=str(dcp_path), no_dist=True)
    model.save_pretrained(str(out))


def export_hf(
    model: nn.Module | None,
    out: Path,
    *,
    tokenizer: Any,
    with_adapters: bool,
    final_dcp: Path | None,
    model_config: Any,
    dtype: torch.dtype,
) -> Path:
    """Save the trained model as a Hugging Face folder ``out`` (and ``out/adapter`` under PEFT).

    Without pipelining (``model`` given) every rank calls this (the save gathers shards); under
    pipelining (``model`` None) the final distributed checkpoint is consolidated on rank 0.
    Rank 0 also saves the tokenizer.
    """
    rank = dist.get_rank()
    if model is not None:
        save_hf_checkpoint(model, out, overwrite=True)
        if with_adapters:
            from automodel_peft import save_adapters  # the adapters' owner saves them

            save_adapters(model, out / "adapter")
    elif rank == 0:
        assert final_dcp is not None
        _consolidate_from_dcp(final_dcp, model_config, dtype, out)
    if rank == 0:
        tokenizer.save_pretrained(str(out))
    dist.barrier()
    return out


def generate_sample(folder: Path, prompt: str, tokens: int, seed: int, *, chat: bool = False) -> str:
    """Load ``folder`` with plain ``from_pretrained`` (and its adapter, if any) and sample ``tokens``.

    With ``chat``, ``prompt`` is a user turn rendered with the tokenizer's chat template (the generation
    prompt added), and the sample is the prompt's text followed by the model's answer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder))
    if (folder / "adapter" / "adapter_config.json").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(folder / "adapter"))
    model.eval()
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=tokens,
            do_sample=True,
            top_k=40,
            temperature=0.8,
            pad_token_id=tokenizer.pad_token_id,
        )
    return str(tokenizer.decode(output[0], skip_special_tokens=True))
