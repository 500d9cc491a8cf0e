"""The vision-language section of the model matrix: image-text-to-text families x layouts, with images.

Families come from transformers' registry (``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``, through
`automodel_testing.families.vlm_families`), tiny configs from `automodel_testing.tiny.derive_tiny_config`
(vision towers of 4 x 4-patch images) and batches from `automodel_testing.vlm.image_batch` (the family's
own image processor, as many image placeholders as ``get_image_features`` returns). The parent builds
each tiny model, checks that transformers runs it, saves it with ``save_pretrained`` (the VLM's own key
layout: transformers' conversion mapping renames it on load) and saves the batch. Every layout then runs
in one launch; on each rank, for each family:

- ``AutoModelForImageTextToText.from_config`` on meta goes through `instantiate_infrastructure` and
  `apply_model_infrastructure(..., load_base_model=True)`, with the layout's ``freeze_config`` and
  ``FSDP2Config.multimodal.frozen_sharding``;
- the reference is ``from_pretrained`` in one process, frozen the same way (same LoRA adapters), run on
  the rows of each data-parallel rank in turn with gradients accumulated (`reference_pass`: what data
  parallelism computes; for a family whose forward couples the rows of a batch, `couples_rows`, the
  full batch is a reference no data-parallel layout can match);
- logits, the first loss, the gradient norm and the losses after `STEPS` SGD steps must equal the
  reference within `ATOL` (fp32); a frozen part must have no gradient and no optimizer state, and its
  weights must not move; under ``replicate`` the frozen tower must hold whole (not sharded) tensors.

A case works, is refused (the same `ValueError` on every rank), or fails. The default run
(``distributed`` marker) runs `FAST_FAMILIES` under some layouts; ``uvx nox -s models`` runs every family
(``models`` marker), one test and one launch per layout (a family that raises stops the launch and a new
one runs the families after it), and writes the JSON for ``tools/models_doc.py`` (docs/vlm.md). A run in
chunks selects families with `FAMILIES_ENV` and layouts with ``-k``, each chunk into its own report.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from automodel_distributed.config import FrozenSharding
from automodel_testing.matrix import (
    Row,
    assert_no_failure,
    barrier_or_stop,
    gradient_difference,
    judge,
    launch_layout,
    prepare_checkpoints,
    record_families,
    refusal,
    select_families,
    sgd_parity,
    squared_grad_sum,
)

ROWS, SEQ, STEPS, LR = 4, 24, 2, 0.1
"""Rows of the batch, their length (at least the image tokens and 12 text tokens), SGD steps, rate."""
ATOL = 1e-5
REPORT_ENV = "AUTOMODEL_VLM_MATRIX_REPORT"
"""Where the ``models`` session's run writes its JSON (default: build/models/vlm.json)."""
FAMILIES_ENV = "AUTOMODEL_VLM_MATRIX_FAMILIES"
"""Which families the ``models`` run covers (`automodel_testing.matrix.select_families`: unset, every
family; ``gemma3,llava``; or a slice ``0:30`` of the sorted registry). A run in chunks writes one report
per chunk (`REPORT_ENV`); ``tools/models_doc.py`` merges the reports of one commit into one page."""
ROOT = pathlib.Path(__file__).resolve().parents[2]
WEIGHTS = "reference_weights.pt"
"""Written next to a checkpoint that transformers' ``from_pretrained`` does not reload whole: the saved
model's own state dict, which the reference loads instead (`prepare_family`)."""
INTRO = (
    "Every image-text-to-text family of transformers (`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`) x "
    "every layout, loaded from its `save_pretrained` checkpoint (the family's own key layout, renamed by "
    "transformers' conversion mapping) into a meta `AutoModelForImageTextToText` through "
    "`apply_model_infrastructure` and compared with single-process transformers on a batch with one "
    "image per row (the family's own image processor): first logits, first loss, gradient norm and the "
    "losses after two SGD steps (fp32, 1e-5). The `frozen` layouts freeze the vision tower with "
    "`freeze_config` and place it as `FSDP2Config.multimodal.frozen_sharding` says; they also check that "
    "the frozen tower gets no gradients and no optimizer state and does not move; `ac_vision` "
    "checkpoints the vision tower's blocks only (`activation_checkpointing_scope`). Where transformers' "
    "`from_pretrained` does not reload its own `save_pretrained` checkpoint (it reports tensors missing and "
    "initialises them anew), the reference gets the saved weights with `load_state_dict` and the saved "
    "checkpoint is compared with `save_pretrained`'s of the same weights. A case works, is "
    "**refused** (every rank raised the same `ValueError` from automodel) or fails (anything else). "
    "Training one from the command line (a folder of images with JSONL conversations): "
    "[`automodel train`](cli.md#vision-language-models); per-rank memory of a frozen tower under each "
    "`frozen_sharding`: [benchmarks](benchmarks.md#vision-language-frozen-tower)."
)

