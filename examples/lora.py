"""LoRA fine-tuning with shardcore: a PEFT model sharded, trained, saved as the adapter PEFT loads, and
exported merged. Run on 2 CPU ranks:

    torchrun --standalone --nproc_per_node 2 examples/lora.py /tmp/lora-out
"""

import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import shardcore

out = sys.argv[1] if len(sys.argv) > 1 else "lora-out"
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
torch.manual_seed(0)  # every rank builds the same base (in real use: from_pretrained)
base = LlamaForCausalLM(config)
model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))

model = shardcore.shard(model, {"version": 2})  # the base's decoder layers are the units, adapters inside them
sc = shardcore.handle(model)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)  # the adapters only
data = torch.Generator().manual_seed(1)
for step in range(4):
    ids = torch.randint(0, 256, (4 * sc.world_size, 32), generator=data)  # one global batch, the same on every rank
    batch = sc.local_batch({"input_ids": ids, "labels": ids})  # this rank's rows
    loss = model(**batch).loss
    loss.backward()
    shardcore.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad()
    loss = sc.reduce(loss.detach())  # the mean over ranks
    if sc.is_main_process:
        print(f"step {step}: loss {loss.item():.4f}")

shardcore.save(model, f"{out}/adapter", optimizer)  # adapter_config.json + adapter_model.safetensors (+ optimizer)
shardcore.save(model, f"{out}/merged", merged=True)  # a plain LlamaForCausalLM with the adapter folded in

probe = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
with torch.no_grad():
    sharded_logits = model(input_ids=probe.to(sc.device)).logits  # every rank runs the forward (it gathers)
if sc.is_main_process:  # on one device, as anyone who downloads the adapter would
    torch.manual_seed(0)
    peft_model = PeftModel.from_pretrained(LlamaForCausalLM(config), f"{out}/adapter")
    merged = AutoModelForCausalLM.from_pretrained(f"{out}/merged")
    with torch.no_grad():
        for name, m in (("PeftModel.from_pretrained", peft_model), ("merged from_pretrained", merged)):
            diff = (m(input_ids=probe).logits - sharded_logits.cpu()).abs().max().item()
            print(f"{name}: max |logits - sharded logits| = {diff:.2e}")
            assert diff < 1e-4, diff
