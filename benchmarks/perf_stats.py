"""The statistics pass on a Qwen2.5-1.5B-shaped teacher (bf16): `collect_stats` as `convert` calls it (GDN layers
stored on the GPU) against the same teacher forward without statistics (both keep only the last position's logits;
the full-logits forward is recorded beside), at long lengths, batch 1 (`stats_vs_forward`), with the torch
statistics path beside the default one; peak GPU memory of the pass above the weights.

    python benchmarks/perf_stats.py --out perf_stats.json
    python benchmarks/perf_stats.py --tiny --device cpu --out /tmp/perf_stats.json
"""
from __future__ import annotations

import json

import torch

# perf_common.py sits beside this script (its directory is on sys.path when it runs)
from perf_common import allocated, build_teacher, free, ints, mb, measure, ratio, run_benchmark, tensor_bytes

from taylor_calibrate import ops
from taylor_calibrate.policy import gdn_layers, kept_layers
from taylor_calibrate.stats import collect_stats

DEFAULTS = {
    "stats_lengths": ("1024,2048,4096,8192,32768", "32,64"),
    "ratio_lengths": ("8192,32768", "64"),
    "torch_lengths": ("8192,32768", "64"),
}
"""Flag defaults: (full, --tiny)."""


def part_stats(a, device, dtype, res, save):
    model = build_teacher("1p5b", a.tiny, device, dtype)
    weights = allocated(device)
    cfg = model.config
    n = cfg.num_hidden_layers
    store = gdn_layers(kept_layers("uniform", n, 4), n)  # what `convert` stores for phase 1 and 2
    backend = ops.resolve_stats_backend("auto", device)
    mem_T, ratio_T, torch_T = ints(a.stats_lengths), ints(a.ratio_lengths), ints(a.torch_lengths)
    detail = res.setdefault("stats", {})
    detail.update(shape="qwen2.5-1.5b" + (" (tiny)" if a.tiny else ""), batch=1, stats_backend=backend,
                  stored_layers=len(store), weights_mb=mb(weights), rows={})
    gen = torch.Generator().manual_seed(0)

    def stats_pass(ids, which):
        st = collect_stats(model, ids, store_layers=store, batch_size=1, store_device=device, backend=which)
        stored = sum(tensor_bytes(x) for d in (st.inputs, st.head_outputs) for x in d.values())
        del st
        return stored

    def forward(ids_dev, logits_to_keep=0):
        model(input_ids=ids_dev, use_cache=False, logits_to_keep=logits_to_keep)

    for T in sorted(set(mem_T + ratio_T + torch_T)):
        ids = torch.randint(0, cfg.vocab_size, (1, T), generator=gen)
        ids_dev = ids.to(device)
        forward(ids_dev)  # warm-up: the statistics kernel autotunes its tiles once per length
        stats_pass(ids, "auto")
        free(device)
        repeats = a.repeats if T in ratio_T else 1
        row = {}
        # the ratio's denominator is the same pass without statistics (last position's logits only, as the statistics
        # pass); the full forward with (T x vocab) logits is recorded beside it
        runs = [measure(lambda: forward(ids_dev, 1), device) for _ in range(repeats)]
        row["forward_s"] = min(r[1] for r in runs)
        row["forward_peak_mb"] = mb(runs[0][2])
        free(device)
        runs = [measure(lambda: forward(ids_dev), device) for _ in range(repeats)]
        row["forward_all_logits_s"] = min(r[1] for r in runs)
        free(device)
        runs = [measure(lambda: stats_pass(ids, "auto"), device) for _ in range(repeats)]
        row["stats_s"], row["stats_peak_mb"], row["stored_mb"] = min(r[1] for r in runs), mb(runs[0][2]), mb(runs[0][0])
        row["stats_vs_forward"] = ratio(row["stats_s"], row["forward_s"])
        row["stats_vs_forward_all_logits"] = ratio(row["stats_s"], row["forward_all_logits_s"])
        if backend == "triton":  # the tiles the autotuner picked for this length
            from taylor_calibrate.ops.attention_stats_triton import _tuned_kernel

            row["kernel_config"] = str(getattr(_tuned_kernel, "best_config", None))
        free(device)
        if T in torch_T and backend != "torch":  # the PyTorch statistics path, for comparison
            try:
                _, row["stats_torch_s"], peak = measure(lambda: stats_pass(ids, "torch"), device)
                row["stats_torch_peak_mb"] = mb(peak)
                row["stats_torch_vs_forward"] = ratio(row["stats_torch_s"], row["forward_s"])
            except torch.OutOfMemoryError as e:
                row["stats_torch_error"] = f"OOM: {str(e).splitlines()[0]}"
            free(device)
        detail["rows"][str(T)] = row
        if T in ratio_T:
            res.setdefault("stats_vs_forward", {})[str(T)] = row["stats_vs_forward"]
            if "stats_torch_vs_forward" in row:
                res.setdefault("stats_vs_forward_torch", {})[str(T)] = row["stats_torch_vs_forward"]
        if T in mem_T:
            res.setdefault("stats_peak_mem_mb", {})[str(T)] = row["stats_peak_mb"]
        print(f"[stats] T={T}: " + json.dumps(row), flush=True)
        save()
    del model
    free(device)


def add_arguments(ap):
    ap.add_argument("--repeats", type=int, default=2, help="best of N timings at the ratio lengths")


def main(argv=None):
    return run_benchmark("perf_stats", __doc__, part_stats, DEFAULTS, add_arguments, argv)


if __name__ == "__main__":
    main()
