"""``pretrain finetune <recipe>``: task heads and T5 text-to-text finetuning on pretrained backbones.

A finetuning recipe (``recipes/finetune-*.yaml``) composes pieces from ``configs/finetune/<group>/<name>.yaml``::

    defaults: [backbone/minilm, task/sst2, optim/bert]
    name: finetune-sst2-minilm
    trainer: {max_steps: 2000, max_time_minutes: 8}

Backbones load from our pretraining checkpoints (``.ckpt`` with the tokenizer inside), from Hugging Face directories
(``config.json`` + ``model.safetensors`` + tokenizer files, through ``pretrain.models.hf.from_hf``), or start from random
weights (``init.model`` + ``init.tokenizer``; the control in transfer experiments). Heads are ``pretrain.models.heads``;
``head.kind: text2text`` instead trains the encoder-decoder's own LM head on source -> target text and evaluates
decoded outputs (greedy / sampling / beam search) by exact match or BLEU (sacrebleu).

Metrics (torchmetrics): accuracy, f1 (binary: positive class = the second label; else macro), mcc (Matthews),
pearson, spearman (regression), and for text-to-text accuracy (exact match) and bleu.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from omegaconf import OmegaConf
from tokenizers import Tokenizer
from torch import Tensor, nn

from pretrain.config import CONFIG_DIR, OptimConfig, compose, structured
from pretrain.models.config import ModelConfig
from pretrain.models.heads import TaskModel
from pretrain.models.transformer import Transformer
from pretrain.training.optim import lr_lambda, param_groups

IGNORE_INDEX = -100
FINETUNE_CONFIGS = CONFIG_DIR / "finetune"
CLASS_METRICS = ("accuracy", "f1", "mcc")
REGRESSION_METRICS = ("pearson", "spearman")
TEXT_METRICS = ("accuracy", "bleu")
GLUE_METRICS = {  # the GLUE benchmark's metrics per task
    "cola": ["mcc", "accuracy"],
    "mrpc": ["accuracy", "f1"],
    "qqp": ["accuracy", "f1"],
    "stsb": ["pearson", "spearman"],
}


# ---------------------------------------------------------------------------------------------- configuration


@dataclass
class InitConfig:
    """Where the backbone comes from: ``checkpoint`` (our ``.ckpt`` or a Hugging Face directory), or random weights
    of ``model`` when ``checkpoint`` is null. ``tokenizer`` overrides (or, for random init, supplies) the tokenizer."""

    checkpoint: str | None = None
    tokenizer: str | None = None
    model: ModelConfig | None = None


@dataclass
class HeadConfig:
    kind: Literal["sequence", "token", "multiple_choice", "text2text"] = "sequence"
    pooling: Literal["first", "last", "mean", "pooler"] | None = (
        None  # None: pretrain.models.heads.default_pooling
    )
    dropout: float = 0.1
    lr: float | None = None  # head learning rate (default optim.lr)


@dataclass
class FreezeConfig:
    embeddings: bool = False
    layers: int = 0  # the lowest `layers` blocks of every stack


@dataclass
class FinetuneDataConfig:
    """Files and encoding. Classification/regression: GLUE-style TSV/JSONL (``datamodules.finetune``). Text-to-text:
    a GLUE file rendered as text (``task``), or line-aligned ``train_file`` / ``train_target_file`` (e.g. Multi30k)."""

    task: str | None = None  # GLUE task name: column defaults, text-to-text format, default metrics
    train_file: str = ""
    val_file: str | None = None
    train_target_file: str | None = None
    val_target_file: str | None = None
    source_prefix: str = ""  # text-to-text, parallel files: e.g. "translate German to English: "
    text_columns: list[str] | None = None
    label_column: str | None = None
    regression: bool | None = None
    header: bool | None = None
    template: str | None = None  # TemplateProcessing string; default per architecture (see default_template)
    special_tokens: dict[str, str] = field(default_factory=dict)  # role -> token overrides
    max_length: int = 128  # source tokens (text-to-text) or whole example
    max_target_length: int = 32
    micro_batch_size: int = 32
    num_workers: int = 0


@dataclass
class DecodingConfig:
    """Text-to-text validation decoding (all strategies use the KV cache)."""

    strategy: Literal["greedy", "sample", "beam"] = "greedy"
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    num_beams: int = 4
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True | False | "never" (transformers' semantics)


@dataclass
class FinetuneTrainerConfig:
    max_steps: int = 1000
    max_time_minutes: float | None = None  # wall-clock budget for training (then the final evaluation runs)
    accelerator: Literal["auto", "cpu", "gpu", "cuda", "mps"] = "auto"
    precision: str = "32-true"
    gradient_clip_val: float | None = 1.0
    val_check_interval: int = 200  # optimizer steps between (possibly partial) validations
    limit_val_batches: int | None = None  # during training; the final evaluation always reads the whole file
    log_every_n_steps: int = 10
    progress_bar: bool = True


@dataclass
class FinetuneConfig:
    name: str = "finetune"
    seed: int = 1234
    run_dir: str | None = None  # default runs/<name>
    init: InitConfig = field(default_factory=InitConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    metrics: list[str] | None = (
        None  # None: GLUE's metrics for data.task, accuracy / pearson+spearman otherwise
    )
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: FinetuneTrainerConfig = field(default_factory=FinetuneTrainerConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    save: bool = True  # write <run_dir>/finetuned.pt (weights, config, tokenizer, label names)


def _package_dir(name: str) -> str:
    """``${pkg:NAME}``: the directory of an installed package (located without importing it)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {name!r} is not installed (needed by ${{pkg:{name}}}); pip install it")
    return str(Path(spec.submodule_search_locations[0]))


