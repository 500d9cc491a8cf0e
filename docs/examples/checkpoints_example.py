"""automodel-checkpoint alone: a HF checkpoint straight into shards you made with torch, and back.

torchrun --standalone --nproc-per-node 2 checkpoints_example.py

Needs only ``pip install automodel-checkpoint`` (it brings torch and transformers). The model is built
on the meta device and sharded by hand twice, with torch's own APIs: FSDP2 (``fully_shard``) and tensor
parallelism (``parallelize_module``). Each rank then reads only the bytes of the slices it holds.
"""

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from automodel_checkpoint import load_hf_checkpoint, save_hf_checkpoint

dist.init_process_group("gloo")  # "nccl" on GPUs, with init_device_mesh("cuda", ...)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
config = LlamaConfig(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512,
)  # fmt: skip
folder = Path(tempfile.gettempdir()) / "automodel-docs-checkpoint"
if dist.get_rank() == 0:  # stands in for a downloaded Hugging Face checkpoint
    LlamaForCausalLM(config).save_pretrained(folder / "hf")
dist.barrier()


def meta_model() -> LlamaForCausalLM:
    """The model on the meta device: no memory for its weights yet."""
    with torch.device("meta"):
        return LlamaForCausalLM(config)


# FSDP2 by hand: one unit per decoder layer, then the root.
fsdp = meta_model()
for layer in fsdp.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(fsdp, mesh=mesh)
report = load_hf_checkpoint(fsdp, folder / "hf")  # materialises the shards, reads only their bytes
print(f"rank {dist.get_rank()}: FSDP2 shards read {report.bytes_read / 2**20:.2f} MiB")

# Tensor parallelism by hand: column-parallel in, row-parallel out, in every layer.
tp = meta_model()
for layer in tp.model.layers:
    parallelize_module(
        layer,
        mesh,
        {
            **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        },
    )
load_hf_checkpoint(tp, folder / "hf")

reference = AutoModelForCausalLM.from_pretrained(folder / "hf")  # the same weights, unsharded
ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    expected = reference(ids).logits
    for name, model in (("FSDP2", fsdp), ("TP", tp)):
        error = (model(ids).logits - expected).abs().max().item()
        assert error < 1e-5, f"{name} logits differ from transformers' by {error}"

save_hf_checkpoint(fsdp, folder / "out", overwrite=True)  # consolidated safetensors + config.json
if dist.get_rank() == 0:
    reloaded = AutoModelForCausalLM.from_pretrained(folder / "out")  # plain transformers reads it
    saved, original = reloaded.state_dict(), reference.state_dict()
    same = saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in saved)
    print(f"FSDP2 and TP logits equal transformers'; saved checkpoint identical: {same}")
    assert same
dist.barrier()  # the ranks leave together: none exits while another still uses the group
dist.destroy_process_group()
