"""Checkpoint load/save on real gloo ranks: FSDP2 (2 and 4 ranks), HSDP 2x2, TP 2, TP 2 x FSDP 2.

Proofs, each against transformers in the same run: a meta model, sharded by FSDP2Manager and loaded
with `load_hf_checkpoint`, gives the logits of ``from_pretrained`` (llama, llama_tied, a multi-file
checkpoint, a ``.bin`` checkpoint); a consolidated save loads back with ``from_pretrained`` into
identical tensors; a DCP save resumes into identical next-step losses, also on another world size
(saved on 4, resumed on 2); a corpus of broken checkpoints fails with a clear error on every rank and
leaves the model untouched; a rank killed mid-save leaves the previous checkpoint as the latest.

The rank-side functions return plain data; the test functions assert on it. Each launch runs many
cases, since starting ranks costs seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from automodel_mesh import MeshContext, ParallelismSizes
from automodel_testing import (
    DistributedRunError,
    build_tiny_model,
    causal_lm_loss,
    make_batch,
    run_distributed,
    to_full,
)

SEQ = 16


def fp32_config(**fields: Any) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel_distributed.config import FSDP2Config

    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    return FSDP2Config(mp_policy=mp, **fields)


def sharded_meta_model(
    family: str, sizes: dict[str, int], fields: dict[str, Any] | None = None, **overrides: Any
) -> nn.Module:
    """A meta tiny model, sharded by FSDP2Manager on the layout ``sizes``."""
    from automodel_distributed.fsdp2 import FSDP2Manager

    config = fp32_config(**(fields or {}))
    ctx = MeshContext.build(config, ParallelismSizes(**sizes))
    model = build_tiny_model(family, meta=True, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FSDP2Manager(config, ctx.device_mesh).parallelize(model)


@contextlib.contextmanager
def _loss_context(logits: torch.Tensor) -> Iterator[None]:
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            yield
    else:
        yield


def logits_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    full = to_full(out.logits)
    reshard_all(model)
    return full


def reshard_all(model: nn.Module) -> None:
    """A no-grad forward leaves the units that do not reshard after forward (root, last block) gathered."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    loss = causal_lm_loss(out.logits, batch["labels"])
    with _loss_context(out.logits):
        loss.backward()
    opt.step()
    opt.zero_grad()
    return float(to_full(loss).item())


def eval_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        loss = causal_lm_loss(out.logits, batch["labels"])
    reshard_all(model)
    return float(to_full(loss).item())


