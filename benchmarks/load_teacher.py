"""Loading a GGUF teacher (`teacher.load_teacher`) four ways: one parse for each of config, weights and tokenizer,
as transformers does by itself (`plain`); its file parsed once (`shared`, `shared_gguf_readers`); the first load with
the teacher cache on, which also writes the dequantised teacher into it (`first`); and a load from that cache entry
(`cached`, what every later command does). Wall seconds, `gguf.GGUFReader`s built, and whether every load gives the
same weights and token ids. Runs alternate, `--reps` of each, each rep with an empty cache of its own. Prints JSON and
a table.

    python benchmarks/load_teacher.py --teachers smollm2-135m,models/gemma-3-270m-q4_k_m.gguf --out FILE
    python benchmarks/load_teacher.py --reps 1                   # the embedded teacher once each (a check)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from unittest import mock

import torch

from taylor_calibrate import teacher as teacher_mod
from taylor_calibrate.config import TEACHER_CACHE_ENV
from taylor_calibrate.results import record

TEXT = "def f(x):\n    return x * 12345  # héllo, wörld\n"


KINDS = ("plain", "shared", "first", "cached")


def load(spec: str, kind: str, cache: str) -> tuple[float, int, object]:
    """(seconds, readers built, the Teacher) of one load of `kind` (see above); `cache`: the teacher cache's
    directory for `first` and `cached`."""
    import gguf

    real, made = gguf.GGUFReader, []

    def counting(path, *args, **kwargs):
        made.append(path)
        return real(path, *args, **kwargs)

    env = {TEACHER_CACHE_ENV: cache if kind in ("first", "cached") else "off"}
    with mock.patch.object(gguf, "GGUFReader", counting), mock.patch.dict(os.environ, env), \
            contextlib.ExitStack() as stack:
        if kind == "plain":
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
        times, readers, same = {k: [] for k in KINDS}, {}, True
        for _ in range(a.reps):
            got = {}
            with tempfile.TemporaryDirectory(prefix="teacher-cache-") as cache:
                for kind in KINDS:
                    s, n, got[kind] = load(spec, kind, cache)
                    times[kind].append(s)
                    readers[kind] = n
            want = got["plain"].model.state_dict()
            for kind in KINDS[1:]:
                same &= all(torch.equal(t, want[k]) for k, t in got[kind].model.state_dict().items())
                same &= got[kind].tokenizer(TEXT)["input_ids"] == got["plain"].tokenizer(TEXT)["input_ids"]
            del got
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"teacher": spec, "seconds": times, "median_s": med, "readers_built": readers,
                     "speedup": med["plain"] / med["shared"], "cached_speedup": med["shared"] / med["cached"],
                     "same_weights_and_ids": same})
        print(json.dumps(rows[-1]), flush=True)
    lines = ["| teacher | three parses s | one parse s | first, writing the cache s | from the cache s | one parse / "
             "three | cached / one parse | readers built | same weights and ids |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['teacher']} | {r['median_s']['plain']:.1f} | {r['median_s']['shared']:.1f} | "
              f"{r['median_s']['first']:.1f} | {r['median_s']['cached']:.1f} | {r['speedup']:.2f}x | "
              f"{r['cached_speedup']:.1f}x | {' / '.join(str(r['readers_built'][k]) for k in KINDS)} | "
              f"{r['same_weights_and_ids']} |" for r in rows]
    print("\n".join(lines))
    if a.out:
        record(a.out, {"what": " ".join(__doc__.split("\n\n")[0].split()), "rows": rows}, a)


if __name__ == "__main__":
    sys.exit(main())
