"""Performance at real model shapes (random weights, one GPU): the statistics pass, the whole conversion, inference.

Parts (pick with --parts; each finishes well inside 10 minutes on one H200; the JSON is rewritten after every
measured row, so a killed run keeps what it measured; a markdown twin is written beside it):

  align      phase 2 alone (the default alignment, full profile) on a SmolLM2-135M-shaped teacher, timed after a
             short untimed run has compiled and tuned every kernel (`align_smollm2_warm_s`; the convert part's
             `align_smollm2_s` is the cold figure of a fresh process).
  stats      Qwen2.5-1.5B-shaped teacher (bf16): `collect_stats` as `convert` calls it (GDN layers stored on the
             GPU) against the same teacher forward without statistics (both keep only the last position's logits;
             the full-logits forward is recorded beside), at T = 8K and 32K, batch 1 (`stats_vs_forward`), with the torch
             statistics path beside the default one; peak GPU memory of the pass above the weights at T = 1K..32K.
  scale      the default conversion (statistics, phase 1, phase 2, held-out evaluation; full profile) per stage, with
             peak memory, for the 1.5B shape and a Qwen3-8B shape, teachers built in memory (convert.convert_loaded).
  convert    the default conversion of a real teacher (--teacher, default the embedded SmolLM2-135M) as
             `taylor-calibrate convert` runs it: wall time per stage (`align_smollm2_s` = phase 2) and held-out
             perplexity of teacher and hybrid.
  distill    recovery distillation of a 1.5B-shape hybrid (uniform, copy-only mixers) toward its teacher, as `distill`
             runs it (fp32 master weights, bf16 autocast, forward KL over the 152K vocabulary): tokens/s after the
             first (untimed) step and MFU (`distill.flops_per_token`, H200 bf16 peak 989 TFLOP/s); eager and / or
             compiled (--distill-modes; compiled is the CUDA default, `--train.compile`).
  inference  1.5B-shape hybrid (uniform, keep_every 4: 7 attention + 21 GDN layers, copy-only mixers: speed does not
             depend on the init) against its teacher (SDPA): prefill and decode throughput at 4K..64K, batch 1 and 8,
             and cache bytes per sequence (KV of attention layers + GDN recurrent / conv state); eager decoding
             through the models' DynamicCache, as `generate` runs by default.
  decode     the same two models decoding through a StaticCache with one step captured as a CUDA graph (on a GPU),
             over a context x batch grid (--decode-grid), beside the bandwidth roofline of each cell; the logits
             are first checked against the eager decode.

Ratios: *_speedup = teacher seconds / hybrid seconds (> 1: the hybrid is faster); cache_bytes_ratio = hybrid bytes /
teacher bytes; stats_vs_forward = statistics-pass seconds / forward seconds. `--tiny` runs every part on tiny shapes
(CPU is fine) to check the script end to end.

    python benchmarks/perf.py --parts stats --out benchmarks/results/perf_h200.json
    python benchmarks/perf.py --parts convert,distill --teacher <gguf> --out benchmarks/results/perf_h200.json
    python benchmarks/perf.py --tiny --out /tmp/perf_tiny.json
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from taylor_calibrate import ops
from taylor_calibrate.align import align_layers
from taylor_calibrate.config import (AlignArgs, CalibArgs, ConvertArgs, DataArgs, GDNConfig, TrainArgs,
                                     fill_align, load_profile)
from taylor_calibrate.calibrate import calibrated_mixers
from taylor_calibrate.convert import convert_loaded
from taylor_calibrate.distill import distill
from taylor_calibrate.export import write_json
from taylor_calibrate.model.hybrid import convert_teacher
from taylor_calibrate.policy import gdn_layers, kept_layers
from taylor_calibrate.stats import attention_targets, collect_stats
from taylor_calibrate.teacher import DEFAULT_TEACHER, Teacher, embedded_teacher_path, load_teacher, resolve_device

# Teacher shapes (config fields of the public checkpoints; random weights)
SHAPES = {
    "smollm2": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                              head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)),
    "1p5b": ("qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                           head_dim=128, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                           use_sliding_window=False, max_position_embeddings=131072)),
    "8b": ("qwen3", dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                         max_position_embeddings=131072)),  # Qwen3: q/k RMSNorm built in
}
TINY_SHAPES = {
    "smollm2": ("llama", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, intermediate_size=128, vocab_size=512, tie_word_embeddings=True)),
    "1p5b": ("qwen2", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
                           use_sliding_window=False)),
    "8b": ("qwen3", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=512, tie_word_embeddings=False)),
}
# flag defaults: (full, tiny)
DEFAULTS = {
    "stats_lengths": ("1024,2048,4096,8192,32768", "32,64"),
    "ratio_lengths": ("8192,32768", "64"),
    "torch_lengths": ("8192,32768", "64"),
    "scale_shapes": ("1p5b,8b", "1p5b,8b"),
    "contexts": ("4096,16384,32768,65536", "32,64"),
    "batches": ("1,8", "1,2"),
    "decode_steps": (32, 3),
    "distill_batch": (16, 2),
    "distill_micro": (8, 1),
    "distill_seq": (2048, 32),
    "distill_steps": (8, 3),
    "decode_grid": ("4096x8,16384x8,32768x1,32768x8,32768x16,32768x32,32768x64,65536x8", "32x1,32x3"),
    "graph_steps": (64, 3),
    "prefill_chunk": (8, 2),
}
PARTS = ("convert", "align", "stats", "scale", "distill", "inference", "decode")
MB = 2 ** 20


# ----------------------------------------------------------------------------- helpers


def build_teacher(shape: str, tiny: bool, device: torch.device, dtype: torch.dtype):
    """A random-weight causal LM of the named shape, built directly on `device` (no checkpoint on disk)."""
    arch, kw = (TINY_SHAPES if tiny else SHAPES)[shape]
    cfg = AutoConfig.for_model(arch, **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


class ByteTokenizer:
    """Stand-in when the embedded teacher's tokenizer is not installed: UTF-8 bytes (timing does not depend on it)."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8", "replace"))}