def load_parity(
    family: str,
    sizes: dict[str, int],
    ckpt: str,
    ref_logits: torch.Tensor,
    fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """meta model -> parallelize -> load -> logits against from_pretrained."""
    from automodel_checkpoint import load_hf_checkpoint

    model = sharded_meta_model(family, sizes, fields)
    report = load_hf_checkpoint(model, ckpt)
    batch = make_batch(128, 2, SEQ, seed=7)
    diff = float((logits_of(model, batch) - ref_logits).abs().max())
    return {
        "logits": diff,
        "loaded": len(report.loaded),
        "class": type(model).__name__,
        "bytes": report.bytes_read,
    }


def _block_errors(model: torch.nn.Module) -> dict[str, Any]:
    """How many DTensors the export moves as blocks, and where a block disagrees with torch's own.

    For each DTensor whose shards are boxes: this rank's block (``owner_gather.blocks_of``) must be
    torch's local shape and global offset, and the blocks must tile the tensor.
    """
    import math

    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from automodel_checkpoint.owner_gather import blocks_of
    from automodel_modules import is_dtensor

    boxed, errors = 0, []
    for key, t in model.state_dict().items():
        blocks = blocks_of(t) if is_dtensor(t) else None
        if blocks is None:
            continue
        boxed += 1
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        mine = [b for b, ranks in blocks.items() if dist.get_rank() in ranks]
        expected = [(tuple(offset), tuple(shape))] if math.prod(shape) else []
        if mine != expected or sum(math.prod(size) for _, size in blocks) != t.numel():
            errors.append(f"{key}: {mine} vs {expected}")
    return {"boxed": boxed, "block_errors": errors}


def save_roundtrip(family: str, sizes: dict[str, int], ckpt: str, out: str) -> dict[str, Any]:
    """load -> save consolidated (sharded files, every rank writing) -> from_pretrained -> same tensors.

    Also saved by one writer: the files must be the same bytes; and the tensors must be those of the
    source checkpoint (``save_pretrained``'s), key for key and byte for byte.
    """
    from transformers import AutoModelForCausalLM

    from automodel_checkpoint import load_hf_checkpoint, save_hf_checkpoint
    from automodel_testing import safetensors_differences

    model = sharded_meta_model(family, sizes)
    load_hf_checkpoint(model, ckpt)
    written: list[str] = []
    save_hf_checkpoint(model, out, max_shard_size="40KB", _write_hook=written.append)
    save_hf_checkpoint(model, out + "-one-writer", max_shard_size="40KB", writers=1)
    result: dict[str, Any] = {"wrote": len(written), **_block_errors(model)}
    if dist.get_rank() == 0:
        result["vs_one_writer"] = safetensors_differences(out, out + "-one-writer", files=True)
        result["vs_save_pretrained"] = safetensors_differences(out, ckpt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            saved = AutoModelForCausalLM.from_pretrained(out).state_dict()
            original = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
        result["keys_equal"] = set(saved) == set(original)
        result["unequal"] = [
            k for k in original if not torch.equal(original[k], saved.get(k, torch.empty(0)))
        ]
        result["files"] = sorted(p.name for p in Path(out).iterdir())
    dist.barrier()
    return result


def resume(family: str, sizes: dict[str, int], ckpt: str, dcp_dir: str) -> dict[str, Any]:
    """Train one step, DCP save, train on; then a fresh model resumes and must give the same losses.

    The same state is also saved asynchronously, written while the next steps train; resuming from it
    must give the same losses too.
    """
    from automodel_checkpoint import (
        AsyncCheckpointer,
        load_distributed_checkpoint,
        load_hf_checkpoint,
        save_distributed_checkpoint,
    )

    batches = [make_batch(128, 2, SEQ, seed=s) for s in (11, 12, 13)]
    model = sharded_meta_model(family, sizes)
    load_hf_checkpoint(model, ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, batches[0])
    save_distributed_checkpoint(model, opt, dcp_dir, step=1, extra_state={"seen": 2})
    with AsyncCheckpointer() as checkpointer:
        checkpointer.save(model, opt, dcp_dir + "-async", step=1, extra_state={"seen": 2})
        expected = [train_step(model, opt, batches[1]), eval_loss(model, batches[2])]

    got = []
    for folder in (dcp_dir, dcp_dir + "-async"):
        fresh = sharded_meta_model(family, sizes)
        opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        info = load_distributed_checkpoint(fresh, opt2, folder)
        got += [train_step(fresh, opt2, batches[1]), eval_loss(fresh, batches[2])]
    return {
        "expected": expected * 2,
        "got": got,
        "step": info.step,
        "extra": dict(info.extra_state),
        "world": info.world_size,
    }


def resume_other_world(family: str, sizes: dict[str, int], dcp_dir: str) -> dict[str, Any]:
    """Load a DCP checkpoint saved on another world size and train the same next steps."""
    from automodel_checkpoint import load_distributed_checkpoint

    batches = [make_batch(128, 2, SEQ, seed=s) for s in (11, 12, 13)]
    fresh = sharded_meta_model(family, sizes)
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    info = load_distributed_checkpoint(fresh, opt, dcp_dir)
    return {
        "got": [train_step(fresh, opt, batches[1]), eval_loss(fresh, batches[2])],
        "world": info.world_size,
    }


def peft_roundtrip(sizes: dict[str, int], ckpt: str, ref_logits: torch.Tensor, out: str) -> dict[str, Any]:
    """A meta peft model, sharded: load the base checkpoint, then save adapters HF-PEFT style."""
    import peft

    from automodel_checkpoint import load_hf_checkpoint
    from automodel_distributed.fsdp2 import FSDP2Manager
    from automodel_peft import init_adapter_weights, save_adapters

    config = fp32_config()
    ctx = MeshContext.build(config, ParallelismSizes(**sizes))
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(build_tiny_model("llama", meta=True), lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP2Manager(config, ctx.device_mesh).parallelize(model)
    load_hf_checkpoint(model, ckpt, init_adapters=init_adapter_weights)  # the owner initialises adapters
    batch = make_batch(128, 2, SEQ, seed=7)
    result: dict[str, Any] = {"logits": float((logits_of(model, batch) - ref_logits).abs().max())}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    adapters = {n: to_full(p) for n, p in model.named_parameters() if "lora_" in n}
    save_adapters(model, out)
    if dist.get_rank() == 0:
        base = build_tiny_model("llama")
        loaded = peft.PeftModel.from_pretrained(base, out)
        got = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
        result["adapters_equal"] = set(got) == {
            n.replace("._checkpoint_wrapped_module", "") for n in adapters
        }
        result["adapters_equal"] &= all(
            torch.equal(got[n.replace("._checkpoint_wrapped_module", "")], t) for n, t in adapters.items()
        )
    dist.barrier()
    return result


def slices_ground_truth(sizes: dict[str, int]) -> list[str]:
    """Parameters whose local shard differs from the boxes `tensor_boxes` computes (uneven shapes)."""
    from automodel_checkpoint.slices import tensor_boxes
    from automodel_distributed.fsdp2 import FSDP2Manager

    dims = {"vocab_size": 130, "intermediate_size": 132}
    full = dict(build_tiny_model("llama", seed=1, **dims).state_dict())
    config = fp32_config()
    ctx = MeshContext.build(config, ParallelismSizes(**sizes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP2Manager(config, ctx.device_mesh).parallelize(build_tiny_model("llama", seed=1, **dims))
    bad = []
    for name, param in model.named_parameters():
        _, boxes = tensor_boxes(param)
        local = (param.to_local() if hasattr(param, "to_local") else param).detach()
        rebuilt = torch.full_like(local, float("nan"))
        for box in boxes:
            g = tuple(slice(s, s + n) for s, n in zip(box.global_start, box.shape, strict=True))
            loc = tuple(slice(s, s + n) for s, n in zip(box.local_start, box.shape, strict=True))
            rebuilt[loc] = full[name][g]
        if not torch.equal(rebuilt, local):
            bad.append(f"{name} {getattr(param, 'placements', None)}")
    return bad


def fault(
    case: str, ckpt: str, family: str = "llama", sizes: dict[str, int] | None = None, strict: bool = True
) -> dict[str, Any]:
    """Load a broken checkpoint: report the error and whether the model was left untouched."""
    from automodel_checkpoint import initialize_model_weights, load_hf_checkpoint

    out: dict[str, Any] = {"case": case}
    meta = sharded_meta_model(family, sizes or {})
    try:
        load_hf_checkpoint(meta, ckpt, strict=strict)
        out["error"] = None
    except Exception as exc:  # the type and message are what we check
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["is_value_error"] = isinstance(exc, ValueError)
        out["is_file_not_found"] = isinstance(exc, FileNotFoundError)
    out["still_meta"] = all(p.device.type == "meta" for p in meta.parameters())
    # The same with a materialised, initialised model: its weights must not change.
    real = sharded_meta_model(family, sizes or {})
    initialize_model_weights(real, "cpu")
    before = [to_full(p).clone() for p in real.parameters()]
    with contextlib.suppress(Exception):
        load_hf_checkpoint(real, ckpt, strict=strict)
    after = [to_full(p) for p in real.parameters()]
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return out


def kill_during_save(kind: str, root: str, ckpt: str) -> str:
    """Publish one good checkpoint, then die (os._exit) in the middle of writing the next one."""
    from automodel_checkpoint import (
        AsyncCheckpointer,
        load_hf_checkpoint,
        save_distributed_checkpoint,
        save_hf_checkpoint,
    )

    model = sharded_meta_model("llama", {})
    load_hf_checkpoint(model, ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = dist.get_rank()
    if kind == "hf":
        save_hf_checkpoint(model, os.path.join(root, "step_1"), max_shard_size="40KB")
        written: list[str] = []

        def die_after_three(key: str) -> None:
            written.append(key)
            if len(written) == 3:
                os._exit(17)

        save_hf_checkpoint(
            model,
            os.path.join(root, "step_2"),
            max_shard_size="40KB",
            _write_hook=die_after_three if rank == 0 else None,
        )
    else:
        save_distributed_checkpoint(model, opt, os.path.join(root, "step_1"), step=1)
        train_step(model, opt, make_batch(128, 2, SEQ, seed=3))
        if rank == 1:
            import torch.distributed.checkpoint as dcp

            original = dcp.FileSystemWriter.write_data

            def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
                future = original(self, plan, planner)
                future.wait()
                os._exit(17)  # this rank's files are on disk; the others never hear from it

            dcp.FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
        if kind == "dcp":
            save_distributed_checkpoint(model, opt, os.path.join(root, "step_2"), step=2)
        else:  # the write dies in the background while this rank trains on
            with AsyncCheckpointer() as checkpointer:
                checkpointer.save(model, opt, os.path.join(root, "step_2"), step=2)
                train_step(model, opt, make_batch(128, 2, SEQ, seed=4))
    return "survived"  # never reached on the killed rank


# ----------------------------------------------------------------------------------------- launches


def run_two_ranks(
    ckpts: dict[str, str],
    refs: dict[str, torch.Tensor],
    work: str,
    faults: list[tuple[str, str, bool]],
    dcp_from_four_ranks: str,
) -> dict[str, Any]:
    out: dict[str, Any] = {"reshard/4->2": resume_other_world("llama", {}, dcp_from_four_ranks)}
    for label, sizes in (("fsdp2", {}), ("tp2", {"tp_size": 2})):
        for name in ("llama", "llama_tied", "llama_sharded", "llama_bin"):
            family = "llama_tied" if name == "llama_tied" else "llama"
            out[f"load/{label}/{name}"] = load_parity(family, sizes, ckpts[name], refs[name])
        out[f"load/{label}+ac/llama"] = load_parity(
            "llama", sizes, ckpts["llama"], refs["llama"], {"activation_checkpointing": True}
        )
        for name in ("llama", "llama_tied"):
            family = "llama_tied" if name == "llama_tied" else "llama"
            out[f"save/{label}/{name}"] = save_roundtrip(
                family, sizes, ckpts[name], os.path.join(work, f"save-{label}-{name}")
            )
        out[f"resume/{label}"] = resume("llama", sizes, ckpts["llama"], os.path.join(work, f"dcp-{label}"))
        out[f"peft/{label}"] = peft_roundtrip(
            sizes, ckpts["llama"], refs["llama"], os.path.join(work, f"peft-{label}")
        )
    for case, path, strict in faults:
        out[f"fault/{case}"] = fault(case, path, strict=strict)
    return out


def run_four_ranks(ckpts: dict[str, str], refs: dict[str, torch.Tensor], work: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    layouts = (("fsdp4", {}), ("hsdp2x2", {"dp_replicate_size": 2}), ("tp2xfsdp2", {"tp_size": 2}))
    for label, sizes in layouts:
        out[f"slices/{label}"] = slices_ground_truth(sizes)
        for name in ("llama", "llama_tied", "llama_sharded"):
            family = "llama_tied" if name == "llama_tied" else "llama"
            out[f"load/{label}/{name}"] = load_parity(family, sizes, ckpts[name], refs[name])
        out[f"save/{label}/llama_tied"] = save_roundtrip(
            "llama_tied", sizes, ckpts["llama_tied"], os.path.join(work, f"save-{label}")
        )
        out[f"resume/{label}"] = resume("llama", sizes, ckpts["llama"], os.path.join(work, f"dcp-{label}"))
    return out


# ------------------------------------------------------------------------------------- test process


def _reference_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path)
    batch = make_batch(128, 2, SEQ, seed=7)
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits


def _rewrite(path: Path, edit: Any) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, str], dict[str, torch.Tensor], Path]:
    from automodel_testing import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    ckpts = {
        "llama": save_tiny_checkpoint("llama", root / "llama", seed=3),
        "llama_tied": save_tiny_checkpoint("llama_tied", root / "llama_tied", seed=3),
        "llama_sharded": save_tiny_checkpoint("llama", root / "llama_sharded", seed=4, max_shard_size="40KB"),
    }
    binary = root / "llama_bin"
    binary.mkdir()
    model = build_tiny_model("llama", seed=3)
    torch.save(model.state_dict(), binary / "pytorch_model.bin")
    model.config.save_pretrained(binary)
    refs = {name: _reference_logits(path) for name, path in ckpts.items()}
    refs["llama_bin"] = refs["llama"]  # same weights as "llama"
    ckpts["llama_bin"] = binary
    return {k: str(v) for k, v in ckpts.items()}, refs, root


def _fault_corpus(root: Path, good: Path, sharded: Path) -> list[tuple[str, str, bool, str | None, str]]:
    """(case, path, strict, expected error class or None, text the message must contain)."""
    from automodel_testing import save_tiny_checkpoint

    faults = root / "faults"
    faults.mkdir()
    truncated = _copy(good, faults / "truncated")
    with (truncated / "model.safetensors").open("r+b") as f:
        f.truncate((truncated / "model.safetensors").stat().st_size - 100)
    missing_shard = _copy(sharded, faults / "missing_shard")
    shards = sorted(missing_shard.glob("model-*.safetensors"))
    shards[1].unlink()
    wrong_shape = save_tiny_checkpoint("llama", faults / "wrong_shape", intermediate_size=96)
    wrong_dtype = _copy(good, faults / "wrong_dtype")
    _rewrite(
        wrong_dtype / "model.safetensors",
        lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(torch.int32)),
    )
    missing_keys = _copy(good, faults / "missing_keys")
    _rewrite(missing_keys / "model.safetensors", lambda t: t.pop("model.norm.weight"))
    unexpected = _copy(good, faults / "unexpected_keys")
    _rewrite(unexpected / "model.safetensors", lambda t: t.__setitem__("model.extra.weight", torch.ones(3)))
    corrupt = _copy(good, faults / "corrupt_header")
    with (corrupt / "model.safetensors").open("r+b") as f:
        f.seek(8)
        f.write(b"{not json at all")
    index_mismatch = _copy(sharded, faults / "index_mismatch")
    index_file = index_mismatch / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.norm.weight"] = shards[0].name
    index_file.write_text(json.dumps(index))
    bf16 = save_tiny_checkpoint("llama", faults / "bf16", dtype=torch.bfloat16)
    return [
        ("truncated", str(truncated), True, "CorruptCheckpointError", "truncated"),
        ("missing_shard", str(missing_shard), True, "FileNotFoundError", shards[1].name),
        ("wrong_shape", str(wrong_shape), True, "CheckpointMismatchError", "mlp.up_proj.weight"),
        ("wrong_dtype", str(wrong_dtype), True, "CheckpointMismatchError", "torch.int32"),
        ("missing_keys", str(missing_keys), True, "CheckpointMismatchError", "model.norm.weight"),
        ("unexpected_keys", str(unexpected), True, "CheckpointMismatchError", "model.extra.weight"),
        ("corrupt_header", str(corrupt), True, "CorruptCheckpointError", "not valid UTF-8 JSON"),
        ("missing_folder", str(faults / "nowhere"), True, "FileNotFoundError", "does not exist"),
        ("not_in_cache", "automodel-tests/not-a-cached-model", True, "FileNotFoundError", "cache"),
        ("index_mismatch", str(index_mismatch), True, "CorruptCheckpointError", "model.norm.weight"),
        ("partial_non_strict", str(missing_keys), False, None, ""),
        ("bf16_cast", str(bf16), True, None, ""),
    ]


def _check_load(label: str, result: dict[str, Any]) -> None:
    assert result["logits"] <= 1e-6, f"{label}: logits differ from from_pretrained by {result['logits']:.3g}"
    assert result["class"].startswith("FSDP") or "tp" in label, f"{label}: not sharded ({result['class']})"


def _check_save(label: str, per_rank: list[dict[str, Any]]) -> None:
    result = per_rank[0]
    assert result["keys_equal"], f"{label}: from_pretrained of the saved folder has other keys"
    assert not result["unequal"], f"{label}: tensors differ after save: {result['unequal']}"
    assert not result["vs_one_writer"], (
        f"{label}: differs from one writer's export: {result['vs_one_writer']}"
    )
    assert not result["vs_save_pretrained"], f"{label}: differs from save_pretrained's tensors"
    # Every rank wrote a share of the files (the tiny model has more 40 KB files than ranks).
    assert all(r["boxed"] > 0 and not r["block_errors"] for r in per_rank), (
        f"{label}: blocks per rank {[(r['boxed'], r['block_errors'][:2]) for r in per_rank]}"
    )
    assert all(r["wrote"] > 0 for r in per_rank), (
        f"{label}: tensors written per rank {[r['wrote'] for r in per_rank]}"
    )
    files = result["files"]
    assert "model.safetensors.index.json" in files and "config.json" in files, f"{label}: {files}"


def _check_resume(label: str, result: dict[str, Any]) -> None:
    assert result["got"] == result["expected"], (
        f"{label}: resumed losses {result['got']} != {result['expected']}"
    )
    assert result["step"] == 1 and result["extra"] == {"seen": 2}, f"{label}: {result}"


@pytest.fixture(scope="module")
def four_rank_results(checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    """One 4-rank launch: slices, loads, saves and DCP round trips of FSDP2 x 4, HSDP 2x2, TP 2 x FSDP 2."""
    ckpts, refs, _ = checkpoints
    work = tmp_path_factory.mktemp("four-ranks")
    per_rank = run_distributed(run_four_ranks, 4, ckpts, refs, str(work), timeout_s=600, pg_timeout_s=60)
    return per_rank, work


@pytest.mark.distributed
def test_checkpoints_on_four_ranks(four_rank_results: Any) -> None:
    per_rank, _ = four_rank_results
    for rank, results in enumerate(per_rank):
        for label, result in results.items():
            if label.startswith("slices/"):
                assert not result, f"rank {rank} {label}: local shards differ from computed boxes: {result}"
            elif label.startswith("load/"):
                _check_load(f"rank {rank} {label}", result)
            elif label.startswith("resume/"):
                _check_resume(f"rank {rank} {label}", result)
                assert result["world"] == 4
    for label in per_rank[0]:
        if label.startswith("save/"):
            _check_save(label, [r[label] for r in per_rank])


@pytest.mark.distributed
def test_checkpoints_on_two_ranks(checkpoints: Any, four_rank_results: Any, tmp_path: Path) -> None:
    ckpts, refs, root = checkpoints
    four, four_dir = four_rank_results
    corpus = _fault_corpus(root, Path(ckpts["llama"]), Path(ckpts["llama_sharded"]))
    faults = [(case, path, strict) for case, path, strict, _, _ in corpus]
    per_rank = run_distributed(
        run_two_ranks,
        2,
        ckpts,
        refs,
        str(tmp_path),
        faults,
        str(four_dir / "dcp-fsdp4"),
        timeout_s=600,
        pg_timeout_s=60,
    )
    for rank, results in enumerate(per_rank):
        for label, result in results.items():
            if label.startswith("load/"):
                _check_load(f"rank {rank} {label}", result)
            elif label.startswith("resume/"):
                _check_resume(f"rank {rank} {label}", result)
            elif label.startswith("peft/"):
                assert result["logits"] <= 1e-6, f"rank {rank} {label}: {result}"
                assert rank != 0 or result["adapters_equal"], f"{label}: saved adapters differ after reload"
        # Saved by 4 FSDP ranks, resumed by 2: the same next-step losses.
        resharded, expected = results["reshard/4->2"], four[0]["resume/fsdp4"]["expected"][:2]
        assert resharded["world"] == 4
        assert resharded["got"] == pytest.approx(expected, abs=1e-6), (
            f"rank {rank}: {resharded} vs {expected}"
        )
    for label in per_rank[0]:
        if label.startswith("save/"):
            _check_save(label, [r[label] for r in per_rank])
    for case, _, _, expected_error, text in corpus:
        results = [r[f"fault/{case}"] for r in per_rank]
        if expected_error is None:
            assert all(r["error"] is None for r in results), f"{case}: {results}"
            continue
        for rank, r in enumerate(results):
            assert r["error"] is not None, f"{case}: rank {rank} loaded a broken checkpoint"
            assert r["error"].startswith(expected_error), f"{case}: rank {rank}: {r['error']}"
            assert text in r["error"], f"{case}: rank {rank}: {text!r} not in {r['error']}"
            assert r["still_meta"] and r["untouched"], f"{case}: rank {rank} changed the model: {r}"
        assert len({r["error"] for r in results}) == 1, f"{case}: ranks disagree: {results}"


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["hf", "dcp", "async"])
def test_killed_rank_leaves_previous_checkpoint(checkpoints: Any, tmp_path: Path, kind: str) -> None:
    from automodel_checkpoint import is_complete_checkpoint, latest_checkpoint

    ckpts, _, _ = checkpoints
    with pytest.raises(DistributedRunError) as raised:
        run_distributed(
            kill_during_save, 2, kind, str(tmp_path), ckpts["llama"], timeout_s=300, pg_timeout_s=20
        )
    # Exit code 17 comes only from inside the write: the save was interrupted, not skipped. The staging
    # folder may be gone (a surviving rank that sees the failed write removes it) or left behind.
    assert "code 17" in str(raised.value), str(raised.value)[-2000:]
    assert is_complete_checkpoint(tmp_path / "step_1")
    assert not (tmp_path / "step_2").exists(), "a half-written checkpoint was published"
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