FAST_FAMILIES: tuple[str, ...] = (
    "llava",  # CLIP tower + projector + Llama: the plain layout
    "qwen2_5_vl",  # patch-sequence tower with windowed attention, multimodal rotary positions
)
"""Families of the default run's slice."""


@dataclass(frozen=True)
class Layout:
    """One way of sharding a VLM, as the public API's configs express it."""

    name: str
    world_size: int
    sizes: dict[str, int] = field(default_factory=dict)
    freeze: dict[str, bool] | None = None
    """``freeze_config`` (None: nothing frozen)."""
    frozen_sharding: FrozenSharding = "root"
    lora: bool = False
    pp_schedule: str | None = None
    ac_scope: str | None = None
    """``FSDP2Config.activation_checkpointing_scope`` with full activation checkpointing (None: off)."""


_FROZEN_TOWER = {"freeze_vision_tower": True, "freeze_embeddings": False}

LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("fsdp2", 2),
        Layout("fsdp2_frozen_root", 2, freeze=_FROZEN_TOWER),
        Layout("fsdp2_frozen_per_layer", 2, freeze=_FROZEN_TOWER, frozen_sharding="per_layer"),
        Layout("fsdp2_frozen_replicate", 2, freeze=_FROZEN_TOWER, frozen_sharding="replicate"),
        Layout("hsdp", 4, {"dp_replicate_size": 2}, freeze=_FROZEN_TOWER),
        Layout("tp", 2, {"tp_size": 2}),
        Layout("lora_fsdp2", 2, lora=True),
        Layout("ac_vision", 2, ac_scope="vision"),
        Layout("pp", 2, {"pp_size": 2}, pp_schedule="1f1b"),
    )
}


def _quiet() -> Any:
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("automodel_infra").setLevel(logging.WARNING)
    logging.getLogger("automodel_distributed").setLevel(logging.WARNING)
    return warnings.catch_warnings(action="ignore")


def prepare_family(model_type: str, root: pathlib.Path) -> dict[str, Any]:
    """Build the tiny VLM of ``model_type``, check transformers trains it on images, save it and its batch.

    Returns:
        ``{"path": folder}``, or ``{"reference_error": why}``.
    """
    from transformers import AutoModelForImageTextToText

    from automodel_testing.tiny import derive_tiny_config
    from automodel_testing.vlm import image_batch, image_tokens

    with _quiet():
        try:
            config = derive_tiny_config(model_type)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1234)
                model = AutoModelForImageTextToText.from_config(config)
            # Towers whose image is a fixed number of query tokens (BLIP-2's 32) get longer rows.
            seq = max(SEQ, image_tokens(model) + SEQ // 2)
            inputs, labels = image_batch(model, ROWS, seq)
            logits = model(**inputs).logits
            _token_sum(logits, labels).backward()
        except Exception as exc:
            return {"reference_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        path = root / model_type
        model.save_pretrained(path)
        torch.save({"inputs": inputs, "labels": labels}, path / "batch.pt")
        _, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
        if info["missing_keys"]:
            # transformers does not reload its own checkpoint here (shieldgemma2: its load renamings do
            # not invert its save renamings, so the language model is initialised anew): the reference
            # and the save-back check then use the weights themselves (`_reference`, `_save_back`).
            torch.save(model.state_dict(), path / WEIGHTS)
    return {"path": str(path)}


def _token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum", ignore_index=-100
    )


def _rows(inputs: dict[str, torch.Tensor], rows: slice, total: int) -> dict[str, torch.Tensor]:
    """This rank's rows of a batch: per-row tensors by their first dim, flattened patches by their grid."""
    out: dict[str, torch.Tensor] = {}
    grid = inputs.get("image_grid_thw")
    for name, value in inputs.items():
        if value.shape[0] == total:
            out[name] = value[rows]
        elif grid is not None and value.shape[0] == int(grid.prod(-1).sum()):
            counts = grid.prod(-1).tolist()
            start = sum(counts[: rows.start])
            out[name] = value[start : start + sum(counts[rows])]
        else:
            raise AssertionError(f"cannot split {name} of shape {tuple(value.shape)} by rows")
    return out


def _strategy(layout: Layout) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_distributed.config import FSDP2Config, MultimodalDistributedConfig

    return FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
        multimodal=MultimodalDistributedConfig(frozen_sharding=layout.frozen_sharding),
        activation_checkpointing=layout.ac_scope is not None,
        activation_checkpointing_scope=layout.ac_scope or "all",
    )


