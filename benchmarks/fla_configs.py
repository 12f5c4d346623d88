"""Record the kernel configs fla's autotuner picks, for `taylor_calibrate/ops/fla_configs/`.

Runs one taylor-calibrate command in this process (so its kernels autotune on the real shapes), then writes
every fla autotuner's choices in fla's own config-file format, one `<kernel>.json` per kernel, merged into
what the folder already holds (run it for convert, distill and eval in turn). A later process that finds the
folder (ops/fla.py, `use_tuned_configs`) compiles one config per kernel and shape instead of all candidates.

    python benchmarks/fla_configs.py --dir taylor_calibrate/ops/fla_configs/fla-0.6.0/NVIDIA_H200 -- \\
        convert --teacher smollm2-135m --out /tmp/hybrid

Run it with FLA_CACHE_MODE unset (the shipped configs would otherwise be read back instead of tuned).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path


def tuned_entries() -> dict[str, dict]:
    """{kernel name: {key hash: entry}} from every fla autotuner alive in this process."""
    import triton
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    kernels: dict[str, dict] = {}
    for tuner in (o for o in gc.get_objects() if isinstance(o, CachedAutotuner)):
        for key, cfg in tuner.cache.items():
            config = {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                      "num_ctas": getattr(cfg, "num_ctas", 1), "maxnreg": getattr(cfg, "maxnreg", None)}
            entry = {"autotune_key": AutotuneKey.normalize_autotune_key(list(key)), "config": config,
                     "triton_version": triton.__version__}
            kernels.setdefault(tuner.kernel_name, {})[AutotuneKey.key_hash(key)] = entry
    return kernels


def write(folder: Path, kernels: dict[str, dict]) -> int:
    """Merge into folder/<kernel>.json (atomically per file); returns the number of entries written."""
    import triton

    folder.mkdir(parents=True, exist_ok=True)
    count = 0
    for name, entries in sorted(kernels.items()):
        path = folder / f"{name}.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        merged = {**data.get("autotune_entries", {}), **entries}
        data = {"kernel_name": name, "triton_version": triton.__version__, "autotune_entries": merged}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
        count += len(entries)
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="config folder: fla_configs/fla-<version>/<GPU>")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then a taylor-calibrate command")
    args = parser.parse_args()
    if "FLA_CACHE_MODE" in os.environ:
        parser.error("unset FLA_CACHE_MODE: with it set, fla reads configs instead of tuning them")
    os.environ["FLA_CACHE_MODE"] = "disabled"  # keep use_tuned_configs from reading the folder being written
    from taylor_calibrate.cli import main as cli

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    rc = cli(command)
    count = write(args.dir, tuned_entries())
    print(json.dumps({"dir": str(args.dir), "entries": count, "command_rc": rc}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