if not OmegaConf.has_resolver("pkg"):
    OmegaConf.register_resolver("pkg", _package_dir)


def validate(raw: dict[str, Any]) -> FinetuneConfig:
    """Typed config with cross-field checks (unknown keys and wrong types name their path)."""
    cfg = structured(FinetuneConfig, raw)
    cfg.run_dir = cfg.run_dir or f"runs/{cfg.name}"
    if cfg.init.checkpoint is None and (cfg.init.model is None or cfg.init.tokenizer is None):
        raise ValueError(
            "init: give init.checkpoint (a .ckpt or Hugging Face directory), or init.model and "
            "init.tokenizer for a randomly initialised backbone"
        )
    if cfg.init.checkpoint is not None and cfg.init.model is not None:
        raise ValueError("init.model is only for random initialisation; drop it or set init.checkpoint=null")
    if not cfg.data.train_file:
        raise ValueError("data.train_file is empty; point it at a TSV/JSONL (or text) training file")
    if cfg.decoding.early_stopping not in (True, False, "never"):
        raise ValueError(
            f"decoding.early_stopping must be true, false or never, got {cfg.decoding.early_stopping!r}"
        )
    if cfg.head.kind == "text2text" and cfg.head.lr is not None:
        raise ValueError("head.lr does not apply to text2text (the LM head is part of the backbone); drop it")
    if cfg.head.kind in ("token", "multiple_choice"):
        raise ValueError(
            f"head.kind={cfg.head.kind!r} has no file datamodule in `pretrain finetune` yet (GLUE files are "
            "sentence-level); use pretrain.models.heads.TaskModel with FinetuneModule from Python"
        )
    for name in ("max_steps", "val_check_interval", "log_every_n_steps"):
        if getattr(cfg.trainer, name) < 1:
            raise ValueError(f"trainer.{name} must be >= 1, got {getattr(cfg.trainer, name)}")
    if cfg.freeze.layers < 0:
        raise ValueError(f"freeze.layers must be >= 0, got {cfg.freeze.layers}")
    return cfg


