"""Packed rows under context parallelism (cp_size=2, gloo) against each document run alone in one process.

Two packed rows of documents whose boundaries fall inside and across the load-balanced chunks (and a
padding tail that continues the last document's positions, as `automodel train` packs) go through
`context_parallel_region`, which runs attention per document (`cp_document_attention`): all-to-all
where cp 2 divides the query heads (4), over gathered keys with a document mask where it does not (3
heads). The reference runs every document alone through the one-process transformers model.
Compared, in fp32 to 1e-5: each document's logits and mean loss (the logits gathered and put back in
order), the gradients (summed over the cp ranks) of the loss over all documents, and the losses over
three AdamW steps. Families: Llama, Qwen2 with one full and one sliding-window layer (window 4, so
the window composes with the document mask per layer), Mistral (window 5 on every layer), and Llama
and Mistral with 3 query heads.

Negative controls (the parity above can fail): the same shards with the document mask read in the
wrong (unbalanced) order, or with no document boundaries, give losses off by more than 1e-3. A model
switched back to plain SDPA after `apply_context_parallel` stays exact: its SDPA calls run as the
region's attention.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from automodel_distributed.context_parallel import (
    apply_context_parallel,
    context_parallel_inputs,
    context_parallel_region,
    context_parallel_unshard,
    load_balance_indices,
)
from automodel_distributed.cp_document_attention import document_region
from automodel_testing import build_tiny_model, grads_by_name, run_distributed

pytestmark = pytest.mark.distributed

SEQ = 24  # 4 chunks of 6 over 2 ranks
ATOL = 1e-5
STEPS = 3
# Document lengths (slots) per row; the rest of a row is padding continuing the last document.
LAYOUT = ((7, 10, 5), (3, 14, 7))
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "mistral": ("mistral", {"sliding_window": 5}),
    # 3 query heads, which cp 2 cannot split: the gathered-keys path with its document mask.
    "llama 3 heads": (
        "llama",
        {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16},
    ),
    "mistral 3 heads": (
        "mistral",
        {
            "sliding_window": 5,
            "hidden_size": 48,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 16,
        },
    ),
}


def _packed() -> tuple[dict[str, torch.Tensor], list[tuple[int, int, int]]]:
    """Two packed rows (inputs, already shifted labels, positions) and each document's (row, start, end)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.zeros(len(LAYOUT), SEQ, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    positions = torch.zeros_like(ids)
    segments = []
    for row, lengths in enumerate(LAYOUT):
        start = 0
        for length in lengths:
            tokens = torch.randint(1, 128, (length + 1,), generator=gen)
            ids[row, start : start + length] = tokens[:-1]
            labels[row, start : start + length] = tokens[1:]
            positions[row, start : start + length] = torch.arange(length)
            segments.append((row, start, start + length))
            start += length
        tail = SEQ - start  # padding: positions continue the last document, labels ignored
        positions[row, start:] = torch.arange(lengths[-1], lengths[-1] + tail)
    return {"input_ids": ids, "shift_labels": labels, "position_ids": positions}, segments


def _reference(model: Any, batch: dict[str, torch.Tensor], segments: list[tuple[int, int, int]]) -> Any:
    """Every document alone: its logits and mean loss; the gradient of (all token losses) / N."""
    count = int((batch["shift_labels"] != -100).sum())
    logits, means, total = [], [], 0.0
    for row, start, end in segments:
        out = model(input_ids=batch["input_ids"][row : row + 1, start:end]).logits[0]
        labels = batch["shift_labels"][row, start:end]
        losses = torch.nn.functional.cross_entropy(out, labels, reduction="sum")
        (losses / count).backward()
        logits.append(out.detach())
        means.append(float(losses) / (end - start))
        total += float(losses)
    return logits, means, total / count