def load_tokenizer(kind: str):
    """The embedded teacher's tokenizer (vocab 49152, below every shape's vocab), else bytes; returns (tok, what)."""
    if kind == "embedded":
        try:
            from transformers import AutoTokenizer

            path = embedded_teacher_path()
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), "smollm2-135m (embedded)"
        except Exception as e:  # noqa: BLE001  (recorded in the JSON, and the run goes on)
            print(f"[perf] embedded tokenizer unavailable ({type(e).__name__}: {e}); using bytes", flush=True)
            return ByteTokenizer(), f"bytes (embedded unavailable: {type(e).__name__})"
    return ByteTokenizer(), "bytes"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, device: torch.device):
    """Run fn once: (its result, seconds, peak bytes allocated above what was allocated before; None on CPU)."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t = time.perf_counter()
    out = fn()
    sync(device)
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
    return out, seconds, peak


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated() if device.type == "cuda" else None


def mb(x):
    return None if x is None else x / MB


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def tensor_bytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def kv_bytes(cache) -> int:
    """Bytes of the keys and values of a transformers cache's attention layers."""
    return sum(tensor_bytes(getattr(layer, "keys", None)) + tensor_bytes(getattr(layer, "values", None))
               for layer in cache.layers)


def cache_bytes(cache) -> int:
    """Bytes held by a transformers cache: keys/values of attention layers, recurrent and conv states of GDN layers."""
    return kv_bytes(cache) + sum(tensor_bytes(x) for layer in cache.layers
                                 for states in ("recurrent_states", "conv_states")
                                 for x in (getattr(layer, states, None) or {}).values())


@contextlib.contextmanager
def counting_gdn_kernels():
    """Count which GDN implementation (backend/mode) the dispatcher runs, e.g. {"fla/recurrent": 672}."""
    counts = collections.Counter()
    saved = dict(ops._IMPLS)

    def wrap(key, fn):
        def counted(*args, **kwargs):
            counts["/".join(key)] += 1
            return fn(*args, **kwargs)
        return counted

    ops._IMPLS.update({key: wrap(key, fn) for key, fn in saved.items()})
    try:
        yield counts
    finally:
        ops._IMPLS.update(saved)


@contextlib.contextmanager
def profiled(device: torch.device, rows: int = 30):
    """torch.profiler around the block, then the top ops by CPU time and, on a GPU, by CUDA time."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        yield
    for sort in ("cpu_time_total",) + (("cuda_time_total",) if device.type == "cuda" else ()):
        print(prof.key_averages().table(sort_by=sort, row_limit=rows), flush=True)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ----------------------------------------------------------------------------- part a: statistics pass


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


# ----------------------------------------------------------------------------- part b: the whole conversion


def part_scale(a, device, dtype, res, save, tokenizer, tokenizer_name):
    detail = res.setdefault("scale", {})
    for shape in a.scale_shapes.split(","):
        free(device)
        before = allocated(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()  # load_teacher_s = building the random teacher
        model = build_teacher(shape, a.tiny, device, dtype)
        weights = None if before is None else allocated(device) - before
        teacher = Teacher(model=model, tokenizer=tokenizer, name=f"random {shape} shape")
        args = ConvertArgs(teacher=f"random-{shape}", device=device.type, dtype=str(dtype).replace("torch.", ""))
        if a.tiny:
            args.data = DataArgs(seq_len=64, calib_seqs=4, eval_seqs=4)
            args.phase2 = AlignArgs(steps=4, batch_size=2, log_every=2)
        if a.scale_align_steps is not None:
            args.phase2.steps = a.scale_align_steps
        row = {"shape": shape, "tokenizer": tokenizer_name}
        try:
            report = convert_loaded(args, teacher, t0, save=False)
            peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
            row.update(wall_s=report["wall_s"], stage_s=report["stage_s"], peak_mem_mb=mb(peak), weights_mb=mb(weights),
                       profile=report["profile"], backend=report["backend"], dtype=report["dtype"],
                       gdn_layers=len(report["gdn_layers"]), calib_tokens=report["calib_tokens"],
                       eval_tokens=report["eval_tokens"], teacher_params=report["teacher_params"],
                       hybrid_params=report["hybrid_params"], teacher_ppl=report["teacher_ppl"],
                       hybrid_ppl=report["hybrid_ppl"],
                       align_steps=args.phase2.steps, align_batch=args.phase2.batch_size)
            res[f"convert_{shape}_s"] = report["wall_s"]
        except torch.OutOfMemoryError as e:
            row.update(wall_s=None, error=f"OOM: {str(e).splitlines()[0]}")
            res[f"convert_{shape}_s"] = None
        detail[shape] = row
        print(f"[scale] {shape}: " + json.dumps(row), flush=True)
        save()
        del teacher, model
        free(device)


# ----------------------------------------------------------------------------- part: a real teacher's conversion


def part_convert(a, device, dtype, res, save):
    """`taylor-calibrate convert --teacher <spec>` in this process (the CLI's defaults: full profile on a GPU)."""
    t0 = time.perf_counter()
    teacher = load_teacher(a.teacher, device, dtype)
    args = ConvertArgs(teacher=a.teacher, device=device.type, dtype=str(dtype).replace("torch.", ""))
    if a.tiny:
        args.data = DataArgs(seq_len=64, calib_seqs=4, eval_seqs=4)
        args.phase2 = AlignArgs(steps=4, batch_size=2, log_every=2)
    report = convert_loaded(args, teacher, t0, save=False)
    row = {k: report[k] for k in ("wall_s", "stage_s", "profile", "backend", "dtype", "calib_tokens", "eval_tokens",
                                  "teacher_ppl", "hybrid_ppl")}
    row.update(teacher=a.teacher, ppl_ratio=ratio(report["hybrid_ppl"], report["teacher_ppl"]),
               align_steps=args.phase2.steps, gdn_layers=len(report["gdn_layers"]))
    res["convert"] = row
    res["align_smollm2_s"] = report["stage_s"]["phase2_s"]
    print("[convert] " + json.dumps(row), flush=True)
    save()
    del teacher
    free(device)


# ----------------------------------------------------------------------------- part: phase 2 alone, warm


def part_align(a, device, dtype, res, save):
    """Phase 2 of the default conversion on a SmolLM2-135M-shaped teacher (random weights: the time does not depend
    on them), in a process whose kernels are already compiled and tuned by a short untimed run, so
    `align_smollm2_warm_s` is the steady state beside the convert part's cold figure (a fresh process pays fla's
    compilation and autotuning inside phase 1 and 2). --align-profile adds a torch.profiler table of 20 steps."""
    model = build_teacher("smollm2", a.tiny, device, dtype)
    n = model.config.num_hidden_layers
    converted = gdn_layers(kept_layers("uniform", n, 4), n)
    profile = "quick" if a.tiny else "full"
    prof = load_profile(profile)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (prof["data"]["calib_seqs"], prof["data"]["seq_len"]), generator=gen)
    stats = collect_stats(model, ids, store_layers=converted, store_device=device)
    targets = attention_targets(model, stats, converted)
    inputs = {i: stats.inputs[i] for i in converted}
    backend = ops.resolve_backend("auto")
    steps = a.scale_align_steps or prof["phase2"]["steps"]

    def run(n_steps):
        mixers, _ = calibrated_mixers(model, stats, converted, "taylor", CalibArgs(), GDNConfig(), backend)
        args = fill_align(AlignArgs(steps=n_steps), profile)
        sync(device)
        t = time.perf_counter()
        report = align_layers(mixers, inputs, targets, args)
        sync(device)
        return time.perf_counter() - t, report

    run(10)  # compiles and tunes every kernel of the step
    wall, report = run(steps)
    row = {"shape": "smollm2-135m" + (" (tiny)" if a.tiny else ""), "gdn_layers": len(converted), "steps": steps,
           "tokens_per_step": report["tokens_per_step"], "wall_s": wall, "train_s": report["train_s"],
           "step_ms": 1e3 * report["train_s"] / steps, "layer_group": report["layer_group"],
           "rel_mse_before": report["mean_rel_mse_before"], "rel_mse_after": report["mean_rel_mse_after"],
           "backend": backend}
    res["align"] = row
    res["align_smollm2_warm_s"] = wall
    print("[align] " + json.dumps(row), flush=True)
    save()
    if a.align_profile:
        with profiled(device):
            run(20)
    del model, stats, targets, inputs
    free(device)


