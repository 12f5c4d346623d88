"""Loading a GGUF teacher (`teacher.load_teacher`) with its file parsed once for config, weights and tokenizer
(`shared_gguf_readers`, what every command does) against one parse for each, as transformers does by itself: wall
seconds, `gguf.GGUFReader`s built, and whether the two loads give the same weights and token ids. Runs alternate,
`--reps` of each. Prints JSON and a table.

    python benchmarks/load_teacher.py --teachers smollm2-135m,models/gemma-3-270m-q4_k_m.gguf --out FILE
    python benchmarks/load_teacher.py --reps 1                   # the embedded teacher once each (a check)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from unittest import mock

import torch

from taylor_calibrate import teacher as teacher_mod
from taylor_calibrate.results import record

TEXT = "def f(x):\n    return x * 12345  # héllo, wörld\n"


def load(spec: str, shared: bool) -> tuple[float, int, object]:
    """(seconds, readers built, the Teacher) of one load, with or without the shared reader."""
    import gguf

    real, made = gguf.GGUFReader, []

    def counting(path, *args, **kwargs):
        made.append(path)
        return real(path, *args, **kwargs)

    with mock.patch.object(gguf, "GGUFReader", counting), contextlib.ExitStack() as stack:
        if not shared:
            stack.enter_context(mock.patch.object(teacher_mod, "shared_gguf_readers", contextlib.nullcontext))
        t = time.perf_counter()
        loaded = teacher_mod.load_teacher(spec, "cpu", torch.float32)
        return time.perf_counter() - t, len(made), loaded


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teachers", default=teacher_mod.DEFAULT_TEACHER, help="GGUF teacher specs, comma-separated")
    ap.add_argument("--reps", type=int, default=2, help="loads of each kind per teacher (alternating)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    for spec in a.teachers.split(","):
        times, readers, same = {"shared": [], "plain": []}, {}, True
        for _ in range(a.reps):
            got = {}
            for kind in ("plain", "shared"):
                s, n, got[kind] = load(spec, kind == "shared")
                times[kind].append(s)
                readers[kind] = n
            want = got["plain"].model.state_dict()
            same &= all(torch.equal(t, want[k]) for k, t in got["shared"].model.state_dict().items())
            same &= got["shared"].tokenizer(TEXT)["input_ids"] == got["plain"].tokenizer(TEXT)["input_ids"]
            del got
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"teacher": spec, "seconds": times, "median_s": med, "readers_built": readers,
                     "speedup": med["plain"] / med["shared"], "same_weights_and_ids": same})
        print(json.dumps(rows[-1]), flush=True)
    lines = ["| teacher | one parse s | three parses s | speedup | readers built | same weights and ids |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['teacher']} | {r['median_s']['shared']:.1f} | {r['median_s']['plain']:.1f} | {r['speedup']:.2f}x | "
              f"{r['readers_built']['shared']} vs {r['readers_built']['plain']} | {r['same_weights_and_ids']} |"
              for r in rows]
    print("\n".join(lines))
    if a.out:
        record(a.out, {"what": " ".join(__doc__.split("\n\n")[0].split()), "rows": rows}, a)


if __name__ == "__main__":
    sys.exit(main())