def _cp_forward(model: Any, mesh: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss over the packed rows on this rank (sum of its token losses / N) and the gathered logits."""
    count = int((batch["shift_labels"] != -100).sum())
    with context_parallel_region(mesh, context_parallel_inputs(batch)) as local:
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        loss = (
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), local["shift_labels"].flatten(), reduction="sum"
            )
            / count
        )
        if torch.is_grad_enabled():
            loss.backward()
    (full,) = context_parallel_unshard(mesh, [logits], [1])
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    return total, full


def _per_document(full: torch.Tensor, batch: dict[str, torch.Tensor], segments: list[Any]) -> list[Any]:
    out = []
    for row, start, end in segments:
        logits = full[row, start:end]
        loss = torch.nn.functional.cross_entropy(logits, batch["shift_labels"][row, start:end])
        out.append((logits, float(loss)))
    return out


def _parity(family: str, mesh: Any) -> dict[str, float]:
    batch, segments = _packed()
    family, overrides = FAMILIES[family]
    reference = build_tiny_model(family, **overrides)
    ref_logits, ref_means, _ = _reference(reference, batch, segments)
    ref_grads = grads_by_name(reference)
    model = apply_context_parallel(build_tiny_model(family, **overrides))
    _, full = _cp_forward(model, mesh, batch)
    docs = _per_document(full, batch, segments)
    result = {
        "logits": max(float((a - b).abs().max()) for (a, _), b in zip(docs, ref_logits, strict=True)),
        "doc_loss": max(abs(a - b) for (_, a), b in zip(docs, ref_means, strict=True)),
    }
    worst = 0.0
    for name, grad in grads_by_name(model).items():
        dist.all_reduce(grad, group=mesh.get_group())
        worst = max(worst, float((grad - ref_grads[name]).abs().max()))
    result["grads"] = worst
    with torch.no_grad():  # evaluation: the same logits without autograd
        _, again = _cp_forward(model, mesh, batch)
    result["no_grad_logits"] = float((again - full).abs().max())

    # Training: the same AdamW steps on the documents alone (one process) and on the packed rows (CP).
    reference.zero_grad()
    model.zero_grad()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    worst_step = 0.0
    for _ in range(STEPS + 1):  # the last pass measures the loss after the final step
        _, _, ref_loss = _reference(reference, batch, segments)
        loss, _ = _cp_forward(model, mesh, batch)
        worst_step = max(worst_step, abs(float(loss) - ref_loss))
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=mesh.get_group())
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    result["loss_after_steps"] = worst_step
    return result


def _controls(mesh: Any) -> dict[str, Any]:
    """Wrong order / no documents give wrong losses; plain SDPA after apply_context_parallel is exact."""
    batch, segments = _packed()
    _, ref_means, _ = _reference(build_tiny_model("llama"), batch, segments)
    model = apply_context_parallel(build_tiny_model("llama"))
    rank, size = dist.get_rank(mesh.get_group()), mesh.size()
    order = load_balance_indices(SEQ, size)
    mine = order.view(size, -1)[rank]
    group = mesh.get_group()
    out: dict[str, Any] = {}
    whole_rows = torch.arange(SEQ).expand(len(LAYOUT), -1)
    for name, positions, read_order in (
        ("wrong_order", batch["position_ids"], torch.arange(SEQ)),
        ("no_documents", whole_rows, order),
    ):
        local = {key: batch[key][:, mine] for key in ("input_ids", "position_ids")}
        with torch.no_grad(), document_region(group, positions, read_order):
            logits = model(**local).logits
        (full,) = context_parallel_unshard(mesh, [logits], [1])
        docs = _per_document(full, batch, segments)
        out[name] = max(abs(a - b) for (_, a), b in zip(docs, ref_means, strict=True))
    # Switched back to plain SDPA, the model's SDPA calls still run as the region's attention.
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        _, full = _cp_forward(model, mesh, batch)
    docs = _per_document(full, batch, segments)
    out["plain_sdpa"] = max(abs(a - b) for (_, a), b in zip(docs, ref_means, strict=True))
    return out


def _rank_main() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    return {"parity": {family: _parity(family, mesh) for family in FAMILIES}, "controls": _controls(mesh)}


def test_packed_rows_under_context_parallelism_match_documents_alone() -> None:
    results = run_distributed(_rank_main, 2, timeout_s=300)
    for rank, result in enumerate(results):
        for family, diffs in result["parity"].items():
            for what in ("logits", "doc_loss", "grads", "loss_after_steps"):
                assert diffs[what] <= ATOL, f"rank {rank} {family}: {what} differs by {diffs[what]:.3g}"
            assert diffs["no_grad_logits"] == 0.0, (rank, family, diffs)
        controls = result["controls"]
        assert controls["wrong_order"] > 1e-3, controls
        assert controls["no_documents"] > 1e-3, controls
        assert controls["plain_sdpa"] <= ATOL, controls
