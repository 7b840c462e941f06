"""PretrainDataModule: coverage across ranks, seeding, blending, exact resume (by hand and via Lightning)."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from shards import write_shard

from pretrain.datamodules.pretrain import PretrainDataModule

SEQ_LEN = 7  # samples hold SEQ_LEN + 1 raw tokens with the causal objective below
VAL_BASE = 50_000  # validation token ids start here; training ids stay below


class NoisyCausal:
    """A causal-LM objective that also draws random numbers, so per-sample seeding is observable."""

    def raw_length(self, input_length: int) -> int:
        return input_length + 1

    def __call__(self, tokens: torch.Tensor, generators: list[torch.Generator]) -> dict[str, torch.Tensor]:
        labels = tokens[:, 1:].clone()
        noise = torch.stack([torch.rand(labels.shape[1], generator=g) for g in generators])
        labels[noise < 0.3] = -100
        return {"input_ids": tokens[:, :-1], "labels": labels}


def make_prepared(root: Path, n_train_tokens: int, first_id: int = 0, n_val_tokens: int = 200) -> Path:
    """A prepared dir with train tokens first_id, first_id+1, ... (a sample's first token names it)."""
    root.mkdir(parents=True)
    train = np.arange(first_id, first_id + n_train_tokens)
    write_shard(root / "train", np.array_split(train, 7), np.int32)  # several documents
    write_shard(root / "val", [np.arange(VAL_BASE, VAL_BASE + n_val_tokens)], np.int32)
    return root


@pytest.fixture
def prepared(tmp_path) -> Path:
    return make_prepared(tmp_path / "corpus", 96 * (SEQ_LEN + 1) + 5)  # 96 samples and a 5-token tail


def datamodule(dirs, **kwargs) -> PretrainDataModule:
    kwargs = {"seq_len": SEQ_LEN, "micro_batch_size": 4, **kwargs}
    dm = PretrainDataModule(dirs, NoisyCausal(), **kwargs)
    dm.setup("fit")
    return dm


def sample_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    """Which packed sample each row is (tokens are 0, 1, 2, ... so first token // raw length)."""
    return (batch["input_ids"][:, 0] // (SEQ_LEN + 1)).tolist()


def read(dm: PretrainDataModule, num_batches: int) -> list[dict[str, torch.Tensor]]:
    """The next ``num_batches`` training batches, across epochs, as a training loop consumes them."""
    out: list[dict[str, torch.Tensor]] = []
    loader = dm.train_dataloader()
    while len(out) < num_batches:
        for batch in itertools.islice(loader, num_batches - len(out)):
            out.append(batch)
            dm.advance()
    return out


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_epoch_covers_train_split_once_across_ranks_and_never_validation(prepared, world):
    per_rank = []
    for rank in range(world):
        dm = datamodule(prepared, rank=rank, world_size=world)
        batches = read(dm, dm.batches_per_epoch)
        assert dm.state_dict()["epoch"] == 1 and dm.state_dict()["consumed_samples"] == 0
        assert all(int(b["input_ids"].max()) < VAL_BASE for b in batches)
        per_rank.append([i for b in batches for i in sample_ids(b)])
    assert len({len(ids) for ids in per_rank}) == 1  # same number of batches on every rank
    flat = [i for ids in per_rank for i in ids]
    global_batch = 4 * world
    assert len(flat) == len(set(flat)) == (96 // global_batch) * global_batch  # 96 = 4*24: all samples
    assert set(flat) == set(range(96))


def test_sample_tokens_are_the_packed_stream(prepared):
    batch = read(datamodule(prepared), 1)[0]
    for row, sample in zip(batch["input_ids"], sample_ids(batch), strict=True):
        assert row.tolist() == list(range(sample * 8, sample * 8 + 7))


def test_order_is_identical_for_a_seed_and_differs_between_seeds(prepared):
    ids = {seed: [sample_ids(b) for b in read(datamodule(prepared, seed=seed), 10)] for seed in (0, 1)}
    assert ids[0] == [sample_ids(b) for b in read(datamodule(prepared, seed=0), 10)]
    assert ids[0] != ids[1]


def test_batches_do_not_depend_on_worker_count(prepared):
    assert_same(read(datamodule(prepared, num_workers=0), 8), read(datamodule(prepared, num_workers=2), 8))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("k", [5, 27])  # 24 batches per epoch: mid-epoch, and after the epoch boundary
def test_resume_continues_with_exactly_the_next_batches(prepared, num_workers, k):
    reference = read(datamodule(prepared, num_workers=num_workers), k + 6)
    interrupted = datamodule(prepared, num_workers=num_workers)
    assert_same(read(interrupted, k), reference[:k])
    state = interrupted.state_dict()
    assert state["epoch"] == k // 24 and state["consumed_samples"] == (k % 24) * 4
    fresh = PretrainDataModule(
        prepared, NoisyCausal(), seq_len=SEQ_LEN, micro_batch_size=4, num_workers=num_workers
    )
    fresh.load_state_dict(state)  # before setup, as in a new process
    assert_same(read(fresh, 6), reference[k:])


def test_resume_rejects_another_seed_or_other_data(prepared, tmp_path):
    state = datamodule(prepared).state_dict()
    with pytest.raises(ValueError, match="seed=0"):
        datamodule(prepared, seed=1).load_state_dict(state)
    other = make_prepared(tmp_path / "other", 50 * 8)
    with pytest.raises(ValueError, match="96 samples per epoch"):
        datamodule(other).load_state_dict(state)


def test_blend_proportions_are_exact_in_the_global_stream(tmp_path):
    a = make_prepared(tmp_path / "a", 64 * 8, first_id=0)
    b = make_prepared(tmp_path / "b", 64 * 8, first_id=10_000)
    world = 2
    ranks = [datamodule([a, b], weights=[3, 1], rank=r, world_size=world) for r in range(world)]
    batches = [read(dm, ranks[0].batches_per_epoch) for dm in ranks]
    stream = []  # global order: step by step, rank by rank
    for step in zip(*batches, strict=True):
        for batch in step:
            stream += (batch["input_ids"][:, 0] >= 10_000).long().tolist()
    counts = np.cumsum(np.eye(2, dtype=np.int64)[stream], axis=0)
    prefix = np.arange(1, len(stream) + 1)[:, None]
    assert np.abs(counts - np.array([0.75, 0.25]) * prefix).max() < 1
    assert len(stream) == 128  # default epoch: as many samples as both corpora hold


def test_validation_is_fixed_order_from_the_val_split(prepared):
    dm = datamodule(prepared, val_batches=3, world_size=2, rank=1)
    first, again = list(dm.val_dataloader()), list(dm.val_dataloader())
    assert len(first) == 3
    assert_same(first, again)
    starts = [row[0].item() - VAL_BASE for b in first for row in b["input_ids"]]
    assert starts == [8 * i for g in range(3) for i in range(8 * g + 4, 8 * g + 8)]  # rank 1's half, in order
    assert datamodule(prepared, val_batches=0).val_dataloader() == []


def test_missing_prepared_dir_names_path_and_command(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        PretrainDataModule(tmp_path / "nope", NoisyCausal(), seq_len=8, micro_batch_size=2)
    assert str(tmp_path / "nope") in str(err.value) and "pretrain prepare" in str(err.value)


def test_corpus_smaller_than_one_sample(tmp_path):
    small = make_prepared(tmp_path / "small", 100)
    dm = PretrainDataModule(small, NoisyCausal(), seq_len=128, micro_batch_size=2)
    with pytest.raises(ValueError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert str(small / "train") in msg and "100 tokens" in msg and "129" in msg


class Recorder(L.LightningModule):
    """Records the batches its training steps receive."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append({k: v.clone() for k, v in batch.items()})
        return self.w * batch["input_ids"].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DocumentEcho(NoisyCausal):
    """``NoisyCausal`` that also returns the document ids it was given."""

    document_mask = True

    def __call__(self, tokens, generators, document_ids=None):
        return {**super().__call__(tokens, generators), "document_ids": document_ids}


def test_document_ids_come_with_the_sample_and_resume_exactly(prepared, tmp_path):
    """With ``document_mask`` every sample carries its tokens' documents (the 7 documents of the prepared train
    split), and a resumed datamodule gives the same ids: they are a function of the sample, not of the loader."""
    (prepared / "meta.json").write_text(json.dumps({"document_lengths": "index"}))
    lengths = [len(d) for d in np.array_split(np.arange(96 * (SEQ_LEN + 1) + 5), 7)]
    document_of_token = np.repeat(np.arange(7), lengths)

    def make():
        return PretrainDataModule(
            prepared, DocumentEcho(), seq_len=SEQ_LEN, micro_batch_size=4, document_mask=True
        )

    reference = read(make(), 30)
    for batch in reference:
        for row, documents in zip(batch["input_ids"], batch["document_ids"], strict=True):
            expected = document_of_token[int(row[0]) : int(row[0]) + SEQ_LEN + 1]
            assert documents.tolist() == (expected - expected[0]).tolist()
    assert any(bool(b["document_ids"].any()) for b in reference)
    interrupted = make()
    assert_same(read(interrupted, 11), reference[:11])
    fresh = make()
    fresh.load_state_dict(interrupted.state_dict())
    assert_same(read(fresh, 19), reference[11:])
    (prepared / "meta.json").write_text("{}")
    with pytest.raises(
        ValueError, match="records none .* rerun `pretrain prepare`, or set data.document_mask=false"
    ):
        make()


def fit(dm, max_steps, root, ckpt_path=None, every=None, save_end=None) -> list[dict]:
    """Batches the training steps received; ``save_end``: where to save the state after the fit."""
    callbacks = (
        [L.pytorch.callbacks.ModelCheckpoint(root, every_n_train_steps=every, save_top_k=-1)] if every else []
    )
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=bool(every),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
    )
    model = Recorder()
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    if save_end is not None:
        trainer.save_checkpoint(save_end)
    return model.seen


@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_checkpoint_resume_is_exact(prepared, tmp_path, num_workers):
    def make():
        return PretrainDataModule(
            prepared, NoisyCausal(), seq_len=SEQ_LEN, micro_batch_size=4, num_workers=num_workers
        )

    reference = fit(make(), 35, tmp_path / "run", every=8)  # 24 batches per epoch; checkpoints every 8
    assert len(reference) == 35
    for step in (8, 24, 32):  # mid-epoch, at the epoch's end, in the second epoch
        ckpt = next((tmp_path / "run").glob(f"*step={step}.ckpt"))
        resumed = fit(make(), 35, tmp_path / f"resume{step}", ckpt_path=ckpt)
        assert_same(resumed, reference[step:])


@pytest.mark.parametrize("name", ["clm", "mlm", "span_corruption", "prefix_lm", "ul2"])
def test_every_objective_gets_samples_of_its_raw_length(tmp_path, name):
    from tokenizers import Tokenizer, models

    from pretrain import objectives
    from pretrain.datamodules.special_tokens import all_special_tokens

    specials = all_special_tokens()
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(200)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    seq_len = 32
    objective = objectives.build(name, tokenizer, **({"input_length": seq_len} if name == "ul2" else {}))
    root = tmp_path / "words"
    root.mkdir()
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        words = rng.integers(len(specials), len(vocab), 40 * objective.raw_length(seq_len))
        write_shard(root / split, np.array_split(words, 10), np.uint16)

    def batches(num_workers: int) -> list[dict[str, torch.Tensor]]:
        dm = PretrainDataModule(root, objective, seq_len=seq_len, micro_batch_size=4, num_workers=num_workers)
        dm.setup("fit")
        assert dm.train_set.datasets[0].sample_length == objective.raw_length(seq_len)
        return read(dm, 3)

    first = batches(0)
    assert first[0]["input_ids"].shape == (4, seq_len) and "labels" in first[0]
    assert_same(first, batches(2))


def test_tokenizer_must_match_the_prepared_data(prepared):
    from tokenizers import Tokenizer, models

    def word_level(n: int) -> Tokenizer:
        return Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))

    with pytest.raises(FileNotFoundError, match="no meta\\.json"):
        PretrainDataModule(prepared, NoisyCausal(), seq_len=8, micro_batch_size=2, tokenizer=word_level(10))
    ours = word_level(10)
    meta = {"vocab_size": 10, "tokenizer_sha256": hashlib.sha256(ours.to_str().encode()).hexdigest()}
    (prepared / "meta.json").write_text(json.dumps(meta))
    PretrainDataModule(prepared, NoisyCausal(), seq_len=8, micro_batch_size=2, tokenizer=ours)
    for other in (
        word_level(12),
        Tokenizer(models.WordLevel({f"v{i}": i for i in range(10)}, unk_token="v0")),
    ):
        with pytest.raises(ValueError, match="prepared with another tokenizer"):
            PretrainDataModule(prepared, NoisyCausal(), seq_len=8, micro_batch_size=2, tokenizer=other)


def test_empty_validation_split_suggests_val_batches_0(tmp_path):
    root = make_prepared(tmp_path / "noval", 20 * 8, n_val_tokens=3)
    with pytest.raises(ValueError, match="set trainer.limit_val_batches=0 to train without validation"):
        datamodule(root)
    assert len(read(datamodule(root, val_batches=0), 2)) == 2


def test_end_to_end_from_prepare_on_the_shipped_corpus(tmp_path, shipped_corpus):
    """raw text -> BPE -> prepare -> datamodule -> clm: two ranks read every packed cut of train once."""
    from pretrain import objectives
    from pretrain.datamodules.indexed import IndexedDataset
    from pretrain.datamodules.prepare import prepare
    from pretrain.datamodules.tokenizer import train_bpe

    tokenizer = train_bpe([shipped_corpus], vocab_size=400, show_progress=False)
    meta = prepare(shipped_corpus, tokenizer, tmp_path / "prepared", val_fraction=0.05, progress=False)
    clm = objectives.build("clm", tokenizer)
    ranks = [
        PretrainDataModule(
            tmp_path / "prepared",
            clm,
            seq_len=64,
            micro_batch_size=8,
            rank=r,
            world_size=2,
            tokenizer=tokenizer,
        )
        for r in range(2)
    ]
    rows = []
    for dm in ranks:
        dm.setup("fit")
        for batch in read(dm, dm.batches_per_epoch):
            raw = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)  # clm: labels = raw[1:]
            rows += [tuple(r) for r in raw.tolist()]
    train = np.asarray(IndexedDataset(tmp_path / "prepared" / "train").tokens, dtype=np.int64)
    cuts = {tuple(train[i * 65 : (i + 1) * 65].tolist()) for i in range(len(train) // 65)}
    assert len(rows) == len(set(rows)) == (len(cuts) // 16) * 16
    assert set(rows) <= cuts
    val_row = next(iter(ranks[0].val_dataloader()))["input_ids"][0].tolist()
    eos = meta["eos_id"]
    texts = [tokenizer.decode(list(doc)) for end, doc in itertools.groupby(val_row, eos.__eq__) if not end]
    assert len(texts) > 1 and all(t in shipped_corpus.read_text() for t in texts)


def test_extending_a_finished_run_continues_the_data(prepared, tmp_path):
    """The end-of-fit checkpoint (Lightning counts the cut-short epoch as finished, the data is mid-epoch)
    resumed with a larger ``max_steps`` continues the data exactly, through the next epoch boundary."""

    def make():
        return PretrainDataModule(prepared, NoisyCausal(), seq_len=SEQ_LEN, micro_batch_size=4)

    reference = fit(make(), 35, tmp_path / "full")  # 24 batches per epoch
    assert_same(fit(make(), 10, tmp_path / "first", save_end=tmp_path / "end.ckpt"), reference[:10])
    assert_same(fit(make(), 35, tmp_path / "more", ckpt_path=tmp_path / "end.ckpt"), reference[10:])
