"""automodel-distributed alone: shard a transformers Llama with FSDP2 and train a few steps.

torchrun --standalone --nproc-per-node 2 distributed_example.py
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_distributed import FSDP2Config, FSDP2Manager
from automodel_mesh import MeshContext, ParallelismSizes

dist.init_process_group("gloo")  # "nccl" on GPUs
torch.manual_seed(0)  # the same initial weights on every rank
config = LlamaConfig(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512,
)  # fmt: skip
model = LlamaForCausalLM(config)

# fp32 parameters on CPU (the default policy computes in bf16, which CPUs run slowly).
strategy = FSDP2Config(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
mesh = MeshContext.build(strategy, ParallelismSizes())  # every rank shards (dp_shard = world size)
model = FSDP2Manager(strategy, mesh.device_mesh).parallelize(model)

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
for step in range(3):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
dist.destroy_process_group()
