"""The end of a run: checkpoints kept on disk, the Hugging Face export, and a sample from it."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel_checkpoint import read_marker, save_hf_checkpoint

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


def export_hf(
    parts: Sequence[nn.Module],
    out: Path,
    *,
    tokenizer: Any,
    with_adapters: bool,
) -> Path:
    """Save the trained model as a Hugging Face folder ``out`` (and ``out/adapter`` under PEFT).

    Every rank calls this with the model parts it holds (the model; its pipeline stages): every rank
    writes a share of the files (`save_hf_checkpoint`); rank 0 also saves the tokenizer.
    """
    save_hf_checkpoint(parts, out, overwrite=True)
    if with_adapters:
        from automodel_peft import save_adapters  # the adapters' owner saves them

        save_adapters(parts, out / "adapter")
    if dist.get_rank() == 0:
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