def _peft_config() -> Any:
    from automodel_peft import PeftConfig

    return PeftConfig(target_modules=["*language_model*proj", "*text_model*proj"], dim=4, alpha=8)


def _world_sum(value: torch.Tensor) -> float:
    value = value.detach().double().clone()
    dist.all_reduce(value)
    return float(value)


def _run_family(layout: Layout, ctx: Any, path: str) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForImageTextToText

    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_pipelining.config import PipelineConfig

    torch.manual_seed(0)
    dp_size = ctx.dp_size or 1
    dp_rank = ctx.submesh("dp").get_local_rank() if dp_size > 1 else 0
    try:
        infra = instantiate_infrastructure(
            distributed_config=_strategy(layout),
            pipeline_config=PipelineConfig(
                pp_schedule=layout.pp_schedule, pp_batch_size=2, pp_microbatch_size=1
            )
            if layout.pp_schedule
            else None,
            device=torch.device("cpu"),
            mesh=ctx,
        )
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
        result = apply_model_infrastructure(
            model,
            is_meta_device=True,
            device=torch.device("cpu"),
            model_wrapper=infra.model_wrapper,
            mesh=ctx,
            peft_config=_peft_config() if layout.lora else None,
            autopipeline=infra.autopipeline,
            parallelize_fn=infra.parallelize_fn,
            load_base_model=True,
            pretrained_model_name_or_path=path,
            freeze_config=layout.freeze,
        )
    except ValueError as exc:
        return refusal(exc)
    return _train(layout, ctx, dp_size, dp_rank, result, path)


def _reference(layout: Layout, path: str, model: Any) -> Any:
    from transformers import AutoModelForImageTextToText

    from automodel_distributed.multimodal import apply_freeze_config
    from automodel_testing import normalize_fqn, to_full

    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    weights = pathlib.Path(path, WEIGHTS)
    if weights.is_file():
        ref.load_state_dict(torch.load(weights), strict=True)
    ref.train()
    if layout.freeze is not None:
        apply_freeze_config(ref, layout.freeze)
    if layout.lora:
        from automodel_peft import apply_lora_to_linear_modules

        apply_lora_to_linear_modules(ref, _peft_config())
        local = {normalize_fqn(n): to_full(p) for n, p in model.named_parameters() if "lora_" in n}
        ref_params = dict(ref.named_parameters())
        with torch.no_grad():
            for name, tensor in local.items():
                ref_params[name].copy_(tensor)
    return ref


def reference_pass(
    ref: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor, tokens: int, dp_size: int
) -> tuple[torch.Tensor, float]:
    """transformers' forward and backward on the rows of each of ``dp_size`` data-parallel ranks in turn.

    Gradients accumulate over the ranks' rows: what data parallelism computes. A family whose forward
    couples the rows of a batch (`couples_rows`: HunYuan-VL numbers the images across the whole batch in
    its rotary positions) gives rows 2..3 other outputs alone than inside rows 0..3, so the full batch is
    a reference that no data-parallel layout can match; for every other family the two are the same.

    Returns:
        The logits of every row (in order) and the loss (token sum over ``tokens``).
    """
    per = ROWS // dp_size
    parts, total = [], 0.0
    for r in range(dp_size):
        rows = slice(r * per, (r + 1) * per)
        part = ref(**_rows(inputs, rows, ROWS)).logits
        loss = _token_sum(part, labels[rows]) / tokens
        loss.backward()
        total += float(loss.detach())
        parts.append(part)
    return torch.cat(parts), total