def load_config(recipe: str | Path, overrides: list[str] | None = None) -> FinetuneConfig:
    """Compose a recipe from ``configs/finetune`` pieces (``defaults: [init/minilm, data/sst2, ...]``), its body and
    ``key=value`` overrides (``pretrain.config.compose``), then validate."""
    return validate(compose(recipe, overrides, config_dir=FINETUNE_CONFIGS))


# ---------------------------------------------------------------------------------------------- backbone


def _hf_roles(directory: Path) -> dict[str, str]:
    """Special-token roles from a Hugging Face ``special_tokens_map.json`` (e.g. cls -> "[CLS]")."""
    path = directory / "special_tokens_map.json"
    if not path.is_file():
        return {}
    roles = {}
    for key, value in json.loads(path.read_text()).items():
        token = value.get("content") if isinstance(value, dict) else value
        if key.endswith("_token") and isinstance(token, str):
            roles[key.removesuffix("_token")] = token
    return roles


def _load_hf(directory: Path) -> Transformer:
    import transformers

    from pretrain.models.hf import from_hf

    config = transformers.AutoConfig.from_pretrained(directory)
    arch = (getattr(config, "architectures", None) or [""])[0]
    classes = {
        "bert": "BertForMaskedLM" if arch in ("BertForMaskedLM", "BertForPreTraining") else "BertModel",
        "gpt2": "GPT2LMHeadModel",
        "t5": "T5ForConditionalGeneration",
        "llama": "LlamaForCausalLM",
    }
    if config.model_type not in classes:
        raise ValueError(
            f"{directory}: model_type {config.model_type!r} is not supported; supported: {sorted(classes)}"
        )
    cls = getattr(transformers, classes[config.model_type])
    try:  # safetensors only: loading never unpickles
        hf_model = cls.from_pretrained(directory, use_safetensors=True)
    except OSError as err:
        raise ValueError(f"{directory}: no loadable model.safetensors ({err})") from err
    return from_hf(hf_model)


def load_backbone(init: InitConfig) -> tuple[Transformer, Tokenizer, dict[str, str]]:
    """``(backbone, tokenizer, special-token roles)`` from a pretraining checkpoint, a Hugging Face directory, or
    random weights. ValueError when no tokenizer can be found or it does not fit the model's vocabulary."""
    from datamodules.tokenizer import load_tokenizer

    roles: dict[str, str] = {}
    tokenizer = None
    if init.checkpoint is None:
        model = Transformer(init.model)
        where = "init.model"
    else:
        path = Path(init.checkpoint).expanduser()
        where = str(path)
        if path.is_dir() and (path / "config.json").is_file():
            model = _load_hf(path)
            roles = _hf_roles(path)
            if init.tokenizer is None:
                try:
                    tokenizer = load_tokenizer(path)
                except FileNotFoundError:
                    raise ValueError(
                        f"{path} has no tokenizer (tokenizer.json, or vocab.json + merges.txt); "
                        "pass init.tokenizer=PATH"
                    ) from None
        elif path.exists():
            from pretrain.training.checkpoint import load_model

            model, info, tokenizer = load_model(path)
            roles = dict(info.get("config", {}).get("tokenizer", {}).get("special_tokens") or {})
            if tokenizer is None and init.tokenizer is None:
                raise ValueError(f"checkpoint {path} holds no tokenizer; pass init.tokenizer=PATH")
        else:
            raise FileNotFoundError(
                f"init.checkpoint {path} not found (a .ckpt from `pretrain fit`, or a Hugging Face directory)"
            )
    if init.tokenizer is not None:
        tokenizer = load_tokenizer(init.tokenizer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {size} tokens but the backbone from {where} has vocab_size "
            f"{model.config.vocab_size}; use the tokenizer the backbone was trained with"
        )
    return model.train(), tokenizer, roles


