"""LoRA through peft on our backbone: it learns a task a frozen backbone's head cannot (XOR of two words'
presence), prints and records its trainable-parameter count, and its merged weights export to transformers with
the logits of the unmerged model (T5 text-to-text)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from training_utils import TINY_MODEL

from pretrain.finetuning.config import validate
from pretrain.finetuning.run import run

FILLER = ["the", "film", "movie", "plot", "was", "is", "a", "really", "quite", "so"]
TINY = {"vocab_size": 448, "d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 64, "max_seq_len": 32}
NO_DROPOUT = {"dropout": 0.0, "attn_dropout": 0.0}
BERT = TINY | TINY_MODEL["bert"] | NO_DROPOUT | {"type_vocab_size": 2}
T5 = TINY | TINY_MODEL["t5"] | NO_DROPOUT


@pytest.fixture(scope="module")
def xor_files(tmp_path_factory) -> Path:
    """Label = "apple" xor "river" in the sentence: not linear in the words present."""
    from pretrain.datamodules.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("lora")
    rng = random.Random(0)
    for split, n in (("train", 512), ("dev", 128)):
        rows = []
        for _ in range(n):
            a, b = rng.random() < 0.5, rng.random() < 0.5
            words = rng.sample(FILLER, 4) + ["apple"] * a + ["river"] * b
            rng.shuffle(words)
            rows.append(f"{' '.join(words)}\t{int(a != b)}\n")
        (root / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(rows))
    (root / "corpus.txt").write_text(" ".join(FILLER + ["apple", "river"]) * 30)
    train_bpe(root / "corpus.txt", 400, root / "tokenizer.json", show_progress=False)
    return root


def _raw(files: Path, run_dir: Path, model: dict, steps: int, **sections) -> dict:
    cfg = {
        "name": run_dir.name,
        "run_dir": str(run_dir),
        "seed": 0,
        "init": {"model": model, "tokenizer": str(files / "tokenizer.json")},
        "head": {"dropout": 0.0},
        "data": {
            "task": "sst2",
            "train_file": str(files / "train.tsv"),
            "val_file": str(files / "dev.tsv"),
            "micro_batch_size": 32,
            "max_length": 16,
        },
        "optim": {"lr": 1e-2, "warmup_steps": 10, "weight_decay": 0.0},
        "trainer": {
            "max_steps": steps,
            "accelerator": "cpu",
            "val_check_interval": 1000,
            "progress_bar": False,
        },
        "checkpoint": {"every_n_steps": 1000},
        "guards": {"hang": {"enabled": False}},
    }
    return cfg | sections


def test_lora_learns_what_a_frozen_backbone_head_cannot(xor_files, tmp_path, capsys):
    """Same random backbone, same steps: the head on the frozen backbone stays near chance on XOR; with LoRA
    adapters (a few % of the parameters trainable) the model learns it."""
    frozen = run(
        validate(_raw(xor_files, tmp_path / "frozen", BERT, 200, freeze={"embeddings": True, "layers": 2}))
    )
    # r = 4 of d = 32 on every block linear (q, k, v, out, fc, proj: separate projections since tensor parallelism)
    lora = run(validate(_raw(xor_files, tmp_path / "lora", BERT, 200, lora={"r": 4, "alpha": 8})))
    printed = capsys.readouterr().out
    assert "trainable parameters:" in printed
    assert lora["trainable_parameters"] < 0.2 * sum(
        p.numel()
        for p in torch.load(tmp_path / "lora" / "finetuned.pt", weights_only=True)["state_dict"].values()
    )
    assert frozen["val"]["accuracy"] < 0.6 and lora["val"]["accuracy"] > 0.75


def test_lora_merged_export_gives_the_unmerged_logits(xor_files, tmp_path):
    """A T5 text-to-text LoRA run: ``finetuned.pt`` holds merged weights; exported to transformers, they give
    the logits of the unmerged adapters in the run's checkpoint."""
    import transformers

    from pretrain.checkpoint import PAYLOAD, read
    from pretrain.checkpoint.convert import model_state
    from pretrain.finetuning.checkpoint import _build, load_finetuned
    from pretrain.models.hf import save_hf

    raw = _raw(
        xor_files,
        tmp_path / "t5",
        T5,
        8,
        head={"kind": "text2text"},
        lora={"r": 4, "alpha": 8, "target_modules": ["q", "k", "v", "out", "gate", "fc", "proj"]},
        decoding={"max_new_tokens": 2},
    )
    raw["data"] |= {"max_target_length": 4}
    run(validate(raw))
    saved = read(tmp_path / "t5" / "checkpoints" / "last.ckpt")
    info = saved[PAYLOAD]
    unmerged, _ = _build(info["config"]["model"], info["finetune"]["head"], None, info["finetune"]["lora"])
    unmerged.load_state_dict(model_state(saved))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in unmerged.state_dict().items())  # it trained

    merged, _, tokenizer = load_finetuned(tmp_path / "t5" / "finetuned.pt")
    assert not any("lora" in k for k in merged.state_dict())
    save_hf(merged, tmp_path / "hf", tokenizer)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([tokenizer.encode("the apple was so river").ids])
    start = torch.tensor([[0, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(
            hf(input_ids=ids, decoder_input_ids=start).logits,
            unmerged.eval()(input_ids=ids, decoder_input_ids=start).logits,
            rtol=1e-4,
            atol=1e-5,
        )
    assert json.loads((tmp_path / "t5" / "results.json").read_text())["trainable_parameters"] > 0