def couples_rows(model: Any, inputs: dict[str, torch.Tensor], dp_size: int = 2) -> bool:
    """Whether transformers' logits of each rank's rows alone differ from those rows inside the batch."""
    with torch.no_grad():
        whole = model(**inputs).logits
        per = ROWS // dp_size
        alone = [model(**_rows(inputs, slice(r * per, (r + 1) * per), ROWS)).logits for r in range(dp_size)]
    return not torch.equal(torch.cat(alone), whole)


def _train(layout: Layout, ctx: Any, dp_size: int, dp_rank: int, model: Any, path: str) -> dict[str, Any]:
    from automodel_testing import normalize_fqn, to_full

    batch = torch.load(pathlib.Path(path, "batch.pt"))
    inputs, labels = batch["inputs"], batch["labels"]
    per = ROWS // dp_size
    rows = slice(dp_rank * per, (dp_rank + 1) * per)
    local, local_labels = _rows(inputs, rows, ROWS), labels[rows]
    tokens = int((labels != -100).sum())
    ref = _reference(layout, path, model)
    frozen = {normalize_fqn(n) for n, p in ref.named_parameters() if not p.requires_grad}
    ours_frozen = {normalize_fqn(n) for n, p in model.named_parameters() if not p.requires_grad}
    checks: list[str] = []
    if not layout.lora and ours_frozen != frozen:
        checks.append(f"frozen parameters differ: {sorted(ours_frozen ^ frozen)[:4]}")
    if layout.freeze:
        checks += _frozen_placement(model, layout.frozen_sharding)
    if layout.ac_scope is not None:
        checks += _checkpointed_scope(model, layout.ac_scope)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=LR)
    before = {
        normalize_fqn(n): to_full(p).detach().clone()
        for n, p in model.named_parameters()
        if not p.requires_grad
    }
    out: dict[str, Any] = {}
    logits: dict[str, torch.Tensor] = {}

    def reference() -> float:
        logits["ref"], loss = reference_pass(ref, inputs, labels, tokens, dp_size)
        return loss

    def ours() -> float:
        logits["ours"] = model(**local).logits
        loss_sum = _token_sum(logits["ours"], local_labels)
        (loss_sum * dp_size / tokens).backward()
        owns = ctx.tp_size == 1 or ctx.submesh("tp").get_local_rank() == 0
        return _world_sum(loss_sum if owns else torch.zeros(())) / tokens

    def first() -> None:
        out["logits"] = float((to_full(logits["ours"]).float() - logits["ref"].detach()[rows]).abs().max())
        with_grad = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        if with_grad:
            checks.append(f"frozen parameters got gradients: {with_grad[:3]}")
        out.update(gradient_difference(squared_grad_sum(trainable), ref))

    out.update(sgd_parity(STEPS, reference, ours, [ref_opt, opt], first=first))
    state_frozen = [p for p in opt.state if not p.requires_grad]
    if state_frozen:
        checks.append(f"{len(state_frozen)} frozen parameters have optimizer state")
    moved = [
        n
        for n, p in model.named_parameters()
        if not p.requires_grad and not torch.equal(to_full(p), before[normalize_fqn(n)])
    ]
    if moved:
        checks.append(f"frozen parameters changed: {moved[:3]}")
    if not layout.lora:
        checks += _save_back(model, path, f"{path}-saved-{layout.name}")
    else:
        try:  # adapters PEFT would load elsewhere are refused (as `automodel train` refuses them)
            checks += _adapters_back(model, path, f"{path}-adapters-{layout.name}")
        except ValueError as exc:
            return refusal(exc)
    return judge(out, ATOL, checks)