# ----------------------------------------------------------------------------- part: distillation throughput


def part_distill(a, device, dtype, res, save):
    """`distill.distill` on random tokens: throughput does not depend on the text or the init. With
    --distill-modes eager,compiled the same run again with `--train.compile true` (decoder layers and loss under
    torch.compile, the default on CUDA: list it last for the headline); with
    --distill-profile a torch.profiler table of two more steps (where the step's time goes)."""
    teacher = build_teacher("1p5b", a.tiny, device, dtype)
    cfg = teacher.config
    n = cfg.num_hidden_layers
    converted = gdn_layers(kept_layers("uniform", n, 4), n)
    B, T, steps = a.distill_batch, a.distill_seq, a.distill_steps
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, cfg.vocab_size, (B * steps, T), generator=gen)

    def run(compile_layers, n_steps=steps, desc="distill 1.5b"):
        student = convert_teacher(teacher, converted, GDNConfig()).float()  # fp32 masters, as run_distill loads them
        backend = student.set_backend("auto")
        args = TrainArgs(tokens=B * T * n_steps, batch_size=B, micro_batch_size=a.distill_micro, train="mixers",
                         eval_every=10 ** 9, save_every=10 ** 9, log_every=1, compile=compile_layers)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with tempfile.TemporaryDirectory() as tmp:
            report = distill(student, teacher, rows[:B * n_steps], rows[:1], args, tmp, resume=False,
                             eval_batch_size=1, desc=desc)
        row = {k: report[k] for k in ("steps", "tokens_per_step", "seq_len", "trained", "trained_params",
                                      "tokens_per_s", "flops_per_token", "mfu")}
        row.update(shape="qwen2.5-1.5b" + (" (tiny)" if a.tiny else ""), micro_batch=a.distill_micro,
                   gdn_backend=backend, gdn_layers=len(converted), timed_steps=n_steps - 1, compile=compile_layers,
                   peak_mem_mb=mb(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None)
        del student
        free(device)
        return row

    modes = a.distill_modes.split(",")
    if not modes or set(modes) - {"eager", "compiled"}:
        raise ValueError(f"--distill-modes {a.distill_modes!r}: a comma list of eager, compiled")
    for compiled in [m == "compiled" for m in modes]:
        row = run(compiled)
        row["command"] = res["command"]
        # one row per (compiled, micro-batch), kept across runs merged into one file; the last measured is the
        # headline (list the default configuration, compiled on CUDA, last)
        runs = [r for r in res.get("distill_runs", []) if (r["compile"], r["micro_batch"]) != (compiled, a.distill_micro)]
        res["distill_runs"] = runs + [row]
        res["distill"] = row
        res["distill_mfu_1p5b"], res["distill_tokens_per_s_1p5b"] = row["mfu"], row["tokens_per_s"]
        print(f"[distill {'compiled' if compiled else 'eager'}] " + json.dumps(row), flush=True)
        save()
    if a.distill_profile:
        with profiled(device):
            run(modes[-1] == "compiled", 3, "distill 1.5b (profiled)")
    del teacher
    free(device)


# ----------------------------------------------------------------------------- part c: inference


def step(model, tok, cache):
    out = model(input_ids=tok, cache=cache, use_cache=True)
    return out.logits[:, -1:].argmax(-1)


@torch.inference_mode()  # as `generate` runs: no autograd graph (the hybrid's parameters require grad)
def generation_row(model, B, ctx, steps, vocab, device):
    """Prefill B x ctx tokens (logits of the last token only, as generate does), then `steps` greedy 1-token steps
    through the model's own cache (transformers' DynamicCache from the config's layer_types). Each is timed after an
    untimed run of the same shape."""
    ids = torch.randint(0, vocab, (B, ctx), device=device)
    model(input_ids=ids, use_cache=True, logits_to_keep=1)  # warm-up at this shape (kernels may autotune per shape)
    free(device)
    out, prefill_s, prefill_peak = measure(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), device)
    cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
    del out
    per_seq = cache_bytes(cache) / B
    for _ in range(2):  # first steps at a new batch size may compile / autotune
        tok = step(model, tok, cache)

    def decode():
        nonlocal tok
        for _ in range(steps):
            tok = step(model, tok, cache)

    _, decode_s, decode_peak = measure(decode, device)
    del cache
    return {"prefill_s": prefill_s, "prefill_tok_s": B * ctx / prefill_s, "prefill_peak_mb": mb(prefill_peak),
            "decode_s": decode_s, "decode_ms_per_step": 1e3 * decode_s / steps, "decode_tok_s": B * steps / decode_s,
            "decode_peak_mb": mb(decode_peak), "cache_bytes_per_seq": per_seq}


