"""Baseline runs end to end on small data (recipes with overrides), their data pipelines, and bad input."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain import objectives
from pretrain.baselines.config import load_config
from pretrain.baselines.heatmaps import save_alignment
from pretrain.baselines.lstm_lm import StreamBatches, stream_perplexity
from pretrain.baselines.run import run_recipe
from pretrain.baselines.seq2seq import pad_pairs
from pretrain.cli import main as cli_main
from pretrain.errors import InputError
from pretrain.models.rnn import RNNConfig, RNNLanguageModel
from pretrain.models.word_vectors import WordVectors, word_tokenizer

QUIET = [
    "logger.wandb.enabled=false",
    "logger.csv=false",
    "trainer.progress_bar=false",
    "checkpoint.save_top_k=0",
]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shipped_corpus):
    """A 120 kB slice of the shipped corpus and overrides pointing a recipe's tokenizer and data at it."""
    d = tmp_path_factory.mktemp("baselines")
    (d / "corpus.txt").write_text(shipped_corpus.read_text()[:120_000])
    return d


def small(d, name: str, *extra: str) -> list[str]:
    return [
        *QUIET,
        f"run_dir={d / name}",
        f"tokenizer.path={d / 'tokenizer.json'}",
        f"tokenizer.train_files=[{d / 'corpus.txt'}]",
        "tokenizer.vocab_size=400",
        f"data.sources.0.text=[{d / 'corpus.txt'}]",
        f"data.sources.0.prepared={d / 'prepared'}",
        "data.val_fraction=0.1",
        f"checkpoint.every_n_steps={10**6}",
        *extra,
    ]


@pytest.mark.parametrize("variant", ["baselines.cbow=false", "baselines.cbow=true"])
def test_sgns_recipe_trains_evaluates_and_exports(corpus, variant):
    extra = [
        "trainer.max_steps=12",
        "trainer.val_check_interval=6",
        "trainer.limit_val_batches=2",
        "data.micro_batch_size=4",
        "data.seq_len=64",
        "baselines.dim=16",
        "baselines.eval.queries=[the,zzqx]",
    ]
    name = f"sgns-cbow-{variant.endswith('true')}"  # a run directory each: a second run there would resume
    results = run_recipe("recipes/sgns-tiny.yaml", small(corpus, name, variant, *extra))
    assert math.isfinite(results["val/loss"]) and 0 <= results["val/accuracy"] <= 1
    assert results["unknown_queries"] == ["zzqx"] and len(results["neighbours"]["the"]) == 8
    vectors = WordVectors.load_word2vec(results["vectors"])
    assert len(vectors) == results["vocabulary"] > 50 and vectors.raw.shape[1] == 16
    saved = json.loads((corpus / name / "results.json").read_text())
    assert saved["kind"] == "sgns" and saved["vocabulary"] == results["vocabulary"]


def test_glove_recipe_fits_the_cooccurrence_matrix(corpus):
    extra = [
        "trainer.max_steps=30",
        "trainer.val_check_interval=30",
        "trainer.limit_val_batches=2",
        "baselines.dim=16",
        "baselines.batch_size=2048",
        "baselines.window=4",
    ]
    results = run_recipe("recipes/glove-tiny.yaml", small(corpus, "glove", *extra))
    assert results["cooccurrence_entries"] > 1000 and math.isfinite(results["val/loss"])
    assert "val/accuracy" not in results
    assert len(WordVectors.load_word2vec(results["vectors"])) == results["vocabulary"]


def unigram_perplexity(prepared: Path, vocab_size: int) -> float:
    """Perplexity of the val split under the train split's token frequencies (add-one): what a model that
    learned nothing but frequencies scores."""
    from pretrain.datamodules.indexed import IndexedDataset

    train, val = (np.asarray(IndexedDataset(prepared / s).tokens, dtype=np.int64) for s in ("train", "val"))
    p = (np.bincount(train, minlength=vocab_size) + 1) / (len(train) + vocab_size)
    return float(np.exp(-np.log(p[val]).mean()))


