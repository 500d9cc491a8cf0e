"""automodel-distributed checkpoints: load a HF checkpoint straight into FSDP2 shards, save it back.

torchrun --standalone --nproc-per-node 2 checkpoints_example.py
"""

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from automodel_distributed import FSDP2Config, FSDP2Manager, load_hf_checkpoint, save_hf_checkpoint
from automodel_mesh import MeshContext, ParallelismSizes

dist.init_process_group("gloo")
config = LlamaConfig(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512,
)  # fmt: skip
folder = Path(tempfile.gettempdir()) / "automodel-docs-checkpoint"
if dist.get_rank() == 0:  # stands in for a downloaded Hugging Face checkpoint
    LlamaForCausalLM(config).save_pretrained(folder / "hf")
dist.barrier()

with torch.device("meta"):  # no memory for weights yet
    model = LlamaForCausalLM(config)
strategy = FSDP2Config(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
mesh = MeshContext.build(strategy, ParallelismSizes())
model = FSDP2Manager(strategy, mesh.device_mesh).parallelize(model)
report = load_hf_checkpoint(model, folder / "hf")  # each rank reads only the slices it owns
print(f"rank {dist.get_rank()}: read {report.bytes_read / 2**20:.1f} MiB")

save_hf_checkpoint(model, folder / "out", overwrite=True)  # consolidated safetensors + config.json
if dist.get_rank() == 0:
    reloaded = AutoModelForCausalLM.from_pretrained(folder / "out")  # plain transformers reads it
    original = AutoModelForCausalLM.from_pretrained(folder / "hf")
    same = all(
        torch.equal(a, b)
        for a, b in zip(reloaded.state_dict().values(), original.state_dict().values(), strict=True)
    )
    print(f"round trip identical: {same}")
dist.destroy_process_group()
