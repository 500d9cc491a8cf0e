"""Single-process saves: consolidated HF checkpoints, HF-PEFT adapters, DCP resume."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from automodel_checkpoint import (
    AsyncCheckpointer,
    is_complete_checkpoint,
    latest_checkpoint,
    load_distributed_checkpoint,
    save_distributed_checkpoint,
    save_hf_checkpoint,
)
from automodel_checkpoint.hf_save import parse_size, plan_shards
from automodel_testing import build_tiny_model, make_batch


def _from_pretrained(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path)


def test_parse_size_and_plan() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(100) == 100
    assert parse_size("1.5 kb") == 1500
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="at least 1 byte"):
        parse_size(0)
    assert plan_shards([("a", 5), ("b", 5)], 10) == [("model.safetensors", ["a", "b"])]
    plan = plan_shards([("a", 6), ("b", 3), ("c", 20), ("d", 1)], 10)
    assert plan == [
        ("model-00001-of-00003.safetensors", ["a", "b"]),
        ("model-00002-of-00003.safetensors", ["c"]),  # bigger than the limit: a file of its own
        ("model-00003-of-00003.safetensors", ["d"]),
    ]


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_consolidated_save_loads_with_from_pretrained(tmp_path: Path, family: str) -> None:
    model = build_tiny_model(family, seed=8)
    out = save_hf_checkpoint(model, tmp_path / "ck", max_shard_size="30KB")
    assert is_complete_checkpoint(out) and latest_checkpoint(tmp_path) == out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("model-*.safetensors")}
    if family == "llama_tied":
        assert "lm_head.weight" not in index["weight_map"]  # saved once, under its source name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    reloaded = _from_pretrained(out)
    expected = model.state_dict()
    assert set(reloaded.state_dict()) == set(expected)
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    with pytest.raises(FileExistsError):
        save_hf_checkpoint(model, out)


def test_save_in_another_dtype(tmp_path: Path) -> None:
    model = build_tiny_model("llama", seed=8)
    out = save_hf_checkpoint(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    reloaded = _from_pretrained(out)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight.detach().to(torch.bfloat16).float())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_peft_adapters_round_trip(tmp_path: Path) -> None:
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(build_tiny_model("llama", seed=1), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    from automodel_peft import save_adapters  # the adapters' owner saves them, from any wrapper

    out = save_adapters(model, tmp_path / "adapter")
    assert {p.name for p in out.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    loaded = peft.PeftModel.from_pretrained(build_tiny_model("llama", seed=1), out)
    batch = make_batch(128, 2, 8)
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids=batch["input_ids"]).logits, model(input_ids=batch["input_ids"]).logits
        )
    with pytest.raises(ValueError, match="no LoRA adapter 'default'"):
        save_adapters(build_tiny_model("llama"), tmp_path / "none")
    with pytest.raises(ValueError, match="no LoRA adapter 'other'"):
        save_adapters(model, tmp_path / "other", adapter_name="other")


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    """One optimizer step; the loss before it."""
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def test_distributed_checkpoint_resume_single_process(tmp_path: Path) -> None:
    batches = [make_batch(128, 2, 8, seed=s) for s in range(3)]

    model = build_tiny_model("llama", seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, batches[0])
    save_distributed_checkpoint(model, opt, tmp_path / "step_1", step=1, extra_state={"epoch": 0})
    with AsyncCheckpointer() as checkpointer:  # the same state, written while training goes on
        checkpointer.save(model, opt, tmp_path / "async_1", step=1, extra_state={"epoch": 0})
        expected = [step(model, opt, batches[1]), step(model, opt, batches[2])]
        assert checkpointer.wait() == tmp_path / "async_1" and checkpointer.wait() is None
        assert checkpointer.last_blocking_s > 0 and not checkpointer.in_flight
    for saved in ("step_1", "async_1"):
        fresh = build_tiny_model("llama", meta=True)
        opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        info = load_distributed_checkpoint(fresh, opt2, tmp_path / saved)
        assert info.step == 1 and info.extra_state == {"epoch": 0} and info.world_size == 1
        assert [step(fresh, opt2, batches[1]), step(fresh, opt2, batches[2])] == expected, saved
    (tmp_path / "broken").mkdir()
    with pytest.raises(FileNotFoundError, match="completion marker"):
        load_distributed_checkpoint(fresh, opt2, tmp_path / "broken")
    save_hf_checkpoint(model, tmp_path / "hf")
    with pytest.raises(ValueError, match="not a distributed one"):
        load_distributed_checkpoint(fresh, opt2, tmp_path / "hf")


@pytest.mark.parametrize("hf_weights", ["also", "only"])
def test_a_checkpoint_with_its_weights_in_the_hugging_face_format(tmp_path: Path, hf_weights: str) -> None:
    """``hf/`` loads with plain transformers; resuming from it (and DCP's optimizer state) is exact."""
    from torch.distributed.checkpoint import FileSystemReader

    from automodel_checkpoint import read_marker

    batches = [make_batch(128, 2, 8, seed=s) for s in range(3)]

    model = build_tiny_model("llama", seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, batches[0])
    with AsyncCheckpointer() as checkpointer:
        checkpointer.save(model, opt, tmp_path / "step_1", step=1, hf_weights=hf_weights)
    expected = [step(model, opt, batches[1]), step(model, opt, batches[2])]
    folder = tmp_path / "step_1"
    assert set(read_marker(folder)["files"]) >= {"hf/model.safetensors", "hf/config.json"}
    in_dcp = {k.split(".")[0] for k in FileSystemReader(str(folder)).read_metadata().state_dict_metadata}
    assert in_dcp == ({"optim"} if hf_weights == "only" else {"model", "optim"})
    reloaded = _from_pretrained(folder / "hf")  # no automodel code needed to read the weights
    assert reloaded.state_dict().keys() == build_tiny_model("llama").state_dict().keys()
    fresh = build_tiny_model("llama", meta=True)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert load_distributed_checkpoint(fresh, opt2, folder).step == 1
    assert [step(fresh, opt2, batches[1]), step(fresh, opt2, batches[2])] == expected
    with pytest.raises(ValueError, match="hf_weights='only' keeps the optimizer's state in DCP"):
        save_distributed_checkpoint(model, None, tmp_path / "x", hf_weights="only")
    with pytest.raises(ValueError, match="hf_weights='some'"):
        save_distributed_checkpoint(model, opt, tmp_path / "x", hf_weights="some")
