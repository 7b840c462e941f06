"""``pretrain finetune``: task heads and T5 text-to-text finetuning on pretrained backbones, at any size.

config (recipe schema; the Trainer sections are `pretrain fit`'s) -> backbone (load, freeze) + lora (peft
adapters) + data (datamodules, encodings) -> module (LightningModules, using metrics and decoding) -> run (train
with ``pretrain.training.trainer.build_trainer`` under DDP / FSDP2 / ZeRO, evaluate, save through checkpoint)
<- cli (arguments only).
"""
