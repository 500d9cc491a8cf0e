"""automodel-pipelining alone: split a Llama into 2 pipeline stages and train with 1F1B.

torchrun --standalone --nproc-per-node 2 pipelining_example.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_mesh import MeshContext, MeshKind, ParallelismSizes
from automodel_pipelining import AutoPipeline, PipelineConfig


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of one microbatch (the last stage calls it)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


dist.init_process_group("gloo")
torch.manual_seed(0)  # every rank builds the same model, then keeps its own stage
config = LlamaConfig(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False,
)  # fmt: skip
model = LlamaForCausalLM(config)

ctx = MeshContext.build(MeshKind.FSDP2, ParallelismSizes(pp_size=2))
pipe = AutoPipeline.from_config(
    PipelineConfig(pp_schedule="1f1b", pp_batch_size=4, pp_microbatch_size=1), ctx
)
pipe.build(model, loss_fn=loss_fn)  # no parallelize_fn: the stages are not sharded further
optimizer = torch.optim.AdamW([p for part in pipe.parts for p in part.parameters()], lr=1e-3)

ids = torch.randint(0, config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
for step in range(3):
    losses: list[torch.Tensor] = []
    pipe.step(ids, target=ids, losses=losses)  # every rank runs the same loop
    pipe.scale_grads()  # the schedule sums microbatch gradients; make them a mean
    optimizer.step()
    optimizer.zero_grad()
    if pipe.info.has_last_stage:
        print(f"step {step}: loss {torch.stack(losses).mean().item():.4f}")
dist.destroy_process_group()
