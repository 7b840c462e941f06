"""Preparation throughput vs the Hugging Face ``run_clm`` recipe and vs the bare tokenizer, same run.

Three ways to turn one text corpus into token ids with one tokenizer, timed end to end (best of
``--repeats``, interleaved):

* ``prepare``: ``datamodules.prepare.prepare`` from the file to train/val ``.bin/.idx`` (content hash,
  streaming read, ``encode_batch``, EOS, split, write).
* ``run_clm``: the transformers example's recipe: ``datasets.load_dataset("text")``, ``Dataset.map`` of the
  fast tokenizer (batched), then ``group_texts`` into blocks of ``--block-size`` (fresh cache dir each time).
* ``encode_batch``: only the tokenizer's own ``encode_batch``/``encode_batch_fast`` calls (the faster) on the
  same documents already in memory, in prepare's batches: the ceiling for any pipeline.

Targets: prepare >= 3x run_clm, and prepare's time within 15% of encode_batch's (packing nearly free).

``--scaling 1,2`` instead times ``prepare(num_workers=N)`` (N tokenizing processes) against run_clm's
``Dataset.map(num_proc=N)`` for each N, and ``prepare(num_workers=0)`` (one process, the tokenizer's own
threads): wall seconds and CPU seconds of this process plus its (finished) worker processes. The scaling
1 -> N is the wall time at 1 over the wall time at N; it only means something on idle cores.
The corpus is WikiText-2 + Tiny Shakespeare from ``$PRETRAIN_SHARED_DATA`` (else the shipped corpus)
repeated to ``--size-mb``; the tokenizer is GPT-2's (else a BPE trained on the shipped corpus). Usage::

    python benchmarks/bench_prepare.py [--size-mb 16] [--repeats 3] [--tokenizer PATH]
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import tempfile
import time
from pathlib import Path

from datamodules.corpus import batched, iter_documents, resolve_sources
from datamodules.prepare import prepare
from datamodules.tokenizer import load_tokenizer, save_tokenizer, train_bpe

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PRETRAIN_SHARED_DATA", REPO.parent / "shared" / "data"))


def build_corpus(path: Path, size_mb: float) -> Path:
    parts = [
        SHARED / "lm/wikitext-2/test.txt",
        SHARED / "lm/wikitext-2/valid.txt",
        SHARED / "lm/tinyshakespeare/input.txt",
    ]
    parts = [p for p in parts if p.is_file()] or [REPO / "recipes/data/tinyshakespeare.txt"]
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in parts)
    copies = max(1, round(size_mb * 1e6 / len(text.encode())))
    path.write_text("\n\n".join([text] * copies), encoding="utf-8")
    return path


def children_cpu_seconds() -> float:
    """CPU seconds of this process's terminated, waited-for child processes (pool workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


class Timer:
    """Wall-clock seconds and CPU seconds of a ``with`` block: ``main`` (this process, all its threads),
    ``workers`` (its finished worker processes) and ``cpu`` (both)."""

    def __enter__(self) -> Timer:  # noqa: PYI034 (py3.10 has no typing.Self)
        self.wall, self.main, self.workers = time.perf_counter(), time.process_time(), children_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.wall
        self.main = time.process_time() - self.main
        self.workers = children_cpu_seconds() - self.workers
        self.cpu = self.main + self.workers


def run_prepare(corpus: Path, tokenizer, out: Path, num_workers: int = 0) -> int:
    meta = prepare(corpus, tokenizer, out, progress=False, force=True, num_workers=num_workers)
    return sum(s["tokens"] for s in meta["splits"].values())


def run_encode_batch(batches: list[list[str]], encode) -> int:
    return sum(len(e) for batch in batches for e in encode(batch, add_special_tokens=False))