def _frozen_placement(model: Any, sharding: str) -> list[str]:
    """Where each frozen vision tower lives must be what ``frozen_sharding`` says.

    Every tower counts (video_llava has an image tower and a video tower, both built from
    ``vision_config``): each must be wholly frozen; ``root``: sharded (DTensors), and no module inside
    it is an FSDP unit of its own (the root unit gathers it); ``per_layer``: sharded, with at least two
    FSDP units inside it that are entries of a tower ``nn.ModuleList`` (blocks); ``replicate``: every
    tower parameter a whole tensor, no tower module an FSDP unit.
    The units are counted from the modules themselves, not from the block discovery under test.
    """
    from torch.distributed.fsdp import FSDPModule

    from automodel_distributed.multimodal import model_parts

    towers = model_parts(model).parts.get("vision", ())
    if not towers:
        return ["the model has no vision tower to place"]
    problems = []
    for fqn, tower in towers:
        learnable = [n for n, p in tower.named_parameters() if p.requires_grad]
        if learnable:
            problems.append(f"{fqn}: {len(learnable)} parameters not frozen, e.g. {learnable[:2]}")
        sharded = [hasattr(p, "full_tensor") for p in tower.parameters()]
        units = [(n, m) for n, m in tower.named_modules() if n and isinstance(m, FSDPModule)]
        in_lists = {
            id(child) for m in tower.modules() if isinstance(m, torch.nn.ModuleList) for child in m.children()
        }
        if sharding == "replicate" and (any(sharded) or units):
            problems.append(f"{fqn} replicate: {sum(sharded)} parameters sharded, {len(units)} FSDP units")
        if sharding in ("root", "per_layer") and not all(sharded):
            problems.append(f"{fqn} {sharding}: {sharded.count(False)} parameters are not sharded")
        if sharding == "root" and units:
            problems.append(f"{fqn} root: {len(units)} modules inside it are FSDP units of their own")
        if sharding == "per_layer":
            blocks = [n for n, m in units if id(m) in in_lists]
            if len(blocks) < 2:
                problems.append(f"{fqn} per_layer: {len(blocks)} FSDP units are blocks of a ModuleList")
    return problems


