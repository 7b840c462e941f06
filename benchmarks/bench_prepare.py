"""Preparation throughput vs the Hugging Face ``run_clm`` recipe and vs the bare tokenizer, same run.

Three ways to turn one text corpus into token ids with one tokenizer, timed end to end (best of
``--repeats``, interleaved):

* ``prepare``: ``pretrain.datamodules.prepare.prepare`` from the file to train/val ``.bin/.idx`` (content hash,
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

``--scan-cost`` times the executor's scan stage (what ``--executor`` adds for ``dedup: exact`` or a file cut in
byte ranges) against ``prepare`` on the same corpus, in CPU seconds.

``--growth 100,1000 --tasks 1,2 [--methods prepare,executor,datatrove]`` measures cost as the corpus grows: the text (paragraphs shuffled by a fixed
seed, as JSONL in 8 files so tasks have files to split) tokenized by ``prepare(num_workers=N)``,
``prepare_in_tasks`` (datatrove local executor, N tasks) and datatrove's own ``JsonlReader`` ->
``DocumentTokenizer`` (N tasks, no shuffling) with the same tokenizer and EOS. Each run is a fresh process;
it reports tokens per CPU second (tokens/s per core: the CPU time of the process and its workers) and the
peak RSS of the largest process (its own ``VmHWM``, its workers' ``ru_maxrss``: ``own_peak_rss_kb``); flat
memory means the peak does not grow with the size.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import tempfile
import time
from pathlib import Path

from pretrain.datamodules.corpus import batched, iter_documents, resolve_sources
from pretrain.datamodules.prepare import prepare
from pretrain.datamodules.tokenizer import load_tokenizer, save_tokenizer, train_bpe

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

    def __enter__(self) -> Timer:  # noqa: PYI034 (typing.Self is 3.11+)
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
    parser.add_argument("--growth", default=None, help="comma list of corpus sizes in MB, e.g. 100,1000")
    parser.add_argument("--tasks", default="1,2", help="--growth: worker / task counts")
    parser.add_argument(
        "--methods",
        default="prepare,executor,datatrove",
        help="--growth: which of prepare,executor,datatrove",
    )
    parser.add_argument(
        "--scan-cost", action="store_true", help="the executor's scan stage vs prepare, CPU seconds"
    )
    parser.add_argument(
        "--one", nargs=4, metavar=("METHOD", "CORPUS_DIR", "TOKENIZER", "N"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.one:
        return one_growth_run(*args.one)
    if args.growth:
        return growth(args)

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
        if args.scan_cost:
            scan_cost(args, corpus, tokenizer, tmp)
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


def scan_cost(args, corpus: Path, tokenizer, tmp: Path) -> None:
    """CPU seconds of the executor's scan stage (read, split, hash every document: what ``--executor`` adds for
    ``dedup: exact`` or a file cut in byte ranges) over those of ``prepare`` on the same corpus."""
    from pretrain.datamodules.prepare import text_digest

    def scan() -> None:
        for doc in iter_documents(resolve_sources(corpus)):
            text_digest(doc)

    best = {"scan": float("inf"), "prepare": float("inf")}
    for _ in range(args.repeats):
        for name, run in (("scan", scan), ("prepare", lambda: run_prepare(corpus, tokenizer, tmp / "p"))):
            with Timer() as timer:
                run()
            best[name] = min(best[name], timer.cpu)
    print(
        f"scan {best['scan']:.2f} cpu s, prepare {best['prepare']:.2f} cpu s: scan / prepare {best['scan'] / best['prepare']:.3f}"
    )


def write_jsonl_corpus(directory: Path, size_mb: float, files: int = 8) -> int:
    """The benchmark text, paragraphs shuffled (seed 0) and repeated to ``size_mb``, as ``files`` JSONL files."""
    import json
    import random

    source = build_corpus(directory / "raw.txt", min(size_mb, 16))
    paragraphs = [p for p in source.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    source.unlink()
    rng, written, target = random.Random(0), 0, size_mb * 1e6
    outs = [open(directory / f"part-{i:02d}.jsonl", "w", encoding="utf-8") for i in range(files)]  # noqa: SIM115
    try:
        while written < target:
            rng.shuffle(paragraphs)
            for k, paragraph in enumerate(paragraphs):
                line = json.dumps({"text": paragraph}) + "\n"
                outs[(written * files // int(target) if target else 0) % files].write(line)
                written += len(line.encode())
                if written >= target:
                    break
    finally:
        for f in outs:
            f.close()
    return written


def one_growth_run(method: str, corpus_dir: str, tokenizer_path: str, n: str) -> None:
    """One ``--growth`` measurement in this (fresh) process; prints ``tokens cpu_s wall_s peak_rss_kB``."""
    import json

    n, files = int(n), sorted(str(p) for p in Path(corpus_dir).glob("part-*.jsonl"))
    out = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    start = time.perf_counter()
    if method == "prepare":
        meta = prepare(files, tokenizer_path, out / "p", val_fraction=0.01, progress=False, num_workers=n)
        tokens = sum(x["tokens"] for x in meta["splits"].values())
    elif method == "executor":
        from pretrain.datamodules.executors import prepare_in_tasks

        # fork: the task processes are this process's children, so their CPU time is counted (not a forkserver's)
        meta = prepare_in_tasks(
            files,
            tokenizer_path,
            out / "p",
            tasks=n,
            workers=n,
            val_fraction=0.01,
            executor_options={"start_method": "fork"},
        )
        tokens = sum(x["tokens"] for x in meta["splits"].values())
    else:
        from datatrove.executor import LocalPipelineExecutor
        from datatrove.pipeline.readers import JsonlReader
        from datatrove.pipeline.tokens import DocumentTokenizer

        pipeline = [
            JsonlReader(corpus_dir, glob_pattern="part-*.jsonl"),
            DocumentTokenizer(
                str(out / "dt"),
                tokenizer_name_or_path=tokenizer_path,
                eos_token="</s>",
                shuffle_documents=False,
                batch_size=1024,
            ),
        ]
        LocalPipelineExecutor(
            pipeline, tasks=n, workers=n, logging_dir=str(out / "logs"), start_method="fork"
        ).run()
        tokens = sum(
            json.loads(p.read_text())["token_count"]
            if p.suffix == ".json"
            else int(p.read_text().split("\n")[1])
            for p in (out / "dt").glob("*.metadata")
        )
    wall = time.perf_counter() - start
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    print(tokens, f"{cpu:.2f}", f"{wall:.2f}", max(own_peak_rss_kb(), kids.ru_maxrss))


def own_peak_rss_kb() -> int:
    """This process's peak RSS (``VmHWM``). Not ``ru_maxrss``: Linux carries a process's ``ru_maxrss`` over
    ``exec``, so a fresh ``subprocess`` starts at the RSS its parent had (the ``--growth`` launcher's, which
    holds the corpus writer's buffers). A child's ``ru_maxrss`` may carry this process's RSS at its start the
    same way, which is at most this peak."""
    import re

    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))


def growth(args) -> None:
    """Cost as the corpus grows (see the module docstring)."""
    import subprocess
    import sys

    sizes, counts = [float(x) for x in args.growth.split(",")], [int(x) for x in args.tasks.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.tokenizer is not None:
            tokenizer = load_tokenizer(args.tokenizer)
        elif (SHARED / "tokenizers/gpt2/vocab.json").is_file():
            tokenizer = load_tokenizer(SHARED / "tokenizers/gpt2")
        else:
            tokenizer = train_bpe(REPO / "recipes/data/tinyshakespeare.txt", 8192, show_progress=False)
        tokenizer.add_special_tokens(["</s>"])
        tokenizer_file = save_tokenizer(tokenizer, tmp / "tok")
        for size in sizes:
            corpus = tmp / f"c{size:g}"
            corpus.mkdir()
            written = write_jsonl_corpus(corpus, size)
            for n in counts:
                for method in args.methods.split(","):
                    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
                    proc = subprocess.run(
                        [sys.executable, __file__, "--one", method, str(corpus), str(tokenizer_file), str(n)],
                        capture_output=True,
                        text=True,
                        env=env,
                        check=False,
                    )
                    if proc.returncode:
                        print(f"{method} {n} failed:\n{proc.stderr[-2000:]}")
                        continue
                    tokens, cpu, wall, rss = proc.stdout.split()[-4:]
                    rows.append(
                        (size, written / 1e6, method, n, int(tokens), float(cpu), float(wall), int(rss))
                    )
                    r = rows[-1]
                    print(
                        f"{r[1]:8.1f} MB {method:<10} n={n} tokens {r[4]:>12,} wall {r[6]:8.1f} s  "
                        f"tokens/s/core {r[4] / r[5]:>10,.0f}  peak RSS {r[7] / 1024:7.0f} MB",
                        flush=True,
                    )
            import shutil

            shutil.rmtree(corpus)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    base = {(m, n): r for r in rows if r[0] == sizes[0] for m, n in [(r[2], r[3])]}
    for r in rows:
        if r[0] != sizes[0] and (r[2], r[3]) in base:
            b = base[r[2], r[3]]
            print(
                f"{r[2]:<10} n={r[3]}: {b[1]:.0f} -> {r[1]:.0f} MB: peak RSS x{r[7] / b[7]:.2f}, tokens/s/core "
                f"x{(r[4] / r[5]) / (b[4] / b[5]):.2f}"
            )
    for size in sizes:
        for n in counts:
            got = {r[2]: r for r in rows if r[0] == size and r[3] == n}
            if "prepare" in got and "datatrove" in got:
                p, d = got["prepare"], got["datatrove"]
                print(
                    f"{p[1]:.0f} MB n={n}: prepare / datatrove tokens/s/core {(p[4] / p[5]) / (d[4] / d[5]):.2f}x, "
                    f"peak RSS {p[7] / d[7]:.2f}x"
                )


if __name__ == "__main__":
    main()