def freeze(model: Transformer, embeddings: bool, layers: int) -> None:
    """Stop gradients to the embeddings and/or the lowest ``layers`` blocks of every stack."""
    stacks = [s for s in (model.encoder, model.decoder) if s is not None]
    deepest = min(len(s.blocks) for s in stacks)
    if layers > deepest:
        raise ValueError(f"freeze.layers={layers} exceeds the backbone's {deepest} layers per stack")
    modules: list[nn.Module] = [model.embed] if embeddings else []
    modules += [block for s in stacks for block in s.blocks[:layers]]
    for module in modules:
        module.requires_grad_(False)


# ---------------------------------------------------------------------------------------------- metrics


def default_metrics(cfg: FinetuneConfig, regression: bool) -> list[str]:
    if cfg.metrics is not None:
        return list(cfg.metrics)
    if cfg.head.kind == "text2text":
        return ["bleu"] if cfg.data.train_target_file else ["accuracy"]
    task = (cfg.data.task or "").lower().replace("-", "").replace("_", "")
    if task in GLUE_METRICS:
        return GLUE_METRICS[task]
    return list(REGRESSION_METRICS) if regression else ["accuracy"]


def build_metrics(names: list[str], num_labels: int, regression: bool) -> torchmetrics.MetricCollection:
    """torchmetrics for predictions (B,) of ``num_labels`` classes, or (B,) scores when ``regression``."""
    allowed = REGRESSION_METRICS if regression else CLASS_METRICS
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(
            f"metrics {unknown or names} do not apply to {'regression' if regression else 'classification'}; "
            f"choose from {list(allowed)}"
        )
    c = torchmetrics.classification
    table = {
        "accuracy": lambda: c.MulticlassAccuracy(num_labels, average="micro"),
        "f1": lambda: (
            c.BinaryF1Score() if num_labels == 2 else c.MulticlassF1Score(num_labels, average="macro")
        ),
        "mcc": lambda: c.MulticlassMatthewsCorrCoef(num_labels),
        "pearson": torchmetrics.PearsonCorrCoef,
        "spearman": torchmetrics.SpearmanCorrCoef,
    }
    return torchmetrics.MetricCollection({n: table[n]() for n in names})


def _optimizer(
    cfg: FinetuneConfig, backbone: nn.Module, head: nn.Module | None, max_steps: int
) -> dict[str, Any]:
    """AdamW (``pretrain.training.optim.param_groups``: no decay on norms, biases, embeddings) with the head at ``head.lr``,
    and the configured warmup + decay schedule applied to every group."""
    o = cfg.optim
    groups = [g | {"lr": o.lr} for g in param_groups(backbone, o.weight_decay)]
    if head is not None:
        groups += [g | {"lr": cfg.head.lr or o.lr} for g in param_groups(head, o.weight_decay)]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], betas=tuple(o.betas), eps=o.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o, max_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ---------------------------------------------------------------------------------------------- modules


class FinetuneModule(L.LightningModule):
    """A ``TaskModel`` trained with cross-entropy (classes; -100 labels ignored, e.g. sub-word tokens) or MSE
    (``regression``: one output); validation logs ``val/loss`` and the configured metrics."""

    def __init__(self, model: TaskModel, cfg: FinetuneConfig, *, num_labels: int, regression: bool):
        super().__init__()
        self.model, self.cfg, self.regression = model, cfg, regression
        self.metrics = build_metrics(default_metrics(cfg, regression), max(num_labels, 2), regression)
        self.val_loss = torchmetrics.MeanMetric()

    def _loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """(loss, predictions, labels) with ignored positions removed."""
        logits = self.model(batch["input_ids"], batch.get("attention_mask"), batch.get("token_type_ids"))
        labels = batch["labels"]
        if self.regression:
            scores = logits.squeeze(-1).float()
            return F.mse_loss(scores, labels.float()), scores.detach(), labels
        logits, labels = logits.flatten(0, -2), labels.flatten()
        keep = labels != IGNORE_INDEX
        loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)
        return loss, logits.detach().argmax(-1)[keep], labels[keep]

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, _, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, preds, labels = self._loss(batch)
        self.val_loss.update(loss, weight=labels.numel())
        self.metrics.update(preds, labels)

    def on_validation_epoch_end(self) -> None:
        values = {f"val/{k}": v for k, v in self.metrics.compute().items()} | {
            "val/loss": self.val_loss.compute()
        }
        self.log_dict(values, prog_bar=True)
        self.metrics.reset()
        self.val_loss.reset()

    def configure_optimizers(self) -> dict[str, Any]:
        return _optimizer(self.cfg, self.model.backbone, self.model.head, self.cfg.trainer.max_steps)


