"""Memory per rank of a frozen vision tower under each ``FSDP2Config.multimodal.frozen_sharding``.

A LLaVA (CLIP tower of hidden 256 and 4 layers, Llama of hidden 256 and 4 layers; derived from the
family's defaults by `automodel_testing.tiny.derive_tiny_config`) is saved with ``save_pretrained``,
built on meta and loaded through `apply_model_infrastructure` on 2 gloo ranks with
``freeze_config={"freeze_vision_tower": True}`` and each ``frozen_sharding``. Measured in the same
run, per rank:

- resident: bytes of the tower's parameters the rank holds after loading (a shard for ``root`` and
  ``per_layer``, the whole tower for ``replicate``), as a ratio to the unsharded tower;
- whole in forward: the most tower bytes whole (not sharded) at once during one forward with an image
  (the whole tower for ``root`` and ``replicate``, one block and the embeddings for ``per_layer``), as a
  ratio to the unsharded tower.

    uv run --all-packages python benchmarks/bench_vlm_frozen.py
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from _launch import launch

SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4}


def _save(folder: str) -> None:
    from transformers import AutoModelForImageTextToText

    from automodel_testing.tiny import derive_tiny_config
    from automodel_testing.vlm import image_batch

    config = derive_tiny_config("llava")
    for name, value in SIZES.items():
        setattr(config.vision_config, name, value)
    config.projector_hidden_act = "gelu"
    model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(folder)
    # The batch comes from the whole model: image_batch calls get_image_features, which a sharded model
    # cannot run outside its root's forward.
    inputs, _ = image_batch(model, 1, 24)
    torch.save(inputs, f"{folder}/batch.pt")


def _bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def _measure(folder: str, sharding: str) -> dict[str, int]:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoConfig, AutoModelForImageTextToText

    from automodel_distributed.config import FSDP2Config, MultimodalDistributedConfig
    from automodel_distributed.multimodal import model_parts
    from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
    from automodel_mesh import MeshContext

    config = FSDP2Config(
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
        multimodal=MultimodalDistributedConfig(frozen_sharding=sharding),  # type: ignore[arg-type]
    )
    ctx = MeshContext.build(config)
    infra = instantiate_infrastructure(distributed_config=config, device=torch.device("cpu"), mesh=ctx)
    with torch.device("meta"):
        model: Any = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder))
    model = apply_model_infrastructure(
        model,
        is_meta_device=True,
        device=torch.device("cpu"),
        model_wrapper=infra.model_wrapper,
        mesh=ctx,
        load_base_model=True,
        pretrained_model_name_or_path=folder,
        freeze_config={"freeze_vision_tower": True, "freeze_embeddings": False},
    )
    (tower,) = model_parts(model).modules("vision")
    full = sum(p.numel() * p.element_size() for p in tower.parameters())
    resident = sum(_bytes(p) for p in tower.parameters())
    # The tower bytes whole at once: FSDP2 registers the unsharded parameters of a unit on its modules
    # between its pre-forward all-gather and its reshard, so count what is not a DTensor at each step.
    peak = [0]

    def gathered(*_: Any) -> None:
        now = sum(p.numel() * p.element_size() for p in tower.parameters() if not hasattr(p, "to_local"))
        peak[0] = max(peak[0], now)

    handles = [m.register_forward_pre_hook(gathered) for m in tower.modules() if m is not tower]
    inputs = torch.load(f"{folder}/batch.pt")
    with torch.no_grad():
        model(**inputs)
    for handle in handles:
        handle.remove()
    return {"full": full, "resident": resident, "gathered": peak[0]}


def _all(folder: str) -> dict[str, dict[str, int]]:
    return {sharding: _measure(folder, sharding) for sharding in ("root", "per_layer", "replicate")}


def measure(ranks: int = 2) -> dict[str, dict[str, int]]:
    """``frozen_sharding`` -> the worst rank's ``resident`` and ``gathered`` bytes, and ``full`` (one run).

    Every sharding is measured in the same launch, on the same checkpoint and ranks.
    """
    with tempfile.TemporaryDirectory() as folder:
        _save(folder)
        results = launch(_all, ranks, folder, timeout_s=900)
    return {
        sharding: {
            "full": row["full"],
            **{k: max(r[sharding][k] for r in results) for k in ("resident", "gathered")},
        }
        for sharding, row in results[0].items()
    }


def main() -> None:
    results = measure()
    print("frozen vision tower, bytes per rank (2 ranks), as a ratio to the unsharded tower")
    print(f"{'frozen_sharding':<16} {'resident':>10} {'ratio':>7} {'whole':>10} {'ratio':>7}")
    for sharding, row in results.items():
        full = row["full"]
        print(
            f"{sharding:<16} {row['resident']:>10} {row['resident'] / full:>7.2f} "
            f"{row['gathered']:>10} {row['gathered'] / full:>7.2f}"
        )


if __name__ == "__main__":
    main()
