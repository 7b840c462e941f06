"""``pretrain finetune``: task heads and T5 text-to-text finetuning on pretrained backbones.

config (recipe schema) -> backbone (load, freeze) + data (datamodules, encodings) -> module (LightningModules, using
metrics and decoding) -> run (train, evaluate, save through checkpoint) <- cli (arguments only).
"""