def decode(model: Transformer, batch: dict[str, Tensor], cfg: DecodingConfig, eos: int, pad: int) -> Tensor:
    """Generated target tokens (B, n) for the sources of ``batch`` (pad after EOS): greedy, sampling or beam."""
    from pretrain.models.beam_search import beam_search
    from pretrain.models.generation import generate

    source = {"encoder_input_ids": batch["input_ids"], "encoder_attention_mask": batch["attention_mask"]}
    if cfg.strategy == "beam":
        out = beam_search(
            model,
            None,
            cfg.max_new_tokens,
            num_beams=cfg.num_beams,
            length_penalty=cfg.length_penalty,
            early_stopping=cfg.early_stopping,
            eos_token_id=eos,
            pad_token_id=pad,
            **source,
        )
        return out.sequences[:, 1:]
    tokens = generate(
        model,
        None,
        cfg.max_new_tokens,
        greedy=cfg.strategy == "greedy",
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        eos_token_id=eos,
        pad_token_id=pad,
        **source,
    )
    return tokens[:, 1:]


class Text2TextModule(L.LightningModule):
    """Encoder-decoder trained on target tokens (mean cross-entropy); validation decodes every source and scores
    the texts against the references: ``val/accuracy`` (exact match) and/or ``val/bleu`` (sacrebleu corpus BLEU)."""

    def __init__(
        self, model: Transformer, cfg: FinetuneConfig, tokenizer: Tokenizer, *, eos_id: int, pad_id: int
    ):
        super().__init__()
        if model.config.arch != "encoder-decoder" or not model.config.lm_head:
            raise ValueError(
                f"head.kind=text2text needs an encoder-decoder backbone with an LM head (T5), got arch "
                f"{model.config.arch!r}; use head.kind=sequence for encoders and decoders"
            )
        self.metric_names = default_metrics(cfg, regression=False)
        if not self.metric_names or any(m not in TEXT_METRICS for m in self.metric_names):
            raise ValueError(f"text2text metrics must be among {list(TEXT_METRICS)}, got {self.metric_names}")
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        self.eos_id, self.pad_id = eos_id, pad_id
        self.val_loss = torchmetrics.MeanMetric()
        self.hypotheses: list[str] = []
        self.references: list[str] = []

    def _loss(self, batch: dict[str, Any]) -> Tensor:
        logits = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=batch["decoder_input_ids"],
        ).logits
        return F.cross_entropy(
            logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
        )

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch), weight=int((batch["labels"] != IGNORE_INDEX).sum()))
        tokens = decode(self.model, batch, self.cfg.decoding, self.eos_id, self.pad_id)
        self.hypotheses += [
            t.strip() for t in self.tokenizer.decode_batch(tokens.tolist(), skip_special_tokens=True)
        ]
        self.references += list(batch["targets"])

    def on_validation_epoch_end(self) -> None:
        values = {"val/loss": self.val_loss.compute()}
        pairs = list(zip(self.hypotheses, self.references, strict=True))
        if "accuracy" in self.metric_names:
            values["val/accuracy"] = torch.tensor(sum(h == r for h, r in pairs) / max(len(pairs), 1))
        if "bleu" in self.metric_names:
            import sacrebleu

            values["val/bleu"] = torch.tensor(sacrebleu.corpus_bleu(self.hypotheses, [self.references]).score)
        self.log_dict(values, prog_bar=True)
        self.val_loss.reset()
        self.hypotheses, self.references = [], []

    def configure_optimizers(self) -> dict[str, Any]:
        return _optimizer(self.cfg, self.model, None, self.cfg.trainer.max_steps)


