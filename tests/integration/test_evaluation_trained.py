"""A tiny GPT trained in the test on a cause -> effect pattern, evaluated zero-/few-shot and by the CLI."""

from __future__ import annotations

import json
import random
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from pretrain.cli import main as cli_main
from pretrain.datamodules.tokenizer import train_bpe
from pretrain.evaluation.models import scorer_from_model
from pretrain.evaluation.prompts import FewShotSampler
from pretrain.evaluation.runner import evaluate, log_to_wandb
from pretrain.evaluation.tasks import TaskConfig, load_examples
from pretrain.models.config import ModelConfig
from pretrain.models.transformer import Transformer

CAUSES = ["rain", "sun", "fire", "ice", "wind", "snow", "storm", "frost", "heat", "fog", "dust", "smoke"]
EFFECTS = [
    "mud",
    "light",
    "ash",
    "slip",
    "noise",
    "cold",
    "flood",
    "frozen",
    "sweat",
    "blind",
    "cough",
    "tears",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(model, tokenizer, COPA-like task file): 60 AdamW steps on "<cause> therefore <effect>." lines."""
    tmp = tmp_path_factory.mktemp("trained")
    rng = random.Random(0)
    lines = [f"{c} therefore {e}." for c, e in zip(CAUSES, EFFECTS, strict=True)]
    corpus = "\n".join(rng.choice(lines) for _ in range(3000))
    (tmp / "corpus.txt").write_text(corpus)
    tokenizer = train_bpe(tmp / "corpus.txt", 300, special_tokens=["<pad>", "<s>", "</s>"])
    stream = torch.tensor(tokenizer.encode(corpus).ids)
    torch.manual_seed(0)
    cfg = ModelConfig(arch="decoder", vocab_size=320, d_model=64, n_layer=2, n_head=4, max_seq_len=64)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        starts = torch.randint(0, len(stream) - 33, (16,))
        batch = torch.stack([stream[s : s + 33] for s in starts.tolist()])
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 1.2  # near the floor: log(12) nats per line for the random cause
    items = []
    for i, (cause, effect) in enumerate(zip(CAUSES, EFFECTS, strict=True)):
        wrong = EFFECTS[(i + 1 + rng.randrange(len(EFFECTS) - 1)) % len(EFFECTS)]
        choices = [f"{effect}.", f"{wrong}."] if i % 2 == 0 else [f"{wrong}.", f"{effect}."]
        items.append({"query": f"{cause} therefore", "choices": choices, "gold": i % 2})
    path = tmp / "copa_like.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return model.eval(), tokenizer, path


def test_zero_shot_accuracy_comes_from_real_loglikelihoods(trained):
    model, tokenizer, path = trained
    scorer = scorer_from_model(model, tokenizer, batch_size=4)
    task = TaskConfig(name="copa_like", type="multiple_choice", path=str(path))
    results = evaluate(scorer, [task], log_samples=True)
    samples = results["samples"]["copa_like"]
    predictions = [max(range(2), key=lambda j, s=s: s["loglikelihoods"][j]) for s in samples]
    assert set(predictions) == {0, 1}  # not a constant guess: gold alternates between the two positions
    acc = results["results"]["copa_like"]["metrics"]["acc"]
    assert (
        acc == sum(p == x["gold"] for p, x in zip(predictions, load_examples(path, "multiple_choice"))) / 12
    )
    assert acc >= 0.9
    first = samples[0]  # the log-likelihood is the model's own sum of log-probabilities of " mud."
    ids = tokenizer.encode("rain therefore mud.").ids
    n_ctx = len(tokenizer.encode("rain therefore").ids)
    with torch.no_grad():
        logprobs = F.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].double(), -1)
    expected = sum(float(logprobs[t - 1, ids[t]]) for t in range(n_ctx, len(ids)))
    # float32 logits of a padded batch of 4 vs one unpadded sequence: matmuls of other shapes round differently
    # (1.6e-6 apart on an AVX2 CPU); a wrong token, position or padding moves the sum by far more
    assert first["loglikelihoods"][0] == pytest.approx(expected, abs=1e-5)

    run = type("Run", (), {"log": lambda self, payload: logged.update(payload)})()
    logged: dict = {}
    log_to_wandb(results, run)
    assert logged["eval/copa_like/acc"] == acc and "eval/copa_like/acc_stderr" in logged


@pytest.mark.parametrize("export", ["ckpt", "hf"])
def test_cli_evaluates_a_checkpoint_with_the_documented_kshot_prompt(trained, tmp_path, export, capsys):
    model, tokenizer, path = trained
    if export == "ckpt":  # the layout `pretrain fit` writes: Lightning state_dict + our payload
        target = tmp_path / "last.ckpt"
        payload = {
            "config": {"model": asdict(model.config), "tokenizer": {"special_tokens": {}}},
            "tokenizer_json": tokenizer.to_str(),
        }
        state = {f"model.{k}": v for k, v in model.state_dict().items()}
        torch.save({"state_dict": state, "pretrain": payload}, target)
    else:
        from pretrain.models.hf import save_hf

        tokenizer.save(str(tmp_path / "tokenizer.json"))
        target = save_hf(model, tmp_path / "hf", tmp_path / "tokenizer.json")
    task_file = tmp_path / "copa_like.yaml"
    task_file.write_text(f"name: copa_like\ntype: multiple_choice\npath: {path}\nnum_fewshot: 0\n")
    out = tmp_path / "results.json"
    status = cli_main(
        [
            "evaluate",
            str(target),
            "--tasks",
            str(task_file),
            "--num-fewshot",
            "2",
            "--seed",
            "7",
            "--output",
            str(out),
            "--log-samples",
            "--device",
            "cpu",
        ]
    )
    assert status == 0
    results = json.loads(out.read_text())
    res = results["results"]["copa_like"]
    assert (res["num_fewshot"], res["num_examples"], res["seed"]) == (2, 12, 7)
    assert res["metrics"]["acc"] >= 0.9 and res["stderr"]["acc"] is not None
    table = capsys.readouterr().out
    assert "| copa_like | multiple_choice | 2     | 12 | 7    | acc " in table

    items = load_examples(path, "multiple_choice")
    sampler = FewShotSampler(items, 7)
    for item, sample in zip(items, results["samples"]["copa_like"], strict=True):
        (q1, a1), (q2, a2) = [(s["query"], s["choices"][s["gold"]]) for s in sampler.sample(2, exclude=item)]
        assert sample["context"] == f"{q1} {a1}\n\n{q2} {a2}\n\n{item['query']}"
        assert q1 != item["query"] != q2
