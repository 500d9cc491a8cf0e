"""automodel-moe: expert parallelism (2 experts per rank) with FSDP2 for a Qwen3-MoE model.

torchrun --standalone --nproc-per-node 2 moe_example.py
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from automodel_distributed import FSDP2Config
from automodel_mesh import MeshContext, ParallelismSizes
from automodel_moe import parallelize_model

dist.init_process_group("gloo")
torch.manual_seed(0)  # the same weights on every rank before sharding
config = Qwen3MoeConfig(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=4,
    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512,
)  # fmt: skip
model = Qwen3MoeForCausalLM(config)

ctx = MeshContext.build(FSDP2Config(), ParallelismSizes(ep_size=2))  # moe mesh (ep_shard 1, ep 2)
fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
parallelize_model(model, ctx.device_mesh, ctx.moe_mesh, mp_policy=fp32, **ctx.parallelize_axis_kwargs())

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
for step in range(3):
    loss = model(input_ids=ids, labels=ids).loss  # tokens travel to their experts by all-to-all
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
dist.destroy_process_group()