def analytic_cache_bytes(cfg, n_attn: int, n_gdn: int, ctx: int, kv_bytes: int, gdn: GDNConfig) -> int:
    """Per sequence: K and V (Hkv x D per token) of every attention layer; per GDN layer an fp32 H x D x D state and,
    with short convs, the last K-1 inputs of the q, k and v convs (3 H D channels, model dtype)."""
    D, H = cfg.head_dim, cfg.num_attention_heads
    conv = 0 if gdn.short_conv == "none" else 3 * H * D * (gdn.conv_size - 1) * kv_bytes
    return n_attn * 2 * cfg.num_key_value_heads * D * ctx * kv_bytes + n_gdn * (H * D * D * 4 + conv)


def part_inference(a, device, dtype, res, save):
    teacher, hybrid, gdn_backend, converted = inference_models(a, device, dtype)
    cfg = teacher.config
    n = cfg.num_hidden_layers
    models = {"teacher": teacher, "hybrid": hybrid}
    detail = res.setdefault("inference", {})
    detail.update(shape="qwen2.5-1.5b" + (" (tiny)" if a.tiny else ""), kept_layers=n - len(converted),
                  gdn_layers=len(converted), gdn_backend=gdn_backend, teacher_attention="sdpa",
                  decode_steps=a.decode_steps, rows={})
    kv_bytes = torch.empty((), dtype=dtype).element_size()
    for B in ints(a.batches):
        for ctx in ints(a.contexts):
            rows = {}
            for name, model in models.items():
                try:
                    with counting_gdn_kernels() as counts:
                        rows[name] = generation_row(model, B, ctx, a.decode_steps, cfg.vocab_size, device)
                    if name == "hybrid":
                        rows[name]["gdn_kernel_calls"] = dict(counts)
                except torch.OutOfMemoryError as e:
                    rows[name] = {"error": f"OOM: {str(e).splitlines()[0]}"}
                free(device)
            rows["teacher_cache_bytes_analytic"] = analytic_cache_bytes(cfg, n, 0, ctx, kv_bytes, GDNConfig())
            rows["hybrid_cache_bytes_analytic"] = analytic_cache_bytes(cfg, n - len(converted), len(converted), ctx,
                                                                       kv_bytes, GDNConfig())
            t, h = rows["teacher"], rows["hybrid"]
            rows["prefill_speedup"] = ratio(t.get("prefill_s"), h.get("prefill_s"))
            rows["decode_speedup"] = ratio(t.get("decode_s"), h.get("decode_s"))
            rows["cache_bytes_ratio"] = ratio(h.get("cache_bytes_per_seq"), t.get("cache_bytes_per_seq"))
            detail["rows"][f"{ctx}x{B}"] = rows
            for key in ("prefill_speedup", "decode_speedup"):
                res.setdefault(key, {}).setdefault(str(ctx), {})[str(B)] = rows[key]
            if rows["cache_bytes_ratio"] is not None and (B == 1 or str(ctx) not in res.get("cache_bytes_ratio", {})):
                res.setdefault("cache_bytes_ratio", {})[str(ctx)] = rows["cache_bytes_ratio"]
            print(f"[inference] ctx={ctx} batch={B}: " + json.dumps(rows), flush=True)
            save()
    del models, teacher, hybrid
    free(device)


# ----------------------------------------------------------------------------- part: decode, graph-captured


def inference_models(a, device, dtype):
    """The 1.5B-shape teacher and its uniform hybrid (keep_every 4, copy-only mixers: speed does not depend on the
    init), GDN backend resolved once."""
    teacher = build_teacher("1p5b", a.tiny, device, dtype)
    n = teacher.config.num_hidden_layers
    converted = gdn_layers(kept_layers("uniform", n, 4), n)
    hybrid = convert_teacher(teacher, converted, GDNConfig())
    return teacher, hybrid, hybrid.set_backend("auto"), converted