def _checkpointed_scope(model: Any, scope: str) -> list[str]:
    """Only blocks of the ``scope`` parts are checkpoint-wrapped, each such part has some, and every
    entry of a block list holding a wrapper is wrapped too (no block of the list is left out).

    Wrappers are found from the modules themselves (``CheckpointWrapper`` instances), not from the block
    discovery under test, so a run that wrapped nothing fails.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from automodel_distributed.multimodal import model_parts
    from automodel_modules import strip_wrapper_segments

    parts = model_parts(model)
    real = [n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)]
    wrapped = [strip_wrapper_segments(n) for n in real]
    outside = [n for n in wrapped if parts.role_of(n) != scope]
    problems = [f"scope {scope}: blocks outside it are wrapped: {outside[:3]}"] if outside else []
    for fqn, _ in parts.parts.get(scope, ()):
        if not any(n.startswith(fqn + ".") for n in wrapped):
            problems.append(f"scope {scope}: nothing inside {fqn} is checkpoint-wrapped")
    if not parts.parts.get(scope):
        problems.append(f"scope {scope}: the model has no {scope} part")
    for container in {n.rpartition(".")[0] for n in real}:
        if not isinstance(model.get_submodule(container), torch.nn.ModuleList):
            continue  # a declared block that is no list entry (CLIP's embeddings): no siblings to check
        left = [
            n
            for n, m in model.get_submodule(container).named_children()
            if not isinstance(m, CheckpointWrapper)
        ]
        if left:
            problems.append(f"scope {scope}: {container} has unwrapped entries {left[:3]}")
    return problems


def _adapters_back(model: Any, original: str, target: str) -> list[str]:
    """Save the trained adapters in the PEFT format; ``PeftModel.from_pretrained`` must load them exactly.

    The base is the original checkpoint (LoRA leaves it frozen); every rank loads the adapters onto it and
    compares each adapter tensor with ours, gathered whole, bit for bit.
    """
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from automodel_peft import save_adapters
    from automodel_testing import normalize_fqn, to_full

    save_adapters(model, target)
    ours = {normalize_fqn(n): to_full(p).detach() for n, p in model.named_parameters() if "lora_" in n}
    if not ours:
        return ["the model has no LoRA adapters to save"]
    base = AutoModelForImageTextToText.from_pretrained(original, dtype=torch.float32)
    weights = pathlib.Path(original, WEIGHTS)
    if weights.is_file():
        base.load_state_dict(torch.load(weights), strict=True)
    loaded = PeftModel.from_pretrained(base, target)
    theirs = {
        normalize_fqn(n).removeprefix("base_model.model."): p.detach()
        for n, p in loaded.named_parameters()
        if "lora_" in n
    }
    if ours.keys() != theirs.keys():
        return [f"the saved adapters reload under other names: {sorted(ours.keys() ^ theirs.keys())[:3]}"]
    differ = sorted(n for n in ours if not torch.equal(ours[n], theirs[n]))
    return [f"the saved adapters reload other values: {differ[:3]}"] if differ else []


def _save_back(model: Any, original: str, target: str) -> list[str]:
    """Save the trained model as an HF checkpoint; it must have the original's keys and our weights."""
    import safetensors
    from transformers import AutoConfig, AutoModelForImageTextToText

    from automodel_distributed import save_hf_checkpoint
    from automodel_testing import normalize_fqn, to_full

    save_hf_checkpoint(model, target, overwrite=True)
    ours = {normalize_fqn(n): to_full(p).detach() for n, p in model.named_parameters()}

    def keys(folder: str) -> set[str]:
        found: set[str] = set()
        for file in pathlib.Path(folder).glob("*.safetensors"):
            with safetensors.safe_open(str(file), "pt") as handle:
                found.update(handle.keys())
        return found

    problems = []
    if keys(target) != keys(original):
        problems.append(
            f"saved keys differ from save_pretrained's: {sorted(keys(target) ^ keys(original))[:4]}"
        )
    if pathlib.Path(original, WEIGHTS).is_file():
        # transformers cannot reload this checkpoint (`prepare_family`): compare the files with what
        # save_pretrained writes for the same weights, tensor by tensor.
        fresh = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(original))
        result = fresh.load_state_dict(ours, strict=False)
        buffers = {n for n, _ in fresh.named_buffers()}
        if result.unexpected_keys or set(result.missing_keys) - buffers:
            problems.append(f"our parameters do not fit the model: {result}")
        hf = f"{target}-save-pretrained"
        fresh.save_pretrained(hf)  # transformers writes on rank 0 only
        dist.barrier()
        theirs, mine = _tensors(hf), _tensors(target)
        differ = sorted(k for k in theirs.keys() | mine.keys() if k not in mine or k not in theirs)
        differ += sorted(k for k in theirs.keys() & mine.keys() if not torch.equal(mine[k], theirs[k]))
        if differ:
            problems.append(f"saved tensors differ from save_pretrained's of the same weights: {differ[:3]}")
        return problems
    loaded = dict(AutoModelForImageTextToText.from_pretrained(target, dtype=torch.float32).named_parameters())
    differ = [n for n, t in ours.items() if n not in loaded or not torch.equal(loaded[n].detach(), t)]
    if differ:
        problems.append(f"the saved checkpoint reloads other weights: {differ[:3]}")
    return problems


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    import safetensors.torch

    out: dict[str, torch.Tensor] = {}
    for file in pathlib.Path(folder).glob("*.safetensors"):
        out.update(safetensors.torch.load_file(str(file)))
    return out


def run_layout(layout_name: str, checkpoints: dict[str, str], progress: str) -> None:
    """Every family of ``checkpoints`` under one layout on this rank (results: ``progress/rank<r>.jsonl``)."""
    from automodel_mesh import MeshContext, ParallelismSizes

    layout = LAYOUTS[layout_name]
    with _quiet():
        ctx = MeshContext.build(_strategy(layout), ParallelismSizes(**layout.sizes))
        record_families(
            lambda path: _run_family(layout, ctx, path),
            checkpoints,
            pathlib.Path(progress) / f"rank{dist.get_rank()}.jsonl",
            after_each=barrier_or_stop(layout_name),
        )