# ---------------------------------------------------------------------------------------------- data


def default_template(arch: str, pair: bool, tokenizer: Tokenizer, roles: dict[str, str]) -> str | None:
    """Encoding of an example for each architecture (None: the datamodule's BERT default ``[CLS] A [SEP] B [SEP]``).

    decoder (GPT-1's task framing): ``<s> A <sep> B <cls>`` -- start, delimiter, extract; the head reads the final
    state. encoder-decoder (T5): ``A </s> B </s>``."""
    from datamodules.special_tokens import special_token_id

    def tok(role: str) -> str:
        return tokenizer.id_to_token(special_token_id(tokenizer, role, roles))

    if arch == "decoder":
        return f"{tok('bos')} $A {tok('sep')} $B {tok('cls')}" if pair else f"{tok('bos')} $A {tok('cls')}"
    if arch == "encoder-decoder":
        return f"$A {tok('eos')} $B {tok('eos')}" if pair else f"$A {tok('eos')}"
    return None


def build_datamodule(cfg: FinetuneConfig, tokenizer: Tokenizer, arch: str, roles: dict[str, str]) -> Any:
    """``FinetuneDataModule`` (heads) or ``Text2TextDataModule`` (text2text) for the configured files."""
    d = cfg.data
    if cfg.head.kind == "text2text":
        from datamodules.special_tokens import special_token_id
        from datamodules.text2text import Text2TextDataModule, glue_pairs, parallel_pairs

        if d.train_target_file:
            if bool(d.val_file) != bool(d.val_target_file):
                raise ValueError(
                    "data.val_file and data.val_target_file go together (line-aligned source/target)"
                )
            train = parallel_pairs(d.train_file, d.train_target_file, d.source_prefix)
            val = parallel_pairs(d.val_file, d.val_target_file, d.source_prefix) if d.val_file else None
        else:
            if d.task is None:
                raise ValueError(
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
        )
    from datamodules.finetune import FinetuneDataModule, task_format

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
    )


# ---------------------------------------------------------------------------------------------- run


def prepare(cfg: FinetuneConfig) -> dict[str, Any]:
    """Backbone, tokenizer, datamodule (read and checked) and LightningModule; every input error surfaces here."""
    backbone, tokenizer, roles = load_backbone(cfg.init)
    roles = roles | dict(cfg.data.special_tokens)
    datamodule = build_datamodule(cfg, tokenizer, backbone.config.arch, roles)
    datamodule.setup("fit")
    freeze(backbone, cfg.freeze.embeddings, cfg.freeze.layers)
    L.seed_everything(cfg.seed, verbose=False)
    if cfg.head.kind == "text2text":
        from datamodules.special_tokens import special_token_id

        eos, pad = (special_token_id(tokenizer, r, roles) for r in ("eos", "pad"))
        module = Text2TextModule(backbone, cfg, tokenizer, eos_id=eos, pad_id=pad)
        labels = None
    else:
        regression = datamodule.format.regression
        labels = datamodule.label_names
        model = TaskModel(
            backbone, cfg.head.kind, datamodule.num_labels, pooling=cfg.head.pooling, dropout=cfg.head.dropout
        )
        module = FinetuneModule(model, cfg, num_labels=datamodule.num_labels, regression=regression)
    return {"module": module, "datamodule": datamodule, "tokenizer": tokenizer, "label_names": labels}


