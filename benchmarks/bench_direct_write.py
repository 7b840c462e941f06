"""What writing a checkpoint-sized file costs the machine's CPUs: through the page cache (a plain buffered write,
as DCP's ``FileSystemWriter`` does) vs ``pretrain.checkpoint.direct_write.DirectStream`` (``O_DIRECT``, unpaced),
the same bytes from memory already paged in, each into a new file (a checkpoint is a new file at every save).

Per method, median of ``--rounds`` (alternating): wall seconds, this process's CPU seconds, the whole machine's
busy CPU seconds (``/proc/stat``: user + system + irq, all cores) and its steal (time the host ran something
else on the guest's CPUs: on a VM, the host's I/O work can land there).

    python benchmarks/bench_direct_write.py [--gib 1.5] [--rounds 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from contextlib import closing
from pathlib import Path

from pretrain.checkpoint.direct_write import CHUNK, DirectStream


def machine() -> tuple[float, float]:
    """(busy CPU seconds, steal seconds) of all cores since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def write(method: str, data: mmap.mmap, path: Path) -> tuple[float, float, float, float]:
    view = memoryview(data)
    busy0, steal0 = machine()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if method == "direct":
        with closing(DirectStream(path)) as stream:
            for start in range(0, len(data), CHUNK):
                stream.write(view[start : start + CHUNK])
    else:
        with open(path, "wb") as f:
            for start in range(0, len(data), CHUNK):
                f.write(view[start : start + CHUNK])
            f.flush()
            os.fsync(f.fileno())
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    busy1, steal1 = machine()
    view.release()
    path.unlink()
    return wall, cpu, busy1 - busy0, steal1 - steal0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temporary directory)"
    )
    args = parser.parse_args()
    size = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    data = mmap.mmap(-1, size)
    for start in range(0, size, CHUNK):  # paged in, not zero pages
        data[start : start + CHUNK] = os.urandom(64) * (CHUNK // 64)
    methods = ["buffered", "direct"]
    rows: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for r in range(args.rounds):
            for method in methods if r % 2 == 0 else methods[::-1]:
                rows[method].append(write(method, data, Path(tmp) / f"{method}.bin"))
                time.sleep(2)  # the previous file's pages freed
    print(f"{size / (1 << 30):.2f} GiB into a new file, median of {args.rounds} rounds")
    print(f"{'method':<9} {'wall s':>7} {'process CPU s':>14} {'machine busy CPU s':>19} {'steal s':>8}")
    medians = {m: [statistics.median(col) for col in zip(*rows[m])] for m in methods}
    for method in methods:
        wall, cpu, busy, steal = medians[method]
        print(f"{method:<9} {wall:>7.2f} {cpu:>14.2f} {busy:>19.2f} {steal:>8.2f}")
    buffered, direct = medians["buffered"], medians["direct"]
    print(
        f"direct / buffered: machine busy CPU {direct[2] / buffered[2]:.3f}, busy + steal "
        f"{(direct[2] + direct[3]) / (buffered[2] + buffered[3]):.3f}"
    )


if __name__ == "__main__":
    main()
