"""What the performance benchmarks (benchmarks/perf_*.py) share: random-weight teachers of real shapes, timing and
memory measurement, cache sizes, and the command-line scaffold that runs one benchmark and writes its JSON (and the
markdown rendered from it).

Each benchmark is one script: perf_convert (a real teacher's default conversion), perf_align (phase 2 alone, warm),
perf_stats (the statistics pass against a plain forward), perf_scale (the default conversion at 1.5B / 8B shapes),
perf_distill (distillation throughput and MFU), perf_inference (prefill / decode / cache against the teacher),
perf_decode (graph-captured decode beside the bandwidth roofline); generate_speed (a real teacher's and its hybrid's
generate(), eager and compiled) renders here too. `--tiny` runs any of them on tiny shapes (CPU is fine) to check it
end to end.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from taylor_calibrate import ops
from taylor_calibrate.config import GDNConfig
from taylor_calibrate.results import environment, record
from taylor_calibrate.model.hybrid import convert_teacher
from taylor_calibrate.policy import gdn_layers, kept_layers
from taylor_calibrate.teacher import embedded_teacher_path, resolve_device

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
MB = 2 ** 20


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
    saved = dict(ops.GDN_KERNELS)

    def wrap(key, fn):
        def counted(*args, **kwargs):
            counts["/".join(key)] += 1
            return fn(*args, **kwargs)
        return counted

    ops.GDN_KERNELS.update({key: wrap(key, fn) for key, fn in saved.items()})
    try:
        yield counts
    finally:
        ops.GDN_KERNELS.update(saved)


@contextlib.contextmanager
def profiled(device: torch.device, rows: int = 30):
    """torch.profiler around the block, then its tables (`print_profile`)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, record_shapes=device.type == "cuda") as prof:
        yield
    print_profile(prof, device, rows)


def print_profile(prof, device: torch.device, rows: int = 30) -> None:
    """The top ops by CPU time and, on a GPU, by CUDA time (total, then self: the kernels themselves, which is where
    a step's GPU time goes; then self CUDA time by input shapes, which names the tensors behind a generic op such as
    a copy)."""
    for sort in ("cpu_time_total",) + (("cuda_time_total", "self_cuda_time_total") if device.type == "cuda" else ()):
        print(prof.key_averages().table(sort_by=sort, row_limit=rows), flush=True)
    if device.type == "cuda":
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=rows),
              flush=True)


def top_ops(prof, per: int, rows: int = 40, by_shape: bool = False) -> list[dict]:
    """The ops with the most self device time (self CPU time where no device was traced), per `per` steps: name,
    ms, calls (and input shapes with `by_shape`), for a results file."""
    def self_ms(e):
        return (e.self_device_time_total or e.self_cpu_time_total) / 1e3

    avgs = [e for e in prof.key_averages(group_by_input_shape=by_shape) if not e.key.startswith("ProfilerStep")]
    avgs = sorted(avgs, key=self_ms, reverse=True)[:rows]
    return [{"op": e.key, "ms": self_ms(e) / per, "calls": e.count / per,
             **({"shapes": str(e.input_shapes)[:200]} if by_shape else {})} for e in avgs]


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
CPU_CATS = ("cpu_op", "user_annotation")
GENERIC = ("aten::", "cuda", "cu", "Memcpy", "Memset", "TorchDynamo", "Torch-Compiled", "ProfilerStep")


