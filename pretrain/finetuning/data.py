"""Finetuning data: ``FinetuneDataModule`` (heads; GLUE-style TSV/JSONL) or ``Text2TextDataModule`` (GLUE
rendered as text, or line-aligned parallel files), with each architecture's encoding of an example."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from pretrain.errors import InputError
from pretrain.finetuning.config import FinetuneConfig


def default_template(arch: str, pair: bool, tokenizer: Tokenizer, roles: dict[str, str]) -> str | None:
    """Encoding of an example for each architecture (None: the datamodule's BERT default ``[CLS] A [SEP] B [SEP]``).

    decoder (GPT-1's task framing): ``<s> A <sep> B <cls>`` -- start, delimiter, extract; the head reads the final
    state. encoder-decoder (T5): ``A </s> B </s>``."""
    from pretrain.datamodules.special_tokens import special_token_id

    def tok(role: str) -> str:
        token = tokenizer.id_to_token(special_token_id(tokenizer, role, roles))
        assert token is not None  # special_token_id gives an id of the vocabulary
        return token

    if arch == "decoder":
        return f"{tok('bos')} $A {tok('sep')} $B {tok('cls')}" if pair else f"{tok('bos')} $A {tok('cls')}"
    if arch == "encoder-decoder":
        return f"$A {tok('eos')} $B {tok('eos')}" if pair else f"$A {tok('eos')}"
    return None


def build_datamodule(cfg: FinetuneConfig, tokenizer: Tokenizer, arch: str, roles: dict[str, str]) -> Any:
    """``FinetuneDataModule`` (heads) or ``Text2TextDataModule`` (text2text) for the configured files."""
    d = cfg.data
    if cfg.head.kind == "text2text":
        from pretrain.datamodules.special_tokens import special_token_id
        from pretrain.datamodules.text2text import Text2TextDataModule, glue_pairs, parallel_pairs

        if d.train_target_file:
            if bool(d.val_file) != bool(d.val_target_file):
                raise InputError(
                    "data.val_file and data.val_target_file go together (line-aligned source/target)"
                )
            train = parallel_pairs(d.train_file, d.train_target_file, d.source_prefix)
            val = (
                parallel_pairs(d.val_file, d.val_target_file, d.source_prefix)
                if d.val_file and d.val_target_file  # both or neither (checked above)
                else None
            )
        else:
            if d.task is None:
                raise InputError(
                    "text2text needs data.task (a GLUE task rendered as text) or data.train_target_file"
                )
            train = glue_pairs(d.train_file, d.task)
            val = glue_pairs(d.val_file, d.task) if d.val_file else None
        pad = special_token_id(tokenizer, "pad", roles)
        return Text2TextDataModule(
            tokenizer,
            train,
            val,
            pad_id=pad,
            eos_id=special_token_id(tokenizer, "eos", roles),
            decoder_start_id=pad,
            max_source_length=d.max_length,
            max_target_length=d.max_target_length,
            micro_batch_size=d.micro_batch_size,
            num_workers=d.num_workers,
            seed=cfg.seed,
            unpadded=d.unpadded,
        )
    from pretrain.datamodules.finetune import FinetuneDataModule, task_format

    columns = d.text_columns or (task_format(d.task).text_columns if d.task else ())
    pair = len(columns) == 2
    template = d.template or default_template(arch, pair, tokenizer, roles)
    return FinetuneDataModule(
        tokenizer,
        d.train_file,
        d.val_file,
        task=d.task,
        text_columns=d.text_columns,
        label_column=d.label_column,
        regression=d.regression,
        header=d.header,
        template=template,
        special_tokens=roles,
        max_length=d.max_length,
        micro_batch_size=d.micro_batch_size,
        num_workers=d.num_workers,
        seed=cfg.seed,
        unpadded=d.unpadded and cfg.head.kind == "sequence",  # token / multiple-choice heads read padded rows
    )