def run(cfg: FinetuneConfig) -> dict[str, Any]:
    """Train, evaluate the whole validation file, write ``results.json`` (and ``finetuned.pt``); return the results."""
    from lightning.pytorch.loggers import CSVLogger

    parts = prepare(cfg)
    module, datamodule = parts["module"], parts["datamodule"]
    t = cfg.trainer
    common = {
        "accelerator": t.accelerator,
        "devices": 1,
        "precision": t.precision,
        "enable_model_summary": False,
    }
    trainer = L.Trainer(
        **common,
        max_steps=t.max_steps,
        max_epochs=-1,
        max_time=timedelta(minutes=t.max_time_minutes) if t.max_time_minutes else None,
        gradient_clip_val=t.gradient_clip_val,
        val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every_n_steps,
        logger=CSVLogger(cfg.run_dir, name="logs"),
        enable_checkpointing=False,
        enable_progress_bar=t.progress_bar,
        default_root_dir=cfg.run_dir,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    train_seconds = time.perf_counter() - start
    results: dict[str, Any] = {
        "name": cfg.name,
        "steps": trainer.global_step,
        "train_seconds": round(train_seconds, 1),
    }
    if datamodule.val_dataloader():
        evaluator = L.Trainer(**common, logger=False, enable_progress_bar=False, enable_checkpointing=False)
        metrics = evaluator.validate(module, datamodule=datamodule, verbose=False)[0]
        results["val"] = {k.removeprefix("val/"): float(v) for k, v in metrics.items()}
    out = Path(cfg.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.save:
        save_finetuned(out / "finetuned.pt", cfg, module, parts["tokenizer"], parts["label_names"])
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def save_finetuned(
    path: Path,
    cfg: FinetuneConfig,
    module: L.LightningModule,
    tokenizer: Tokenizer,
    label_names: list[str] | None,
) -> None:
    """Weights + everything needed to rebuild the model (``load_finetuned``); loadable with weights_only=True."""
    model = module.model
    backbone = model.backbone if isinstance(model, TaskModel) else model
    torch.save(
        {
            "state_dict": model.state_dict(),
            "config": dataclasses.asdict(cfg),
            "model_config": dataclasses.asdict(backbone.config),
            "tokenizer_json": tokenizer.to_str(),
            "label_names": label_names,
            "num_outputs": model.head.out.out_features if isinstance(model, TaskModel) else None,
        },
        path,
    )


def load_finetuned(path: str | Path) -> tuple[nn.Module, dict[str, Any], Tokenizer]:
    """``(model in eval mode, saved payload, tokenizer)`` of a ``finetuned.pt`` (``torch.load(weights_only=True)``)."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    backbone = Transformer(ModelConfig(**payload["model_config"]))
    head = payload["config"]["head"]
    model: nn.Module = backbone
    if head["kind"] != "text2text":
        model = TaskModel(backbone, head["kind"], payload["num_outputs"], pooling=head["pooling"])
    model.load_state_dict(payload["state_dict"])
    return model.eval(), payload, Tokenizer.from_str(payload["tokenizer_json"])


# ---------------------------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("recipe", help="finetuning recipe YAML, e.g. recipes/finetune-sst2-minilm.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=100")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser


def add_finetune_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``finetune`` on an ``add_subparsers()`` object; the handler is ``args.handler`` (``cmd_finetune``)."""
    text = "finetune a pretrained or Hugging Face backbone on a downstream task (heads, T5 text-to-text)"
    parser = add_arguments(subparsers.add_parser("finetune", help=text, description=text))
    parser.set_defaults(handler=cmd_finetune)
    return parser


def cmd_finetune(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides)
    if args.print_config:
        print(OmegaConf.to_yaml(dataclasses.asdict(cfg)), end="")
        return 0
    results = run(cfg)
    print("\n== pretrain finetune: done ==")
    print(f"  steps: {results['steps']} in {results['train_seconds']} s")
    for name, value in sorted(results.get("val", {}).items()):
        print(f"  val/{name}: {value:.4f}")
    print(f"  results: {Path(cfg.run_dir) / 'results.json'}")
    return 0