def trace_kernels(trace: dict, rows: int = 40) -> dict:
    """What a step's GPU time is made of, from a torch.profiler chrome trace (`export_chrome_trace`'s JSON): wall and
    GPU-busy ms per profiled step (busy = the union of kernel intervals, so idle gaps show as wall - busy), and the
    kernels with the most time per step, each with the op scope it was launched from (the innermost enclosing CPU
    event that is not a generic aten / runtime call: a compiled graph, an autograd function, a record_function).
    Unlike `top_ops`, nothing is counted twice: kernels do not nest."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in ev if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("cat") in CPU_CATS]
    gpu = sorted((e for e in ev if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    n = max(len(steps), 1)
    busy, end = 0.0, float("-inf")
    for e in gpu:  # union of intervals
        s, t = e["ts"], e["ts"] + e["dur"]
        busy += max(0.0, t - max(s, end))
        end = max(end, t)
    # scope of each launch: a sweep over each CPU thread's properly nested events
    launches = {e["args"]["correlation"]: e for e in ev
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    scope_of = {}
    by_tid = collections.defaultdict(list)
    for e in ev:
        if e.get("cat") in CPU_CATS + LAUNCH_CATS:
            by_tid[(e.get("pid"), e.get("tid"))].append(e)
    for items in by_tid.values():
        items.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in items:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {}):
                named = [s["name"] for s in stack if not str(s["name"]).startswith(GENERIC)]
                scope_of[e["args"]["correlation"]] = named[-1] if named else (stack[-1]["name"] if stack else "")
            else:
                stack.append(e)
    table = collections.defaultdict(lambda: [0.0, 0, collections.Counter()])
    for e in gpu:
        t = table[e["name"]]
        t[0] += e["dur"]
        t[1] += 1
        corr = e.get("args", {}).get("correlation")
        t[2][scope_of.get(corr, "") if corr in launches else ""] += e["dur"]
    top = sorted(table.items(), key=lambda kv: -kv[1][0])[:rows]
    wall = sum(e["dur"] for e in steps) / n / 1e3 if steps else None
    return {"steps": len(steps), "wall_ms": wall, "gpu_busy_ms": busy / n / 1e3,
            "gpu_kernel_ms": sum(e["dur"] for e in gpu) / n / 1e3,
            "kernels": [{"kernel": k[:160], "ms": v[0] / n / 1e3, "calls": v[1] / n,
                         "scope": v[2].most_common(1)[0][0][:160] if v[2] else ""} for k, v in top]}


def kernels_table(summary: dict, rows: int = 25) -> str:
    """`trace_kernels`' result as a markdown table (ms and calls per step)."""
    head = (f"GPU busy {summary['gpu_busy_ms']:.1f} ms of {fmt(summary['wall_ms'], '.1f')} ms wall per step "
            f"({summary['steps']} profiled steps)\n\n| kernel | ms/step | calls/step | launched from |\n|---|---|---|---|")
    return "\n".join([head] + [f"| {k['kernel'][:90]} | {k['ms']:.2f} | {k['calls']:.0f} | {k['scope'][:70]} |"
                               for k in summary["kernels"][:rows]])


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def inference_models(a, device, dtype):
    """The 1.5B-shape teacher and its uniform hybrid (keep_every 4, copy-only mixers: speed does not depend on the
    init), GDN backend resolved once."""
    teacher = build_teacher("1p5b", a.tiny, device, dtype)
    n = teacher.config.num_hidden_layers
    converted = gdn_layers(kept_layers("uniform", n, 4), n)
    hybrid = convert_teacher(teacher, converted, GDNConfig())
    return teacher, hybrid, hybrid.set_backend("auto"), converted


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def pair(teacher_row: dict, hybrid_row: dict, key: str, spec: str = ".2f", f=None) -> str:
    """A table cell "teacher / hybrid" of one measured value (`f` applied first, e.g. bytes -> MB)."""
    t, h = teacher_row.get(key), hybrid_row.get(key)
    return f"{fmt(t if f is None else f(t), spec)} / {fmt(h if f is None else f(h), spec)}"


def row_errors(teacher_row: dict, hybrid_row: dict) -> str:
    """A table row's trailing note: the error a model's measurement ended in (out of memory, ...), if any."""
    return "".join(f" {n}: {x['error']}" for n, x in (("teacher", teacher_row), ("hybrid", hybrid_row)) if "error" in x)


