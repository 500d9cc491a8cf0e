"""automodel-infra: the two orchestration calls on a meta-device Llama, FSDP2 over every rank.

torchrun --standalone --nproc-per-node 2 infra_example.py
"""

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_distributed import FSDP2Config
from automodel_infra import apply_model_infrastructure, instantiate_infrastructure
from automodel_mesh import MeshContext, ParallelismSizes

dist.init_process_group("gloo")  # torchrun set RANK / WORLD_SIZE; "nccl" on GPUs
device = torch.device("cpu")  # torch.device("cuda", local_rank) on GPUs
config = LlamaConfig(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512,
)  # fmt: skip
checkpoint = Path(tempfile.gettempdir()) / "automodel-docs-infra"
if dist.get_rank() == 0:  # stands in for a Hugging Face checkpoint
    LlamaForCausalLM(config).save_pretrained(checkpoint)
dist.barrier()

distributed_config = FSDP2Config(
    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
)
mesh = MeshContext.build(distributed_config, ParallelismSizes(dp_size=-1))  # dp = all ranks
model_wrapper, autopipeline, parallelize_fn, qat_quantizer = instantiate_infrastructure(
    distributed_config=distributed_config, activation_checkpointing=True, device=device, mesh=mesh
)
with torch.device("meta"):
    model = LlamaForCausalLM(config)
model = apply_model_infrastructure(
    model,
    is_meta_device=True,
    device=device,
    model_wrapper=model_wrapper,
    mesh=mesh,
    autopipeline=autopipeline,
    parallelize_fn=parallelize_fn,
    qat_quantizer=qat_quantizer,
    load_base_model=True,
    pretrained_model_name_or_path=str(checkpoint),
)

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
