"""`pretrain finetune` under FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 equals DDP on 2 gloo ranks (training losses,
validation metrics and finetuned weights within 1e-5 relative) for a classification head (full finetuning) and
for T5 text-to-text (LoRA adapters, merged into ``finetuned.pt``; greedy and beam decoding, whose sharded ranks
step together); FSDP and ZeRO-3 runs stopped and resumed from their sharded checkpoints equal the uninterrupted
ones; ``finetuned.pt`` is consolidated from sharded checkpoints; the finetuned classifier and text-to-text model
export to transformers like a pretrained one.

All runs share one launch of 2 ranks (``finetune_worker.py``). The validation file splits into unequal shards, so
one rank's is padded: sharded strategies need the same forward passes on every rank.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from training_utils import REPO_ROOT, TINY_MODEL, launch_metrics, metric_by_step, read_metrics, run_ranks

WORDS = {1: ["good", "great", "fine", "lovely"], 0: ["bad", "awful", "poor", "dull"]}
FILLER = ["the", "film", "movie", "plot", "was", "is", "a", "really"]
TINY = {"vocab_size": 448, "d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "max_seq_len": 48}
NO_DROPOUT = {"dropout": 0.0, "attn_dropout": 0.0}
BERT = TINY | TINY_MODEL["bert"] | NO_DROPOUT | {"type_vocab_size": 2, "pooler": True}  # BERT's pooler head
T5 = TINY | TINY_MODEL["t5"] | NO_DROPOUT
STEPS = 6
LORA = {"r": 4, "alpha": 8, "target_modules": ["q", "k", "v", "out", "gate", "fc", "proj"]}
STRATEGIES = {
    "ddp": {"name": "ddp", "ddp": {"process_group_backend": "gloo"}},
    "fsdp": {"name": "fsdp"},
    "zero2": {"name": "deepspeed", "deepspeed": {"stage": 2}},
    # every parameter partitioned: DeepSpeed keeps tensors under 1e5 elements (all of a tiny model) whole
    "zero3": {"name": "deepspeed", "deepspeed": {"stage": 3, "param_persistence_threshold": 0}},
}
BEAM = {"strategy": "beam", "num_beams": 3, "max_new_tokens": 8, "early_stopping": True}


def _files(root: Path) -> Path:
    """Synthetic sentiment TSVs and a byte-level BPE trained on them. 65 dev examples on 2 ranks of micro-batch 8:
    33 + 32, so without padding rank 0 would run a 5th forward pass that rank 1 never joins (a hang when
    sharded); padded, rank 1's 5th batch is one padding example."""
    from pretrain.datamodules.tokenizer import train_bpe

    rng = random.Random(0)
    for split, n in (("train", 256), ("dev", 65)):
        rows = []
        for _ in range(n):
            label = rng.randint(0, 1)
            words = rng.sample(FILLER, 4) + [rng.choice(WORDS[label])]
            rng.shuffle(words)
            rows.append(f"{' '.join(words)}\t{label}\n")
        (root / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(rows))
    (root / "corpus.txt").write_text(" ".join(WORDS[0] + WORDS[1] + FILLER) * 20)
    train_bpe(root / "corpus.txt", 400, root / "tokenizer.json", show_progress=False)
    return root


def _eos_prone_t5(files: Path) -> Path:
    """A random transformers T5 on the tokenizer's vocabulary whose LM head often prefers EOS (its row leans
    along the mean row): beam searches (early_stopping=True) stop after 2-8 steps depending on the sources, so
    the two ranks' searches finish apart and only ``all_finished`` keeps their forwards paired."""
    from model_zoo import random_hf_t5
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(files / "tokenizer.json"))
    eos, pad = tokenizer.token_to_id("</s>"), tokenizer.token_to_id("<pad>")
    model = random_hf_t5(TINY["vocab_size"], eos, pad, d_kv=16, d_ff=64, num_heads=2, dropout_rate=0.0)
    with torch.no_grad():
        head = model.lm_head.weight
        head[eos] = 4.0 * head[eos + 100]
        head[eos] += 2.0 * head.mean(0) / head.mean(0).norm() * head.norm(dim=1).mean()  # along the mean row
    model.save_pretrained(files / "t5-eos-prone", safe_serialization=True)
    return files / "t5-eos-prone"