def run_clm(
    corpus: Path, tokenizer_file: Path, block_size: int, cache: Path, num_proc: int | None = None
) -> int:
    """transformers/examples/pytorch/language-modeling/run_clm.py, data part (``--preprocessing_num_workers``
    is ``num_proc``)."""
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    raw = datasets.load_dataset("text", data_files={"train": str(corpus)}, cache_dir=str(cache))
    tokenized = raw.map(
        lambda examples: hf_tok(examples["text"]),
        batched=True,
        num_proc=num_proc,
        remove_columns=["text"],
        load_from_cache_file=False,
    )

    def group_texts(examples):
        concatenated = {k: list(itertools.chain(*examples[k])) for k in examples}
        total = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    grouped = tokenized.map(group_texts, batched=True, num_proc=num_proc, load_from_cache_file=False)
    assert len(grouped["train"]) > 0
    return sum(len(ids) for ids in tokenized["train"]["input_ids"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--skip-run-clm", action="store_true")
    parser.add_argument("--scaling", default=None, help="comma list of worker counts, e.g. 1,2")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = build_corpus(tmp / "corpus.txt", args.size_mb)
        if args.tokenizer is not None:
            tokenizer = load_tokenizer(args.tokenizer)
        elif (SHARED / "tokenizers/gpt2/vocab.json").is_file():
            tokenizer = load_tokenizer(SHARED / "tokenizers/gpt2")
        else:
            tokenizer = train_bpe(REPO / "recipes/data/tinyshakespeare.txt", 8192, show_progress=False)
        tokenizer_file = save_tokenizer(tokenizer, tmp / "tok")
        size_mb = corpus.stat().st_size / 1e6
        batches = list(batched(iter_documents(resolve_sources(corpus))))  # prepare's default batches
        print(
            f"corpus {size_mb:.1f} MB, {sum(map(len, batches))} documents, vocab {tokenizer.get_vocab_size()}, "
            f"{os.cpu_count()} CPUs"
        )

        if args.scaling:
            scaling(args, corpus, tokenizer, tokenizer_file, tmp, size_mb)
            return
        best: dict[str, tuple[Timer, int]] = {}
        for rep in range(args.repeats):
            runs = {
                "encode_batch": lambda: run_encode_batch(batches, tokenizer.encode_batch),
                "encode_fast": lambda: run_encode_batch(batches, tokenizer.encode_batch_fast),
                "prepare": lambda: run_prepare(corpus, tokenizer, tmp / "prepared"),
            }
            if not args.skip_run_clm:
                cache = tmp / f"hf{rep}"
                runs["run_clm"] = lambda cache=cache: run_clm(corpus, tokenizer_file, args.block_size, cache)
            for name, run in runs.items():
                with Timer() as timer:
                    tokens = run()
                if name not in best or timer.wall < best[name][0].wall:
                    best[name] = (timer, tokens)

    print(f"{'method':<14}{'wall s':>8}{'cpu s':>8}{'MB/s':>8}{'Mtok/s':>8}")
    for name, (timer, tokens) in best.items():
        print(
            f"{name:<14}{timer.wall:>8.2f}{timer.cpu:>8.2f}{size_mb / timer.wall:>8.2f}{tokens / timer.wall / 1e6:>8.3f}"
        )
    prep = best["prepare"][0]
    peer = min((best["encode_batch"][0], best["encode_fast"][0]), key=lambda t: t.wall)
    print(
        f"prepare / encode_batch (faster of the two): wall {prep.wall / peer.wall:.3f}, "
        f"cpu {prep.cpu / peer.cpu:.3f} (target <= 1.15)"
    )
    if "run_clm" in best:
        clm = best["run_clm"][0]
        print(
            f"prepare speed-up over run_clm: wall {clm.wall / prep.wall:.2f}x, cpu {clm.cpu / prep.cpu:.2f}x (target >= 3)"
        )


def scaling(args, corpus: Path, tokenizer, tokenizer_file: Path, tmp: Path, size_mb: float) -> None:
    """prepare(num_workers=N) vs run_clm's map(num_proc=N), best of ``--repeats`` (interleaved)."""
    counts = [int(n) for n in args.scaling.split(",")]
    runs = {"prepare threads": lambda: run_prepare(corpus, tokenizer, tmp / "prepared", 0)}
    for n in counts:
        runs[f"prepare {n}p"] = lambda n=n: run_prepare(corpus, tokenizer, tmp / "prepared", n)
        if not args.skip_run_clm:
            runs[f"run_clm {n}p"] = lambda n=n: run_clm(
                corpus, tokenizer_file, args.block_size, tmp / f"hf{time.monotonic_ns()}", n
            )
    best: dict[str, Timer] = {}
    for _ in range(args.repeats):
        for name, run in runs.items():
            with Timer() as timer:
                run()
            if name not in best or timer.wall < best[name].wall:
                best[name] = timer
    print(f"{'method':<16}{'wall s':>8}{'cpu s':>8}{'main':>8}{'workers':>8}{'MB/s':>8}")
    for name, t in best.items():
        print(f"{name:<16}{t.wall:>8.2f}{t.cpu:>8.2f}{t.main:>8.2f}{t.workers:>8.2f}{size_mb / t.wall:>8.2f}")
    first = counts[0]
    for n in counts[1:]:
        line = f"scaling {first} -> {n} processes (wall): prepare {best[f'prepare {first}p'].wall / best[f'prepare {n}p'].wall:.2f}x"
        if not args.skip_run_clm:
            line += f", run_clm {best[f'run_clm {first}p'].wall / best[f'run_clm {n}p'].wall:.2f}x"
        print(line)
    if not args.skip_run_clm:
        for n in counts:
            clm, prep = best[f"run_clm {n}p"], best[f"prepare {n}p"]
            print(
                f"prepare / run_clm at {n} process(es): wall {clm.wall / prep.wall:.2f}x, cpu {clm.cpu / prep.cpu:.2f}x"
            )


if __name__ == "__main__":
    main()
