"""automodel-peft alone: LoRA adapters on a Llama, a few steps, adapters saved in the format peft reads.

python peft_example.py
"""

import tempfile

import torch
from peft import PeftModel
from transformers import LlamaConfig, LlamaForCausalLM

from automodel_peft import PeftConfig, apply_lora, save_adapters

config = LlamaConfig(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512,
)  # fmt: skip
torch.manual_seed(0)
base = LlamaForCausalLM(config)
model = LlamaForCausalLM(config)
model.load_state_dict(base.state_dict())

model = apply_lora(
    model, PeftConfig(target_modules=["q_proj", "v_proj"], dim=8, alpha=32)
)  # freezes the base
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
print(f"trainable parameters: {trainable} of {sum(p.numel() for p in model.parameters())}")

ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
for step in range(3):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")

with tempfile.TemporaryDirectory() as folder:
    save_adapters(model, folder)  # adapter_model.safetensors + adapter_config.json
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        theirs = PeftModel.from_pretrained(base, folder)(input_ids=ids).logits
    print(f"plain peft reproduces the adapted model: {torch.allclose(ours, theirs, atol=1e-5)}")