def _config(files: Path, run_dir: Path, model: dict | None, strategy: str, **sections) -> dict:
    cfg = {
        "name": run_dir.name,
        "run_dir": str(run_dir),
        "init": {"model": model, "tokenizer": str(files / "tokenizer.json")},
        "head": {"dropout": 0.0},
        "data": {
            "task": "sst2",
            "train_file": str(files / "train.tsv"),
            "val_file": str(files / "dev.tsv"),
            "micro_batch_size": 8,
            "max_length": 24,
            "max_target_length": 4,
        },
        "optim": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": STEPS},
        "trainer": {
            "max_steps": STEPS,
            "accelerator": "cpu",
            "devices": 2,
            "val_check_interval": 100,
            "log_every_n_steps": 1,
            "progress_bar": False,
        },
        "strategy": STRATEGIES[strategy],
        "guards": {"hang": {"enabled": False}},
        "decoding": {"strategy": "greedy", "max_new_tokens": 4},
    }
    for key, value in sections.items():
        cfg[key] = cfg.get(key, {}) | value
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this module in one 2-rank launch: ``{name: run_dir}``."""
    root = tmp_path_factory.mktemp("finetune-strategies")
    files = _files(root)
    configs = []
    t2t = {"head": {"kind": "text2text", "dropout": 0.0}, "lora": LORA}  # text-to-text with LoRA adapters
    beam = t2t | {
        # the x3-scaled T5's decoder self-attention softmax is saturated: adapters on q and k would get
        # rounding-level gradients, which AdamW turns into lr-sized updates of either sign (4e-5 apart at step 1)
        "lora": LORA | {"target_modules": ["v", "out", "gate", "fc", "proj"]},
        "decoding": BEAM,
        "trainer": {"max_steps": 2},
        "init": {"checkpoint": str(_eos_prone_t5(files))},
    }
    for kind, model, sections, strategies in (
        ("seq", BERT, {}, ("ddp", "fsdp", "zero2", "zero3")),
        ("t2t", T5, t2t, ("ddp", "fsdp", "zero2")),
        ("t2tbeam", None, beam, ("ddp", "fsdp", "zero3")),
    ):
        for strategy in strategies:
            configs.append(_config(files, root / f"{kind}-{strategy}", model, strategy, **sections))
    # stopped after 3 steps, then resumed (resume=auto) from the sharded checkpoint to STEPS
    for strategy in ("fsdp", "zero3"):
        for steps in (3, STEPS):
            run_dir = root / f"seq-{strategy}-resumed"
            configs.append(_config(files, run_dir, BERT, strategy, trainer={"max_steps": steps}))
    (root / "configs.json").write_text(json.dumps(configs))
    run_ranks(REPO_ROOT / "tests" / "finetune_worker.py", str(root / "configs.json"), log_dir=root)
    return {Path(c["run_dir"]).name: Path(c["run_dir"]) for c in configs}


def _losses(run_dir: Path) -> dict[int, float]:
    return metric_by_step(read_metrics(run_dir), "train/loss")


def _results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


@pytest.mark.parametrize(
    ("kind", "strategy"),
    [
        ("seq", "fsdp"),
        ("seq", "zero2"),
        ("seq", "zero3"),
        ("t2t", "fsdp"),
        ("t2t", "zero2"),
        ("t2tbeam", "fsdp"),
        ("t2tbeam", "zero3"),
    ],
    ids=lambda x: x,
)
def test_sharded_finetuning_equals_ddp(runs, kind, strategy):
    ddp, sharded = runs[f"{kind}-ddp"], runs[f"{kind}-{strategy}"]
    assert len(_losses(ddp)) == (2 if kind == "t2tbeam" else STEPS)
    assert _losses(sharded) == pytest.approx(_losses(ddp), rel=1e-5)
    assert _results(sharded)["trainable_parameters"] == _results(ddp)["trainable_parameters"]
    val = _results(ddp)["val"]
    assert set(val) >= {"loss", "accuracy"}
    assert _results(sharded)["val"] == pytest.approx(val, rel=1e-5)
    from pretrain.finetuning.checkpoint import load_finetuned

    (reference, _, _), (model, _, _) = (load_finetuned(d / "finetuned.pt") for d in (ddp, sharded))
    ours = model.state_dict()
    # atol 1e-5: the key bias gets a zero gradient up to rounding (softmax ignores it), which AdamW turns into
    # updates of ~lr * rounding-sign; everything else agrees to ~1e-7. t2tbeam: AdamW's g / sqrt(v) on the saturated
    # T5's near-zero adapter gradients amplifies ZeRO-3's reduction order to 1.3e-5 (attn.out, weights ~1.8: measured)
    atol = 5e-5 if kind == "t2tbeam" else 1e-5
    for name, weight in reference.state_dict().items():
        torch.testing.assert_close(ours[name], weight, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sharded_finetuning_resumes_exactly(runs, strategy):
    """3 steps, stop, resume from the sharded ``last.ckpt`` under the same strategy: the losses of steps 4-6
    and the final metrics are those of the uninterrupted run (the example order continues where it stopped)."""
    resumed, whole = runs[f"seq-{strategy}-resumed"], runs[f"seq-{strategy}"]
    assert (resumed / "checkpoints" / "last.ckpt").is_dir()  # a sharded checkpoint directory
    launches = [metric_by_step(rows, "train/loss") for rows in launch_metrics(resumed)]
    assert sorted(launches[0]) == [1, 2, 3] and sorted(launches[1]) == [4, 5, 6]
    assert launches[0] | launches[1] == pytest.approx(_losses(whole), rel=1e-5)
    assert _results(resumed)["val"] == pytest.approx(_results(whole)["val"], rel=1e-5)


def test_text_to_text_finetuned_model_exports_like_a_pretrained_one(runs, tmp_path):
    """`pretrain export` of the FSDP LoRA run's ``finetuned.pt`` (consolidated from sharded checkpoints, adapters
    merged): transformers' T5 gives the finetuned model's logits."""
    import transformers

    from pretrain.cli import main
    from pretrain.finetuning.checkpoint import load_finetuned

    run_dir = runs["t2t-fsdp"]
    assert (run_dir / "checkpoints" / "last.ckpt").is_dir()
    assert main(["export", str(run_dir / "finetuned.pt"), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    model, _, tokenizer = load_finetuned(run_dir / "finetuned.pt")
    ids = torch.tensor([tokenizer.encode("the film was good").ids])
    start = torch.tensor([[0, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(
            hf(input_ids=ids, decoder_input_ids=start).logits,
            model(input_ids=ids, decoder_input_ids=start).logits,
            rtol=1e-4,
            atol=1e-5,
        )


def test_finetuned_classifier_exports_to_transformers(runs, tmp_path):
    """`pretrain export` of the ZeRO-3 run's sharded ``last.ckpt``: transformers' BertForSequenceClassification
    (with the run's labels) gives the logits of its ``finetuned.pt`` on a padded batch."""
    import transformers

    from pretrain.cli import main
    from pretrain.finetuning.checkpoint import load_finetuned

    run_dir = runs["seq-zero3"]
    assert main(["export", str(run_dir / "checkpoints" / "last.ckpt"), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "BertForSequenceClassification"
    assert list(hf.config.id2label.values()) == ["0", "1"]
    model, _, _ = load_finetuned(run_dir / "finetuned.pt")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    batch = tokenizer(["the film was good", "a really awful plot"], padding=True, return_tensors="pt")
    assert batch["attention_mask"].min() == 0  # padded
    first, *_, last = tokenizer.convert_ids_to_tokens(tokenizer("the film was good")["input_ids"])
    assert (first, last) == ("<cls>", "<sep>")  # the run's template: encoded as in training
    with torch.no_grad():
        ours = model(batch["input_ids"], batch["attention_mask"])
        torch.testing.assert_close(hf(**batch).logits, ours, rtol=1e-5, atol=1e-5)
    (label,) = transformers.pipeline("text-classification", model=str(tmp_path / "hf"))("a lovely film")
    assert label["label"] in ("0", "1")  # the README's command works on the export