def run_matrix(layout_name: str, checkpoints: dict[str, str]) -> list[Row]:
    """``layout_name`` over ``checkpoints``; one merged row per family (`launch_layout`)."""
    return launch_layout(run_layout, layout_name, LAYOUTS[layout_name].world_size, checkpoints)


@pytest.mark.parametrize(("family", "coupled"), [("hunyuan_vl", True), ("llava", False)])
def test_the_reference_runs_each_ranks_rows(family: str, coupled: bool, tmp_path: pathlib.Path) -> None:
    """HunYuan-VL's forward couples rows (its image ordinal counts across the batch); LLaVA's does not.

    Against the full batch, every data-parallel layout of HunYuan-VL differed by 5e-4..2e-3 in the
    gradient norm (with first logits equal on rank 0, whose rows come first); the reference now runs
    each rank's rows, and equals transformers on those rows whatever the family.
    """
    from transformers import AutoModelForImageTextToText

    path = pathlib.Path(prepare_family(family, tmp_path)["path"])
    batch = torch.load(path / "batch.pt")
    with _quiet():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    model.train()
    assert couples_rows(model, batch["inputs"]) is coupled
    tokens = int((batch["labels"] != -100).sum())
    logits, _ = reference_pass(model, batch["inputs"], batch["labels"], tokens, 2)
    with torch.no_grad():
        alone = model(**_rows(batch["inputs"], slice(2, 4), ROWS)).logits
    assert torch.equal(logits[2:].detach(), alone)


@pytest.fixture(scope="module")
def fast_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return prepare_checkpoints(prepare_family, FAST_FAMILIES, tmp_path_factory.mktemp("vlm_fast"))


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout_name",
    [
        # replicate runs in tests/cli/test_train_vlm.py; hsdp (4 ranks), pp (refused: the refusal's message
        # is tested in automodel-pipelining's unit tests) and the rest in `nox -s models`
        "fsdp2_frozen_root",
        "fsdp2_frozen_per_layer",
        "tp",
        "ac_vision",
    ],
)
def test_fast_slice(layout_name: str, fast_checkpoints: dict[str, str]) -> None:
    assert_no_failure(run_matrix(layout_name, fast_checkpoints))


@pytest.fixture(scope="module")
def all_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, str]]:
    """The selected families (`FAMILIES_ENV`): checkpoint folders, and transformers' own errors."""
    from automodel_testing.families import vlm_families

    root = tmp_path_factory.mktemp("vlm_all")
    selected = select_families([f.model_type for f in vlm_families()], os.environ.get(FAMILIES_ENV))
    paths, broken = {}, {}
    for family in selected:
        prepared = prepare_family(family, root)
        if "path" in prepared:
            paths[family] = prepared["path"]
        else:
            broken[family] = prepared["reference_error"]
    return paths, broken


@pytest.fixture(scope="module")
def report(all_checkpoints: tuple[dict[str, str], dict[str, str]]) -> Iterator[dict[str, Any]]:
    """The run's JSON report (`REPORT_ENV`), written when the module's layouts have run."""
    import transformers

    from automodel_testing.families import vlm_families

    paths, broken = all_checkpoints
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    data: dict[str, Any] = {
        "title": "Vision-language models",
        "intro": INTRO,
        "commit": commit or "unknown",
        "load": "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg()),
        "transformers": transformers.__version__,
        "registry": [f.model_type for f in vlm_families()],
        "families": sorted([*paths, *broken]),
        "layouts": {},
        "reference_errors": broken,
        "rows": [],
        "date": time.strftime("%Y-%m-%d"),
    }
    yield data
    target = pathlib.Path(os.environ.get(REPORT_ENV, ROOT / "build" / "models" / "vlm.json"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")


@pytest.mark.models
@pytest.mark.timeout(2 * 3600)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_full_vlm_matrix(
    layout_name: str, all_checkpoints: tuple[dict[str, str], dict[str, str]], report: dict[str, Any]
) -> None:
    paths, _ = all_checkpoints
    rows = run_matrix(layout_name, paths)
    report["layouts"][layout_name] = asdict(LAYOUTS[layout_name])
    report["rows"].extend(asdict(row) for row in rows)
    assert_no_failure(rows)