def markdown(res: dict) -> list[str]:
    """The markdown rendering of a benchmark's JSON: one section per part it holds."""
    lines = []
    cv = res.get("convert")
    if cv:
        lines += [f"## Default conversion of {cv['teacher']} ({cv['profile']} profile, {cv['gdn_layers']} GDN layers, "
                  f"{cv['align_steps']} alignment steps)", "",
                  "| total s | backend check (fla compiles) | load (incl. imports) | stats | phase 1 | phase 2 | "
                  "teacher PPL | hybrid PPL | ratio |", "|---|---|---|---|---|---|---|---|---|"]
        s = cv["stage_s"]
        lines += [f"| {fmt(cv['wall_s'], '.1f')} | {fmt(s.get('backend_check_s'), '.1f')} | "
                  f"{fmt(s.get('load_teacher_s'), '.1f')} | {fmt(s.get('stats_s'), '.1f')} | "
                  f"{fmt(s.get('phase1_s'), '.1f')} | {fmt(s.get('phase2_s'), '.1f')} | {fmt(cv['teacher_ppl'], '.3f')} | "
                  f"{fmt(cv['hybrid_ppl'], '.3f')} | {fmt(cv['ppl_ratio'])} |", ""]
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
            lines.append(f"| {key} | {pair(t, h, 'prefill_tok_s', ',.0f')} | {fmt(r['prefill_speedup'])} | "
                         f"{pair(t, h, 'decode_tok_s', ',.1f')} | {fmt(r['decode_speedup'])} | "
                         f"{pair(t, h, 'cache_bytes_per_seq', ',.1f', mb)} | {fmt(r['cache_bytes_ratio'], '.3f')} |"
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
            lines.append(f"| {cell} | {pair(t, h, 'decode_ms_per_step')} | {pair(t, h, 'decode_tok_s', ',.0f')} | "
                         f"{fmt(r['decode_speedup'])} | {fmt(r['roofline_speedup'])} | "
                         f"{pair(t, h, 'achieved_gb_s', ',.0f')} |" + row_errors(t, h))
        lines += ["", "Roofline speedup: the teacher's minimum bytes per step (weights + KV at the context) over the "
                  "hybrid's (weights + KV of the kept layers + GDN states read and written): the ratio a "
                  "bandwidth-bound decoder approaches.", ""]
    ge = res.get("generate")
    if ge:
        comp = ", ".join(f"{k} {v}" for k, v in ge["compile"].items() if v is not None)
        lines += [f"## generate() ({ge['teacher']} and the hybrid {ge['hybrid']}: {ge['gdn_layers']} of {ge['layers']} "
                  f"layers GDN, GDN backend `{ge['gdn_backend']}`, {ge['dtype']}, greedy, {ge['new_tokens']} new "
                  f"tokens; eager: DynamicCache; compiled: StaticCache + generate's torch.compile ({comp}))", "",
                  "| context x batch | decode tok/s eager teacher / hybrid | hybrid / teacher | decode tok/s compiled "
                  "teacher / hybrid | hybrid / teacher | compiled / eager teacher / hybrid | compiled tokens = eager "
                  "teacher / hybrid |", "|---|---|---|---|---|---|---|"]
        for cell, r in ge["rows"].items():
            t, h = r["teacher"], r["hybrid"]
            same = " / ".join(str(x.get("compiled_tokens_equal", "-")) for x in (t, h))
            lines.append(f"| {cell} | {pair(t['eager'], h['eager'], 'decode_tok_s', ',.0f')} | "
                         f"{fmt(r['hybrid_over_teacher']['eager'])} | "
                         f"{pair(t['compiled'], h['compiled'], 'decode_tok_s', ',.0f')} | "
                         f"{fmt(r['hybrid_over_teacher']['compiled'])} | "
                         f"{fmt(t['compiled_over_eager'])} / {fmt(h['compiled_over_eager'])} | {same} |"
                         + "".join(row_errors(t[m], h[m]) for m in ("eager", "compiled")))
        lines += ["", "Decode: generate with 1 + new tokens minus generate with 1 (prefill and first token), medians "
                  "of the repeats after untimed warm-ups (which compile and capture).", ""]
    return lines


def run_benchmark(script: str, doc: str, part, defaults: dict, add_arguments=None, argv=None,
                  weights: str = "random weights") -> dict:
    """Parse the common flags (--tiny, --device, --out) and the benchmark's own (`add_arguments`; `defaults`:
    {name: (full, tiny)}), run `part(a, device, dtype, res, save)`, and write the JSON (rewritten after every
    measured row through `save`, so a killed run keeps what it measured) and its markdown rendering beside it
    (`weights`: what its header says the models' weights are)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and lengths (CPU is fine): checks the script")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None, help="JSON path (the markdown rendering is written beside it, .md)")
    if add_arguments is not None:
        add_arguments(ap)
    for key, (full, _) in defaults.items():
        ap.add_argument("--" + key.replace("_", "-"), default=None, type=type(full), help=f"default {full}")
    a = ap.parse_args(argv)
    for key, (full, tiny) in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, tiny if a.tiny else full)
    device = resolve_device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not a.tiny and device.type != "cuda":
        print(f"[{script}] warning: full shapes on a CPU will take very long; use --tiny", flush=True)
    res = {"command": f"python benchmarks/{script}.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "env": environment()}

    def render() -> str:
        env = res["env"]
        lines = [f"# taylor-calibrate performance: {script} ({env.get('gpu', '?')})", "",
                 f"torch {env.get('torch')}, triton {env.get('triton')}, fla {env.get('fla')}, transformers "
                 f"{env.get('transformers')}; {weights}.", ""]
        return "\n".join(lines + markdown(res) + [f"Command: `{res['command']}`", ""])

    def save():
        if a.out:
            res.update(record(a.out, res, a, command=res["command"]))
            Path(a.out).with_suffix(".md").write_text(render())

    t = time.perf_counter()
    part(a, device, dtype, res, save)
    res["wall_s"] = time.perf_counter() - t
    save()
    free(device)
    print("\n" + render())
    return res
