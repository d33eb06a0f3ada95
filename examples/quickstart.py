import torch
from transformers import LlamaConfig, LlamaForCausalLM

import shardcore

torch.manual_seed(0)  # every rank builds the same weights
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
model = LlamaForCausalLM(config)

model = shardcore.shard(model, {"version": 2, "reshard_after_forward": True})  # FSDP2
optimizer = torch.optim.AdamW(model.parameters())  # build it after shard(): parameters are now sharded
for step in range(3):
    ids = torch.randint(0, 256, (4, 32), device=model.device)  # token ids, on the device the model trains on
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")