@torch.inference_mode()
def prefilled_static_cache(model, ids, max_len: int, chunk: int):
    """A transformers StaticCache (fixed-address KV buffers, recurrent / conv states) holding the prefill of `ids`
    (B, T), prefilled `chunk` sequences at a time through the model's DynamicCache and copied in: a big batch's
    one-shot prefill would not fit beside the static buffers. Returns (cache, each sequence's next greedy token)."""
    from transformers import StaticCache

    B, T = ids.shape
    static = StaticCache(config=model.config, max_cache_len=max_len)
    nxt = []
    for b0 in range(0, B, chunk):
        rows = slice(b0, b0 + chunk)
        out = model(input_ids=ids[rows], use_cache=True, logits_to_keep=1)
        nxt.append(out.logits[:, -1:].argmax(-1))
        for src, dst in zip(out.cache.layers, static.layers):
            if hasattr(dst, "recurrent_states"):  # a GDN layer: recurrent (and conv) states, no KV
                for i, s in src.recurrent_states.items():
                    if s is None:
                        continue
                    if not dst.is_recurrent_states_initialized[i]:
                        dst.lazy_initialization(recurrent_states=s.new_zeros(B, *s.shape[1:]), state_idx=i)
                    dst.recurrent_states[i][rows].copy_(s)
                for i, s in src.conv_states.items():
                    if s is None:
                        continue
                    if not dst.is_conv_states_initialized[i]:
                        dst.lazy_initialization(conv_states=s.new_zeros(B, *s.shape[1:]), state_idx=i)
                    dst.conv_states[i][rows].copy_(s)
                    dst.has_previous_state[i] = True
            else:
                if not dst.is_initialized:
                    dst.lazy_initialization(src.keys.new_empty(B, *src.keys.shape[1:]),
                                            src.values.new_empty(B, *src.values.shape[1:]))
                dst.keys[rows, :, :T].copy_(src.keys)
                dst.values[rows, :, :T].copy_(src.values)
                dst.cumulative_length.fill_(T)
        del out
    return static, torch.cat(nxt)


@dataclasses.dataclass
class StaticDecoder:
    step: object  # () -> None: one greedy token for every sequence (a CUDA graph's replay on a GPU)
    tok: torch.Tensor  # (B, 1) the next input token; each step overwrites it with its argmax
    pos: torch.Tensor  # (1,) the next position
    logits: torch.Tensor  # (B, V) the last step's logits


def static_decoder(model, cache, tok, ctx: int, device, graph: bool) -> StaticDecoder:
    """Greedy decoding through a StaticCache as a function of fixed-address buffers only (token, position, cache),
    so that on a GPU one step is captured in a CUDA graph and replayed per token: no Python, no kernel launches, no
    allocator in the timed loop, for teacher and hybrid alike. The mask is the explicit 4-D one (keys up to the
    position), which transformers hands to SDPA as it is. Capturing runs GRAPH_WARMUP untimed steps first."""
    B = tok.shape[0]
    max_len = static_max_len(cache)
    keys = torch.arange(max_len, device=device)
    dec = StaticDecoder(step=None, tok=tok.clone(), pos=torch.full((1,), ctx, device=device, dtype=torch.long),
                        logits=None)

    def step():
        mask = (keys <= dec.pos).view(1, 1, 1, max_len).expand(B, 1, 1, max_len)
        out = model(input_ids=dec.tok, attention_mask=mask, position_ids=dec.pos.view(1, 1).expand(B, 1),
                    cache=cache, use_cache=True)
        last = out.logits[:, -1]
        if dec.logits is None:
            dec.logits = torch.empty_like(last)
        dec.logits.copy_(last)
        dec.tok.copy_(last.argmax(-1, keepdim=True))
        dec.pos.add_(1)

    dec.step = step
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: autotuning, lazy inits, allocator pools
            for _ in range(GRAPH_WARMUP):
                step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        dec.step = g.replay
    return dec


GRAPH_WARMUP = 3


def static_max_len(cache) -> int | None:
    """The KV buffer length of a StaticCache (None when it has no attention layer)."""
    return next((layer.max_cache_len for layer in cache.layers if hasattr(layer, "max_cache_len")), None)


