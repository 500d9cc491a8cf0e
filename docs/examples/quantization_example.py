"""automodel-quant alone: quantization-aware training, then FP8 training, of small models (one process).

python quantization_example.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_quant import FP8Config, QATConfig, apply_fp8_to_model, convert_qat_model, prepare_qat_model

config = LlamaConfig(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512,
)  # fmt: skip
ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))


def train(model: torch.nn.Module, steps: int = 2) -> float:
    """A few AdamW steps on one batch; the last loss."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


# QAT: fake-quantized int4 weights and int8 activations while training, real int4/int8 layers after.
torch.manual_seed(0)
model = LlamaForCausalLM(config).to(torch.bfloat16)  # QAT needs a bfloat16 model
quantizer = QATConfig(quantizer_type="int8_dynact_int4weight", groupsize=32).create_quantizer()
model, mode = prepare_qat_model(model, quantizer)
print(f"QAT ({mode}) loss after 2 steps: {train(model):.4f}")
convert_qat_model(model)  # now quantized for inference

# FP8: the linear layers run float8 matmuls (torchao); on CPU and older GPUs set emulate=True.
torch.manual_seed(0)
model = apply_fp8_to_model(LlamaForCausalLM(config), config=FP8Config(enabled=True, emulate=True))
print(f"FP8 loss after 2 steps: {train(model):.4f}")
