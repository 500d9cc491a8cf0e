"""automodel-distributed's Hugging Face checkpoint functions, re-exported for MoE users.

They convert transformers' per-expert on-disk layout to and from the fused in-memory experts (from the
model's own conversion mapping), and each rank reads only the experts and slices it holds.
"""

from automodel_distributed.checkpoint import load_hf_checkpoint, save_hf_checkpoint

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint"]