def static_len(ctx: int, steps: int) -> int:
    """Static KV length for ctx + steps (+ the capture's warm-up) tokens, a multiple of 64 (SDPA mask alignment)."""
    return -(-(ctx + steps + GRAPH_WARMUP + 1) // 64) * 64


def step_bytes(model, cache, ctx: int) -> int:
    """HBM bytes one decode step at context `ctx` must move at least: every weight once (a tied embedding once, as
    lm_head), the KV of the first `ctx` positions, and each recurrent / conv state read and written. The decode
    roofline is this / bandwidth."""
    weights = sum(tensor_bytes(p) for p in {id(p): p for p in model.parameters()}.values())
    kv = kv_bytes(cache)
    kv_used = kv * ctx // static_max_len(cache) if kv else 0
    return weights + kv_used + 2 * (cache_bytes(cache) - kv)


@torch.inference_mode()
def graph_decode_row(model, B, ctx, steps, vocab, device, chunk):
    ids = torch.randint(0, vocab, (B, ctx), device=device)
    cache, tok = prefilled_static_cache(model, ids, static_len(ctx, steps), chunk)
    del ids
    moved = step_bytes(model, cache, ctx)
    dec = static_decoder(model, cache, tok, ctx, device, graph=device.type == "cuda")

    def decode():
        for _ in range(steps):
            dec.step()

    _, decode_s, peak = measure(decode, device)
    del cache, dec
    return {"decode_s": decode_s, "decode_ms_per_step": 1e3 * decode_s / steps, "decode_tok_s": B * steps / decode_s,
            "decode_peak_mb": mb(peak), "min_bytes_per_step": moved, "achieved_gb_s": moved * steps / decode_s / 1e9}


@torch.inference_mode()
def static_decode_error(model, ctx, steps, vocab, device) -> dict:
    """Max |logit difference| / max |logit| between the model's own eager decode (DynamicCache, no mask) and the static
    decoder fed the same tokens, without and (on a GPU) with the CUDA graph: a replay that read stale buffers, or a
    wrong mask / position, shows up here. Batch 2, `steps` tokens after a ctx-token prompt."""
    ids = torch.randint(0, vocab, (2, ctx), device=device)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    dyn, tok = out.cache, out.logits[:, -1:].argmax(-1)
    fed, ref = [], []
    for _ in range(steps):
        fed.append(tok)
        logits = model(input_ids=tok, cache=dyn, use_cache=True).logits[:, -1]
        ref.append(logits)
        tok = logits.argmax(-1, keepdim=True)
    ref = torch.stack(ref)
    errors = {}
    for graph in (False, True) if device.type == "cuda" else (False,):
        cache, tok0 = prefilled_static_cache(model, ids, static_len(ctx, steps), 2)
        saved = {i: [(states, k, v.clone()) for states in (layer.recurrent_states, layer.conv_states)
                     for k, v in states.items() if v is not None]
                 for i, layer in enumerate(cache.layers) if hasattr(layer, "recurrent_states")}
        dec = static_decoder(model, cache, tok0, ctx, device, graph)
        for i, layer in enumerate(cache.layers):  # rewind what the capture's warm-up decoded (later KV is masked)
            if i in saved:  # recurrent and short-conv states
                for states, k, v in saved[i]:
                    states[k].copy_(v)
            else:
                layer.cumulative_length.fill_(ctx)
        dec.pos.fill_(ctx)
        got = []
        for t in fed:
            dec.tok.copy_(t)
            dec.step()
            got.append(dec.logits.clone())
        errors["graph" if graph else "static"] = ((torch.stack(got) - ref).abs().max() / ref.abs().max()).item()
        del cache, dec
    return errors


def part_decode(a, device, dtype, res, save):
    """Decode with both models graph-captured over static caches (the launch overhead that dominates eager decoding
    at batch 8 gone for both), at the context x batch grid of --decode-grid, beside the bandwidth roofline."""
    teacher, hybrid, gdn_backend, converted = inference_models(a, device, dtype)
    cfg = teacher.config
    models = {"teacher": teacher, "hybrid": hybrid}
    key = "decode" if a.decode_sdpa == "auto" else f"decode_{a.decode_sdpa}"
    detail = res.setdefault(key, {})
    detail.update(shape="qwen2.5-1.5b" + (" (tiny)" if a.tiny else ""), kept_layers=cfg.num_hidden_layers - len(converted),
                  gdn_layers=len(converted), gdn_backend=gdn_backend, teacher_attention="sdpa (explicit mask)",
                  graph=device.type == "cuda", steps=a.graph_steps, prefill_chunk=a.prefill_chunk,
                  sdpa_backend=a.decode_sdpa, rows={})
    with sdpa_restricted(a.decode_sdpa):
        decode_rows(a, device, res, save, models, detail, key)
    del models, teacher, hybrid
    free(device)


def sdpa_restricted(kernel: str):
    """Every SDPA call in the block (CUDA graph captures included) on that one kernel; "auto": PyTorch's choice."""
    if kernel == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, kernel.upper())])