def test_lstm_recipe_trains_with_truncated_bptt(corpus):
    extra = [
        "trainer.max_steps=60",
        "trainer.val_check_interval=60",
        "trainer.limit_val_batches=4",
        "data.micro_batch_size=4",
        "data.seq_len=32",
        "optim.lr=0.01",
        "optim.warmup_steps=5",
        "baselines.model.vocab_size=400",
        "baselines.model.d_embed=32",
        "baselines.model.d_hidden=32",
    ]
    results = run_recipe("recipes/lstm-lm-tiny.yaml", small(corpus, "lstm", *extra))
    assert results["train_tokens"] == 60 * 4 * 32
    # it learned the token frequencies at least: near the unigram model's perplexity (about 64 here), far below
    # uniform guessing (400); beating the unigram model takes more steps than CI affords
    assert 1 < results["val/perplexity"] < 1.2 * unigram_perplexity(corpus / "prepared", 400)
    assert results["val/perplexity"] == pytest.approx(math.exp(results["val/loss"]), rel=1e-5)


def test_seq2seq_attention_reverses_strings_and_saves_alignment_heatmaps(tmp_path):
    extra = [
        f"run_dir={tmp_path}",
        "trainer.max_steps=150",
        "trainer.val_check_interval=150",
        "trainer.limit_val_batches=2",
        "data.micro_batch_size=32",
        "baselines.model.d_embed=32",
        "baselines.model.d_hidden=32",
        "baselines.toy_max_length=6",
        "baselines.toy_val=200",
        "optim.lr=1.0e-2",
        "baselines.heatmaps=2",
    ]
    results = run_recipe("recipes/seq2seq-attn-reverse.yaml", [*QUIET, *extra])
    assert results["val/exact_match"] >= 0.95 and results["val/bleu"] > 90
    assert len(results["heatmaps"]) == 2
    for path in results["heatmaps"]:
        assert Path(path).read_bytes()[:8] == PNG


def test_stream_batches_continue_every_row():
    tokens = np.arange(1000) % 97
    objective = objectives.build("clm", word_tokenizer([str(i) for i in range(97)]))
    batches = StreamBatches(tokens, objective, seq_len=10, batch_size=4)
    assert len(batches) == (250 - 1) // 10
    first, second = batches[0], batches[1]
    assert torch.equal(
        first["labels"][:, -1], second["input_ids"][:, 0]
    )  # row b of batch i+1 continues row b
    assert torch.equal(first["input_ids"][:, 0], torch.from_numpy(tokens[::250][:4]))
    with pytest.raises(IndexError):
        batches[len(batches)]
    with pytest.raises(ValueError, match="lower data.micro_batch_size or data.seq_len"):
        StreamBatches(tokens[:40], objective, seq_len=10, batch_size=4)


def test_carried_state_perplexity_equals_reading_each_stream_at_once():
    torch.manual_seed(0)
    tokenizer = word_tokenizer([str(i) for i in range(40)])
    objective = objectives.build("clm", tokenizer)
    model = RNNLanguageModel(RNNConfig(vocab_size=tokenizer.get_vocab_size(), d_embed=8, d_hidden=8))
    tokens = np.random.default_rng(0).integers(0, 40, size=403) + 110
    carried = stream_perplexity(model, objective, tokens, seq_len=20, batch_size=4)
    streams = torch.from_numpy(tokens[:400].reshape(4, 100))[:, :81]  # the 4 windows of 20 tokens per stream
    with torch.no_grad():
        logits = model.eval()(streams[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), streams[:, 1:].reshape(-1))
    assert carried["tokens"] == 320 and carried["loss"] == pytest.approx(float(loss), rel=1e-5)
    reset = stream_perplexity(model, objective, tokens, seq_len=20, batch_size=4, carry=False)
    assert reset["loss"] != pytest.approx(carried["loss"], rel=1e-6)


