"""A Transformers Trainer script, sharded by shardcore: the Transformers FSDP guide's script with one
changed import. The fsdp_config is one of the JSON files the other examples use, and only it
changes between backends.

    torchrun --standalone --nproc_per_node 2 examples/trainer/train.py
    accelerate launch --multi_gpu --num_processes 2 examples/trainer/train.py
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python examples/trainer/train.py examples/configs/xla_fsdp.json
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python examples/trainer/train.py examples/configs/xla_spmd.json
"""

import os
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import shardcore
from shardcore.integrations.transformers import Trainer  # was: from transformers import Trainer


def main(fsdp_config: str) -> None:
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
    ids = (torch.randint(0, 200, (64, 1), generator=torch.Generator().manual_seed(1)) + torch.arange(32)) % 256
    train_dataset = [{"input_ids": row, "labels": row} for row in ids]

    args = TrainingArguments(
        output_dir="trainer-example",
        fsdp=True,
        fsdp_config=fsdp_config,  # the shard config: any key shardcore reads
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        optim="adamw_torch",  # the default, fused AdamW, has no XLA kernels
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        # CPU ranks: accelerate runs them distributed only with it; on XLA, PJRT_DEVICE is the device
        use_cpu=not torch.cuda.is_available() and "PJRT_DEVICE" not in os.environ,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
    trainer.train()
    trainer.save_model()  # a FULL checkpoint: LlamaForCausalLM.from_pretrained("trainer-example") loads it
    if trainer.is_world_process_zero():
        print("final loss", trainer.state.log_history[-2]["loss"])
    trainer.end()  # destroys the process group (transformers' own call; gloo can abort if it is left to exit)


if __name__ == "__main__":
    config = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parents[1] / "configs" / "fsdp2.json")
    # torchrun / accelerate launch started the ranks: main runs once here. XLA FSDP: once per device
    # (xmp.spawn; on CPU, device threads). XLA SPMD: once, with SPMD mode on before TrainingArguments.
    shardcore.launch(main, config, args=(config,))