def decode_rows(a, device, res, save, models, detail, key):
    """The logits check, then one row per --decode-grid cell into `detail` (saved after each)."""
    vocab = models["teacher"].config.vocab_size
    detail["logits_rel_err"] = {}
    for name, m in models.items():
        try:
            detail["logits_rel_err"][name] = static_decode_error(m, 64 if a.tiny else 1024, 8, vocab, device)
        except RuntimeError as e:  # e.g. a restricted SDPA kernel that does not take this mask
            detail["logits_rel_err"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    print(f"[decode] static / graph decode vs eager: {json.dumps(detail['logits_rel_err'])}", flush=True)
    save()
    for cell in a.decode_grid.split(","):
        ctx, B = (int(x) for x in cell.split("x"))
        rows = {}
        for name, model in models.items():
            try:
                rows[name] = graph_decode_row(model, B, ctx, a.graph_steps, vocab, device, a.prefill_chunk)
            except RuntimeError as e:  # out of memory, or a restricted SDPA kernel that does not take this mask
                rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            free(device)
        t, h = rows["teacher"], rows["hybrid"]
        rows["decode_speedup"] = ratio(t.get("decode_s"), h.get("decode_s"))
        rows["roofline_speedup"] = ratio(t.get("min_bytes_per_step"), h.get("min_bytes_per_step"))
        detail["rows"][cell] = rows
        if key == "decode":
            res.setdefault("decode_speedup_graph", {}).setdefault(str(ctx), {})[str(B)] = rows["decode_speedup"]
        print(f"[decode] {cell}: " + json.dumps(rows), flush=True)
        save()


# ----------------------------------------------------------------------------- report


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def row_errors(teacher_row: dict, hybrid_row: dict) -> str:
    """A table row's trailing note: the error a model's measurement ended in (out of memory, ...), if any."""
    return "".join(f" {n}: {x['error']}" for n, x in (("teacher", teacher_row), ("hybrid", hybrid_row)) if "error" in x)


def markdown(res: dict) -> str:
    env = res.get("env", {})
    lines = [f"# taylor-calibrate performance ({env.get('device', '?')})", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}, fla {env.get('fla')}, transformers "
             f"{env.get('transformers')}; random weights.", ""]
    cv = res.get("convert")
    if cv:
        lines += [f"## Default conversion of {cv['teacher']} ({cv['profile']} profile, {cv['gdn_layers']} GDN layers, "
                  f"{cv['align_steps']} alignment steps)", "",
                  "| run | total s | load (incl. imports, compiles) | stats | phase 1 | phase 2 | teacher PPL | hybrid PPL | "
                  "ratio |", "|---|---|---|---|---|---|---|---|---|"]
        # an earlier run kept beside the latest (e.g. the first on a fresh machine, which compiles every kernel)
        for r in [cv] + res.get("convert_earlier", []):
            s = r["stage_s"]
            lines.append(f"| {r.get('run', 'latest')} | {fmt(r['wall_s'], '.1f')} | {fmt(s.get('load_teacher_s'), '.1f')} | "
                         f"{fmt(s.get('stats_s'), '.1f')} | {fmt(s.get('phase1_s'), '.1f')} | "
                         f"{fmt(s.get('phase2_s'), '.1f')} | {fmt(r['teacher_ppl'], '.3f')} | "
                         f"{fmt(r['hybrid_ppl'], '.3f')} | {fmt(r['ppl_ratio'])} |")
        lines.append("")
    al = res.get("align")
    if al:
        lines += [f"## Phase 2 alone, warm ({al['shape']}, {al['gdn_layers']} GDN layers in groups of "
                  f"{al['layer_group']}, {al['steps']} steps x {al['tokens_per_step']} tokens, backend "
                  f"`{al['backend']}`)", "", "| wall s | training s | ms / step | rel-MSE before -> after |",
                  "|---|---|---|---|", f"| {fmt(al['wall_s'], '.1f')} | {fmt(al['train_s'], '.1f')} | "
                  f"{fmt(al['step_ms'], '.1f')} | {al['rel_mse_before']:.3f} -> {al['rel_mse_after']:.3f} |", ""]
    st = res.get("stats")
    if st:
        lines += [f"## Statistics pass ({st['shape']}, batch 1, stats backend `{st['stats_backend']}`, "
                  f"{st['stored_layers']} layers stored as convert does)", "",
                  "| T | forward s (last logits) | forward s (all logits) | stats s | stats / forward | "
                  "stats / forward (all logits) | torch-path stats / forward | forward peak MB | stats peak MB | "
                  "of which stored inputs+outputs MB |", "|---|---|---|---|---|---|---|---|---|---|"]
        for T, r in st["rows"].items():
            lines.append(f"| {T} | {fmt(r['forward_s'], '.3f')} | {fmt(r.get('forward_all_logits_s'), '.3f')} | "
                         f"{fmt(r['stats_s'], '.3f')} | {fmt(r['stats_vs_forward'])} | "
                         f"{fmt(r.get('stats_vs_forward_all_logits'))} | {fmt(r.get('stats_torch_vs_forward'))} | "
                         f"{fmt(r['forward_peak_mb'], '.0f')} | {fmt(r['stats_peak_mb'], '.0f')} | "
                         f"{fmt(r['stored_mb'], '.0f')} |")
        lines += ["", "Peak MB: max_memory_allocated above the weights. The ratio's forward is the teacher's pass without "
                  "statistics, keeping the last position's logits as the statistics pass does; the statistics pass "
                  "also holds the stored inputs and head outputs that phase 2 trains on (linear in T by design)."]
        lines.append("")
    sc = res.get("scale")
    if sc:
        lines += ["## Default conversion (per stage, seconds)", "",
                  "| shape | total s | load | data | teacher eval | stats | phase 1 | phase 2 | hybrid eval | peak GB |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for shape, r in sc.items():
            s = r.get("stage_s") or {}
            cells = [fmt(s.get(k), ".1f") for k in ("load_teacher_s", "data_s", "teacher_eval_s", "stats_s",
                                                    "phase1_s", "phase2_s", "hybrid_eval_s")]
            peak = None if r.get("peak_mem_mb") is None else r["peak_mem_mb"] / 1024
            lines.append(f"| {shape} | {fmt(r.get('wall_s'), '.1f')} | " + " | ".join(cells) + f" | {fmt(peak, '.1f')} |"
                         + (f" {r['error']}" if r.get("error") else ""))
        lines.append("")
    di = res.get("distill")
    if di:
        lines += [f"## Distillation ({di['shape']}, {di['gdn_layers']} GDN layers, trains {di['trained']}, "
                  f"{di['tokens_per_step']:,} tokens per step of {di['seq_len']}-token rows)", "",
                  "| decoder layers + loss | micro-batch | tokens/s | FLOP/token | MFU | peak GB |",
                  "|---|---|---|---|---|---|"]
        for r in res.get("distill_runs", [di]):
            name = "torch.compile (`--train.compile`, CUDA default)" if r.get("compile") else "eager"
            lines.append(f"| {name} | {r['micro_batch']} | {fmt(r['tokens_per_s'], ',.0f')} | "
                         f"{fmt(r['flops_per_token'], '.3g')} | {'-' if r['mfu'] is None else format(r['mfu'], '.1%')} | "
                         f"{fmt(None if r['peak_mem_mb'] is None else r['peak_mem_mb'] / 1024, '.1f')} |")
        lines.append("")
    inf = res.get("inference")
    if inf:
        lines += [f"## Inference ({inf['shape']}: {inf['kept_layers']} attention + {inf['gdn_layers']} GDN layers, "
                  f"GDN backend `{inf['gdn_backend']}`, {inf['decode_steps']} decode steps)", "",
                  "| context x batch | prefill tok/s teacher / hybrid | speedup | decode tok/s teacher / hybrid | speedup "
                  "| cache MB/seq teacher / hybrid | ratio |", "|---|---|---|---|---|---|---|"]
        for key, r in inf["rows"].items():
            t, h = r["teacher"], r["hybrid"]
            lines.append(
                f"| {key} | {fmt(t.get('prefill_tok_s'), ',.0f')} / {fmt(h.get('prefill_tok_s'), ',.0f')} | "
                f"{fmt(r['prefill_speedup'])} | {fmt(t.get('decode_tok_s'), ',.1f')} / {fmt(h.get('decode_tok_s'), ',.1f')}"
                f" | {fmt(r['decode_speedup'])} | {fmt(mb(t.get('cache_bytes_per_seq')), ',.1f')} / "
                f"{fmt(mb(h.get('cache_bytes_per_seq')), ',.1f')} | {fmt(r['cache_bytes_ratio'], '.3f')} |"
                + row_errors(t, h))
        lines.append("")
    for key in sorted(k for k in res if k.startswith("decode") and isinstance(res[k], dict) and "rows" in res[k]):
        de = res[key]
        err = de.get("logits_rel_err", {})
        lines += [f"## Decode, graph-captured ({de['shape']}: {de['kept_layers']} attention + {de['gdn_layers']} GDN "
                  f"layers, GDN backend `{de['gdn_backend']}`, SDPA kernel `{de.get('sdpa_backend', 'auto')}`, "
                  f"StaticCache, one step per CUDA graph replay: {de['graph']}, {de['steps']} steps)", "",
                  "Logits vs the eager DynamicCache decode (max abs diff / max abs logit): "
                  + "; ".join(f"{n} {', '.join(f'{k} {v:.1e}' if isinstance(v, float) else f'{k} {v}' for k, v in e.items())}"
                              for n, e in err.items()), "",
                  "| context x batch | ms/step teacher / hybrid | decode tok/s teacher / hybrid | speedup | "
                  "roofline speedup (min bytes moved) | achieved GB/s teacher / hybrid |", "|---|---|---|---|---|---|"]
        for cell, r in de["rows"].items():
            t, h = r["teacher"], r["hybrid"]
            lines.append(
                f"| {cell} | {fmt(t.get('decode_ms_per_step'))} / {fmt(h.get('decode_ms_per_step'))} | "
                f"{fmt(t.get('decode_tok_s'), ',.0f')} / {fmt(h.get('decode_tok_s'), ',.0f')} | "
                f"{fmt(r['decode_speedup'])} | {fmt(r['roofline_speedup'])} | {fmt(t.get('achieved_gb_s'), ',.0f')} / "
                f"{fmt(h.get('achieved_gb_s'), ',.0f')} |"
                + row_errors(t, h))
        lines += ["", "Roofline speedup: the teacher's minimum bytes per step (weights + KV at the context) over the "
                  "hybrid's (weights + KV of the kept layers + GDN states read and written): the ratio a "
                  "bandwidth-bound decoder approaches.", ""]
    commands = res.get("commands") or {}
    if len(set(commands.values())) > 1:  # parts merged from separate runs
        lines += ["Commands:", ""] + [f"- {part}: `{cmd}`" for part, cmd in commands.items()] + [""]
    else:
        lines += [f"Command: `{res.get('command')}`", ""]
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    import transformers

    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001
            return None

    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "triton": version("triton"), "fla": version("fla"), "transformers": transformers.__version__}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and lengths (CPU is fine): checks the script")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None, help="JSON path (a .md twin is written beside it); merged into if present")
    ap.add_argument("--tokenizer", default="embedded", choices=("embedded", "bytes"),
                    help="scale part: the embedded teacher's tokenizer (falls back to bytes if not installed)")
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="convert part: the teacher (as `convert --teacher`)")
    ap.add_argument("--repeats", type=int, default=2, help="stats part: best of N timings at the ratio lengths")
    ap.add_argument("--distill-modes", default="eager",
                    help="distill part: comma list of eager, compiled (--train.compile true, the CUDA default; the "
                         "last one listed gives the headline figure)")
    ap.add_argument("--decode-sdpa", default="auto", choices=("auto", "efficient_attention", "cudnn_attention", "math"),
                    help="decode part: restrict SDPA to one kernel (auto: PyTorch's choice for a masked single query)")
    ap.add_argument("--align-profile", action="store_true", help="align part: print a torch.profiler table")
    ap.add_argument("--distill-profile", action="store_true", help="distill part: print a torch.profiler table")
    ap.add_argument("--scale-align-steps", type=int, default=None,
                    help="scale part: alignment steps per layer (default: the profile's, 300 on a GPU)")
    for key, (full, _) in DEFAULTS.items():
        ap.add_argument("--" + key.replace("_", "-"), default=None, type=type(full), help=f"default {full}")
    a = ap.parse_args(argv)
    for key, (full, tiny) in DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, tiny if a.tiny else full)
    parts = [p for p in a.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {PARTS}")
    device = resolve_device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not a.tiny and device.type != "cuda":
        print("[perf] warning: full shapes on a CPU will take very long; use --tiny", flush=True)

    res = {}
    if a.out and Path(a.out).exists():
        res = json.loads(Path(a.out).read_text())
    res["command"] = "python benchmarks/perf.py " + " ".join(sys.argv[1:] if argv is None else argv)
    res["env"] = environment(device)
    res.setdefault("wall_s", {})

    def save():
        if not a.out:
            return
        write_json(a.out, res)
        Path(a.out).with_suffix(".md").write_text(markdown(res))

    tokenizer = None
    for part in parts:
        t = time.perf_counter()
        print(f"[perf] part {part} ...", flush=True)
        try:
            if part == "convert":
                part_convert(a, device, dtype, res, save)
            elif part == "distill":
                part_distill(a, device, dtype, res, save)
            elif part == "stats":
                part_stats(a, device, dtype, res, save)
            elif part == "align":
                part_align(a, device, dtype, res, save)
            elif part == "scale":
                if tokenizer is None:
                    tokenizer, tokenizer_name = load_tokenizer(a.tokenizer)
                part_scale(a, device, dtype, res, save, tokenizer, tokenizer_name)
            elif part == "decode":
                part_decode(a, device, dtype, res, save)
            else:
                part_inference(a, device, dtype, res, save)
        except Exception as e:  # noqa: BLE001  (keep the other parts' results; the error is in the JSON)
            traceback.print_exc()
            res.setdefault("errors", {})[part] = f"{type(e).__name__}: {e}"
        res["wall_s"][part] = time.perf_counter() - t
        res.setdefault("commands", {})[part] = res["command"]  # parts may come from separate runs into one file
        save()
        free(device)
    detail_keys = ("stats", "scale", "inference", "convert", "convert_earlier", "distill", "distill_runs")
    print(json.dumps({k: v for k, v in res.items() if k not in detail_keys and not k.startswith("decode")}, indent=2))
    print("\n" + markdown(res))
    return res


if __name__ == "__main__":
    main()