def test_pad_pairs_shifts_targets_behind_bos():
    batch = pad_pairs([([5, 6, 7], [8]), ([9], [10, 11])], pad=0, bos=1, eos=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["decoder_input_ids"].tolist() == [[1, 8, 0], [1, 10, 11]]
    assert batch["labels"].tolist() == [[8, 2, -100], [10, 11, 2]]
    assert batch["decoder_attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]


def test_alignment_heatmap_shape_is_checked(tmp_path):
    path = save_alignment(torch.eye(3), ["a", "b", "c"], ["x", "y", "z"], tmp_path / "a.png")
    assert path.read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="do not match"):
        save_alignment(torch.eye(3), ["a", "b"], ["x", "y", "z"], tmp_path / "b.png")


def test_bad_recipes_fail_before_training(corpus, capsys):
    with pytest.raises(ValueError, match="needs a section `baselines` with kind in"):
        load_config("recipes/gpt-tiny.yaml")
    with pytest.raises(ValueError, match=r"window \(context words on each side\) must be an integer >= 1"):
        load_config("recipes/sgns-tiny.yaml", ["baselines.window=0"])
    with pytest.raises(ValueError, match=r"negatives \(k noise words per example\) must be an integer >= 1"):
        load_config("recipes/sgns-tiny.yaml", ["baselines.negatives=0"])
    with pytest.raises(ValueError, match="unknown config key 'windw'.*did you mean window"):
        load_config("recipes/glove-tiny.yaml", ["baselines.windw=3"])
    with pytest.raises(ValueError, match=r"toy_max_length \(3\) must be >= toy_min_length \(5\)"):
        load_config(
            "recipes/seq2seq-attn-reverse.yaml", ["baselines.toy_min_length=5", "baselines.toy_max_length=3"]
        )
    with pytest.raises(ValueError, match=r"task=parallel needs train=\[source file, target file\]"):
        load_config("recipes/seq2seq-attn-reverse.yaml", ["baselines.task=parallel"])
    with pytest.raises(ValueError, match="one device"):
        load_config("recipes/lstm-lm-tiny.yaml", ["trainer.devices=2"])
    # a section the kind never reads is refused, not silently ignored (nor blamed on a 'clm' objective)
    with pytest.raises(
        ValueError, match=r"^objective: a sgns baseline has no such section .*baselines\.window"
    ):
        load_config("recipes/sgns-tiny.yaml", ["objective.options.window=abc"])
    with pytest.raises(ValueError, match=r"^model: a glove baseline has no such section"):
        load_config("recipes/glove-tiny.yaml", ["model.n_layer=3"])
    with pytest.raises(ValueError, match="strategy.name=deepspeed: baselines train on one device"):
        load_config("recipes/lstm-lm-tiny.yaml", ["strategy.name=deepspeed"])
    with pytest.raises(ValueError, match="vocabulary is empty after min-count filtering"):
        run_recipe("recipes/glove-tiny.yaml", small(corpus, "glove-empty", "baselines.min_count=1000000"))
    with pytest.raises(ValueError, match="train with objective clm"):
        run_recipe(
            "recipes/lstm-lm-tiny.yaml", small(corpus, "lstm-mlm", "objective.name=mlm", "~objective.options")
        )
    assert cli_main(["baseline", "recipes/sgns-tiny.yaml", "baselines.window=0"]) == 2
    assert "must be an integer >= 1" in capsys.readouterr().err
    assert cli_main(["baseline", "recipes/sgns-tiny.yaml", "--print-config"]) == 0
    assert "kind: sgns" in capsys.readouterr().out


def test_compare_lstm_transformer_quick(corpus):
    """The CI version of benchmarks/compare_lstm_transformer.py: same batches, same size, both learn."""
    spec = importlib.util.spec_from_file_location("compare", "benchmarks/compare_lstm_transformer.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    results = compare.compare(
        corpus / "corpus.txt",
        None,
        corpus / "compare",
        vocab=400,
        d_model=32,
        layers=2,
        seq_len=32,
        batch=4,
        steps=60,
        lr=1e-2,
    )
    t, r = results["transformer"], results["lstm"]
    assert abs(r["params"] - t["params"]) / t["params"] < 0.02
    assert t["train_tokens"] == r["train_tokens"] == 60 * 4 * 32 and t["val_tokens"] == r["val_tokens"]
    unigram = unigram_perplexity(corpus / "compare" / "data", 400)  # frequencies only; uniform would be 400
    for ppl in (t["val_ppl"], r["val_ppl"], r["val_ppl_reset"]):
        assert 1 < ppl < 1.3 * unigram, (ppl, unigram)
    assert "ratio lstm / transformer" in compare.report(results)


def test_a_baseline_recipe_is_reproducible_from_its_seed(corpus):
    extra = [
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "data.micro_batch_size=2",
        "data.seq_len=16",
        "baselines.model.vocab_size=400",
        "baselines.model.d_embed=16",
        "baselines.model.d_hidden=16",
    ]
    first, second = (
        run_recipe("recipes/lstm-lm-tiny.yaml", small(corpus, f"seeded{i}", *extra)) for i in (0, 1)
    )
    assert first["val/loss"] == second["val/loss"]  # the model's initialisation comes from the seed too


def test_a_baseline_resumed_under_other_settings_is_refused(corpus):
    """`pretrain baseline sgns-tiny name=bl4 trainer.max_steps=8 optim.lr=0.5 baselines.window=2` on a run of
    4 steps resumed it without a word: the window changed under the trained vectors and the optimizer state kept
    the old learning rate (0.01 for the 0.5 asked). A resume now compares the recipe's settings with the
    checkpoint's, as pretrain fit does (how the run executes and records may change). Found by the #32 sweep."""
    extra = ["trainer.val_check_interval=2", "trainer.limit_val_batches=1", "data.micro_batch_size=4"]
    extra += ["data.seq_len=32", "baselines.dim=8"]
    run_recipe("recipes/sgns-tiny.yaml", small(corpus, "resumed", "trainer.max_steps=2", *extra))
    more = small(corpus, "resumed", "trainer.max_steps=3", "optim.decay_steps=2", *extra)
    with pytest.raises(
        InputError, match=r"baselines.window: checkpoint \d+ vs config 2; optim.lr: checkpoint"
    ):
        run_recipe("recipes/sgns-tiny.yaml", [*more, "baselines.window=2", "optim.lr=0.5"])
    with pytest.raises(
        InputError, match="optim.decay_steps: checkpoint 2 vs config 4"
    ):  # the schedule's length
        run_recipe("recipes/sgns-tiny.yaml", small(corpus, "resumed", "trainer.max_steps=4", *extra))
    results = run_recipe("recipes/sgns-tiny.yaml", [*more, "trainer.progress_bar=true", "data.num_workers=1"])
    assert (
        results["kind"] == "sgns"
        and torch.load(corpus / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
        == 3
    )


def test_a_toy_task_with_a_tokenizer_lacking_its_symbols_is_refused_in_one_line():
    """toy_examples put the tokenizer's None (no such token) into the examples, failing later inside the model."""
    from tokenizers import Tokenizer, models

    from pretrain.baselines.seq2seq import toy_examples
    from pretrain.errors import InputError

    tokenizer = Tokenizer(models.WordLevel({"0": 0, "1": 1, "[UNK]": 2}, unk_token=None))
    assert toy_examples("reverse", 3, tokenizer, 2, (2, 4), seed=0)[0].source  # symbols "0", "1": known
    with pytest.raises(
        InputError, match=r"^the tokenizer has no token '2': give the toy task's own tokenizer$"
    ):
        toy_examples("reverse", 20, tokenizer, 3, (2, 4), seed=0)
