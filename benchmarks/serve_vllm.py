"""Serve the exported hybrid (`convert --target qwen3_5`, then `export`) and its teacher in vLLM on a GPU, and compare
them in the same engine: greedy tokens against transformers' own, and offline throughput at the same settings.

vLLM 0.26 (the last release for torch 2.11) has no registered text-only Qwen3.5 class: this script registers one
(benchmarks/vllm_qwen3_5_text.py) both in its own process and as a vLLM general plugin, through a small generated
distribution folder on PYTHONPATH, so that vLLM's engine and worker processes, forked or spawned, have it too.

  teacher-hf (any machine): the teacher (a spec `load_teacher` takes: GGUF file, HF directory or id) saved as an HF
      directory (bf16 by default), which vLLM loads as the teacher.
  run (a GPU with vllm): greedy tokens of --prompts held-out prompts (--new_tokens each, EOS ignored) from vLLM
      against transformers' `AutoModelForCausalLM` on the same directory (--hf_dtype; transformers' own
      `Qwen3_5ForCausalLM` for the export), for the hybrid and, as the engine's baseline, the teacher; then each
      --grid cell (context x sequences; random prompt ids shared by both models) run once by stepping the engine:
      prefill tok/s until every sequence has its first token, decode tok/s over the steps after it (each gives every
      sequence a token), the largest batch each model holds (vLLM's own cache count, from its log), and the
      roofline: the bytes a step must read (deployed_shapes.step_bytes) over the GPU's measured copy bandwidth.
      --profile_cell records a few decode steps with vLLM's torch profiler: GPU time per kernel class, and the rest
      of the step (host work, launches). Each model runs in its own process (the `engine` step), so one that fails
      to load leaves the other's figures and a one-line reason; a later call with the other model (--models) and the
      same --work fills in the same file.

  python benchmarks/serve_vllm.py teacher-hf --teacher smollm2-135m --out runs/teacher_hf
  python benchmarks/serve_vllm.py run --hybrid runs/hybrid_qwen3_5 --teacher runs/teacher_hf --out serve_vllm.json
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from deployed_shapes import cells, roofline_tok_s, step_bytes

HERE = Path(__file__).resolve().parent
PLUGIN_DIST = "taylor_calibrate_vllm_qwen3_5_text"
PLUGIN_NAME = "taylor_calibrate_qwen3_5_text"
ADAPTER = "vllm_qwen3_5_text:Qwen3_5TextForCausalLM"
ARCHITECTURE = "Qwen3_5ForCausalLM"
DEFAULT_GRID = "32768x1,32768x8,32768x32,32768x128,131072x1,131072x8,131072x32,131072x0"
CAPACITY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
GRAPHS = re.compile(r"(Capturing CUDA graphs|Graph capturing finished)[^\n]*")


# ------------------------------------------------------------------------------------------------- the plugin

def register() -> None:
    """vLLM general-plugin entry point: register the text-only Qwen3.5 class (by name: vLLM imports it when a model
    asks for it). Safe to call more than once, in any vLLM process."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, ADAPTER)


def write_plugin(root: Path) -> Path:
    """A distribution folder under `root` whose only content is the entry point `vllm.general_plugins` ->
    serve_vllm:register (vLLM loads every such entry point in each of its processes). Put `root` and this script's
    folder on PYTHONPATH for it to be found and imported."""
    info = root / f"{PLUGIN_DIST}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_DIST}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_NAME} = serve_vllm:register\n")
    return root


def engine_env(plugin_root: Path) -> dict:
    """The environment of an engine process: the plugin and this folder importable; FlashInfer's sampler off (the
    GPU image has no FlashInfer); no hub or usage-stats traffic (the GPU machine has no network)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_root), str(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])
    for k, v in {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                 "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}.items():
        env.setdefault(k, v)
    return env


def vllm_missing() -> str | None:
    """None when vllm imports; else the one-line reason."""
    if importlib.util.find_spec("vllm") is None:
        return ("serve_vllm: vllm is not installed; this benchmark needs vllm 0.26.0 on a CUDA GPU (it pins torch "
                "2.11); it is not a dependency of taylor-calibrate")
    return None


# ----------------------------------------------------------------------------------------------- teacher-hf

def teacher_hf(spec: str, out: str | Path, dtype: str = "bfloat16") -> Path:
    """The teacher as `load_teacher` reads it (a GGUF dequantised as our conversion saw it), saved as an HF directory
    with its tokenizer, in `dtype`. An existing directory with a config.json is kept."""
    import torch

    from taylor_calibrate.teacher import load_teacher

    from transformers import AutoModelForCausalLM

    out = Path(out)
    if (out / "config.json").exists():
        return out
    teacher = load_teacher(spec, dtype=getattr(torch, dtype))
    # a model read from a GGUF file carries its quantizer, which refuses save_pretrained: the same (dequantised)
    # weights go into a plain model of the same config
    config = copy.deepcopy(teacher.model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(teacher.model.state_dict())
    model.save_pretrained(out)
    teacher.tokenizer.save_pretrained(out)
    return out


def run_teacher_hf(a) -> None:
    print(teacher_hf(a.teacher, a.out, a.dtype))


# ---------------------------------------------------------------------------------------------------- engine

def random_prompts(ctx: int, seqs: int, vocab: int) -> list[list[int]]:
    """The cell's prompt ids: the same for every model (seeded by the cell)."""
    import torch

    g = torch.Generator().manual_seed(ctx * 1000 + seqs)
    return torch.randint(0, vocab, (seqs, ctx), generator=g).tolist()


def _attr(obj, path: str):
    """obj.a.b as JSON-friendly text (None where vLLM has no such field)."""
    for name in path.split("."):
        obj = getattr(obj, name, None)
    return obj if obj is None or isinstance(obj, (int, float, str, bool)) else str(obj)


def log_capacity(log: str) -> dict:
    """What vLLM's log says of the cache it sized: tokens it holds, sequences of max_model_len it holds at once,
    and its CUDA-graph capture lines (the check that decode runs as graphs)."""
    cap, kv = CAPACITY.findall(log), KV_TOKENS.findall(log)
    return {"kv_cache_tokens": int(kv[-1].replace(",", "")) if kv else None,
            "max_concurrency": float(cap[-1][1]) if cap else None,
            "max_concurrency_tokens": int(cap[-1][0].replace(",", "")) if cap else None,
            "cudagraph_log": [m.group(0)[:200] for m in GRAPHS.finditer(log)][-4:]}


def stepped(llm, prompts: list[list[int]], gen: int, profile_steps: int = 0) -> dict:
    """Run `prompts` together (greedy, EOS ignored) by stepping vLLM's engine, and time it from the steps: prefill =
    until every sequence has its first token; decode = the steps after that in which every sequence gets a token.
    Chunked prefill lets the first sequences decode while the last ones prefill, so each sequence generates `gen`
    tokens plus one per prefill step of the whole batch: all are still running when the last prefill ends, and the
    window of `gen` full-batch steps that follows is the decode measurement (its sequences' cache lengths lie
    between the prompt length and the prompt length + the tokens each generated). With `profile_steps`, vLLM's
    torch profiler records that many of those steps (its profiler_config says where)."""
    import math

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    chunk = engine.vllm_config.scheduler_config.max_num_batched_tokens
    extra = math.ceil(sum(map(len, prompts)) / chunk) + 8
    params = SamplingParams(temperature=0.0, max_tokens=1 + gen + extra, ignore_eos=True)
    counts: dict[str, int] = {}
    t0 = time.perf_counter()
    ids = [f"r{i}-{t0}" for i in range(len(prompts))]
    for i, p in zip(ids, prompts):
        engine.add_request(i, TokensPrompt(prompt_token_ids=p), params)
    first_all, full, profiling = None, [], False
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        new = 0
        for o in outs:
            n = len(o.outputs[0].token_ids)
            new += n - counts.get(o.request_id, 0)
            counts[o.request_id] = n
        if first_all is None:
            if len(counts) == len(prompts) and min(counts.values()) >= 1:
                first_all = t
        elif new == len(prompts) and len(full) <= gen:
            full.append(t)
            if profile_steps and len(full) == 4:
                engine.start_profile()
                profiling = True
            if profiling and len(full) == 4 + profile_steps:
                engine.stop_profile()
                profiling = False
            if len(full) > gen:  # the window is measured: the rest of the tokens are not needed
                engine.abort_request(ids)
    if profiling:
        engine.stop_profile()
    if first_all is None or len(full) < 2:
        raise RuntimeError(f"only {len(full)} decode steps ran every sequence at once")
    times = [b - a for a, b in zip(full, full[1:])]
    return {"prefill_s": first_all - t0, "prefill_tok_s": sum(map(len, prompts)) / (first_all - t0),
            "decode_s": full[-1] - full[0], "decode_tok_s": len(prompts) * len(times) / (full[-1] - full[0]),
            "decode_ms_per_step": 1e3 * statistics.median(times), "decode_steps": len(times),
            "generated_per_sequence": 1 + gen + extra}


def run_engine(a) -> None:
    """One model in vLLM, in this process: greedy tokens of the given prompts, then the grid; writes --out."""
    spec = json.loads(Path(a.spec).read_text())
    register()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    res = {"model": a.model, "settings": spec["llm"], "vllm": __import__("vllm").__version__}
    out = Path(a.out)

    def save():
        out.write_text(json.dumps(res, indent=1))

    t = time.perf_counter()
    llm = LLM(model=a.model, **spec["llm"])
    res["load_s"] = time.perf_counter() - t
    config = llm.llm_engine.vllm_config
    fields = {"architecture": "model_config.architecture", "attention_backend": "attention_config.backend",
              "max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
              "max_num_seqs": "scheduler_config.max_num_seqs", "block_size": "cache_config.block_size",
              "num_gpu_blocks": "cache_config.num_gpu_blocks", "kv_cache_dtype": "cache_config.cache_dtype",
              "mamba_ssm_cache_dtype": "cache_config.mamba_ssm_cache_dtype",
              "cudagraph_mode": "compilation_config.cudagraph_mode", "compilation_mode": "compilation_config.mode",
              "max_cudagraph_capture_size": "compilation_config.max_cudagraph_capture_size",
              "gdn_prefill_backend": "additional_config"}
    res["resolved"] = {k: _attr(config, path) for k, path in fields.items()}
    res["capacity"] = log_capacity(Path(a.log).read_text(errors="replace")) if a.log else {}
    save()
    print(f"[engine] {a.name}: loaded in {res['load_s']:.1f} s: {json.dumps(res['resolved'])} "
          f"{json.dumps(res['capacity'])}", flush=True)

    def generate(prompts, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    if spec.get("greedy_prompts"):
        outs = generate(spec["greedy_prompts"], spec["new_tokens"])
        res["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
        save()
    rows = {}
    kv_tokens = res["capacity"].get("kv_cache_tokens")
    gen = spec["gen_tokens"]
    for ctx, seqs in spec.get("grid", []):
        cell = f"{ctx}x{seqs}"
        if seqs == 0:  # the largest batch the engine holds at this context, from its own count
            seqs = min(spec["llm"]["max_num_seqs"], int(res["capacity"].get("max_concurrency") or 0)
                       if ctx == res["capacity"].get("max_concurrency_tokens") else (kv_tokens or 0) // ctx)
            if seqs < 1:
                rows[cell] = {"error": "vLLM's log gave no capacity at this context"}
                continue
        elif kv_tokens is not None and seqs * ctx > kv_tokens:
            rows[cell] = {"error": f"holds {kv_tokens // ctx} sequences of {ctx} tokens ({kv_tokens:,} cached "
                                   "tokens)", "capacity": kv_tokens // ctx}
            res["grid"] = rows
            save()
            continue
        chunk = config.scheduler_config.max_num_batched_tokens
        prompt_len = ctx - 1 - gen - 8 - -(-seqs * ctx // chunk)  # the earliest sequence ends at `ctx`
        prompts = random_prompts(prompt_len, seqs, spec["vocab"])
        try:
            for _ in range(spec["warmup"]):  # JIT and autotune at this batch, on short prompts
                generate([p[:512] for p in prompts], 8)
            rows[cell] = {"sequences": seqs, "prompt_tokens": prompt_len,
                          **stepped(llm, prompts, gen, spec["profile_steps"] if cell == spec.get("profile_cell")
                                    else 0)}
        except Exception as e:  # out of memory, a kernel refusing a shape: the cell's error, the other cells run
            rows[cell] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        res["grid"] = rows
        save()
        print(f"[engine] {a.name} {cell}: {json.dumps(rows[cell])}", flush=True)
    save()


# ------------------------------------------------------------------------------------------------------- run

def held_out_prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    """`n` prompts of `tokens` ids each: the first tokens of held-out documents of the default corpus (the split
    `convert` measured its held-out perplexity on), as serve_llamacpp.py's prepare step picks them."""
    from serve_llamacpp import heldout_text

    docs = [d for d in heldout_text(400_000).split("\n\n") if len(d) > 400]
    prompts = [tokenizer(d, add_special_tokens=False).input_ids[:tokens] for d in docs]
    prompts = [p for p in prompts if len(p) == tokens][:n]
    if len(prompts) < n:
        raise SystemExit(f"serve_vllm: only {len(prompts)} held-out documents have {tokens} tokens; lower --prompts "
                         "or --prompt_tokens")
    return prompts


def hf_greedy(model_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str, device: str) -> dict:
    """transformers' own greedy tokens (generate, EOS ignored) for each prompt, and which class and dtype gave them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval().to(device)
    t = time.perf_counter()
    tokens = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            tokens.append(out[0, len(p):].tolist())
    res = {"class": type(model).__name__, "dtype": dtype, "device": device, "tokens": tokens,
           "seconds": time.perf_counter() - t}
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


def agreement(got: list[list[int]] | None, want: list[list[int]]) -> dict | None:
    """Position-by-position agreement of two sets of greedy continuations, and where each prompt first diverges."""
    if got is None:
        return None
    per = [{"agree": sum(x == y for x, y in zip(g, w)), "n": len(w),
            "first_divergence": next((i for i, (x, y) in enumerate(zip(g, w)) if x != y),
                                     None if len(g) == len(w) else min(len(g), len(w)))}
           for g, w in zip(got, want)]
    total = sum(p["n"] for p in per)
    return {"fraction": sum(p["agree"] for p in per) / total if total else None,
            "identical_prompts": sum(p["first_divergence"] is None for p in per), "prompts": per}


def model_limits(model_dir: str) -> tuple[int, int]:
    """(max_position_embeddings, vocab_size) from the directory's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    return config["max_position_embeddings"], config["vocab_size"]


def llm_settings(a, name: str, max_model_len: int, max_seqs: int, profile_dir: Path | None = None) -> dict:
    """vLLM's constructor arguments: the same for both models, except the hybrid-only state cache dtype and GDN
    prefill backend."""
    kw = {"dtype": "bfloat16", "enforce_eager": a.enforce_eager, "gpu_memory_utilization": a.gpu_memory_utilization,
          "max_model_len": max_model_len, "max_num_seqs": max_seqs, "enable_prefix_caching": False, "seed": 0}
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    if a.compilation_mode is not None or a.cudagraph_mode:
        kw["compilation_config"] = {k: v for k, v in (("mode", a.compilation_mode),
                                                      ("cudagraph_mode", a.cudagraph_mode)) if v is not None}
    if profile_dir is not None:
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": str(profile_dir),
                                 "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True,
                                 "ignore_frontend": True}
    if name == "hybrid":
        kw["gdn_prefill_backend"] = a.gdn_prefill_backend
        if a.mamba_ssm_cache_dtype != "auto":
            kw["mamba_ssm_cache_dtype"] = a.mamba_ssm_cache_dtype
    return kw


KERNEL_CLASSES = (  # first match wins; a kernel's name, lower-cased
    ("gdn recurrent step", ("fused_recurrent", "recurrent_gated_delta", "fused_sigmoid_gating")),
    ("gdn conv", ("causal_conv1d",)),
    ("gdn other", ("gated_delta", "chunk_", "l2norm", "fused_gdn", "gdn")),
    ("attention", ("flash", "fmha", "attention", "paged", "reshape_and_cache")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "matmul", "splitk")),
    ("norm", ("rms", "norm")),
    ("sampling", ("argmax", "topk", "top_k", "sampl", "softmax", "sort", "gumbel", "multinomial")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def profile_summary(trace_dir: Path) -> dict | None:
    """Per decode step, from vLLM's torch-profiler trace (its worker's .pt.trace.json.gz): ms of GPU kernels per
    class (attention, GDN recurrent step, GDN conv, matmuls, norms, sampling, other), GPU-busy ms, wall ms per step
    and the rest (host, launch, idle). Steps are counted by the CUDA-graph launches (one per decode step)."""
    import gzip

    files = sorted(trace_dir.glob("*.pt.trace.json*")) if trace_dir.exists() else []
    if not files:
        return None
    f = files[-1]
    trace = json.loads((gzip.open(f) if f.suffix == ".gz" else open(f)).read())
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    graphs = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in e.get("name", "")]
    steps = len(graphs) or None
    if not kernels or not steps:
        return {"file": f.name, "steps": steps, "kernels": len(kernels)}
    by_class, by_kernel = {}, {}
    busy, end = 0.0, float("-inf")
    for e in kernels:
        by_class[kernel_class(e["name"])] = by_class.get(kernel_class(e["name"]), 0.0) + e["dur"]
        by_kernel[e["name"]] = by_kernel.get(e["name"], 0.0) + e["dur"]
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        end = max(end, e["ts"] + e["dur"])
    starts = sorted(g["ts"] for g in graphs)
    wall = (starts[-1] - starts[0]) / (len(starts) - 1) / 1e3 if len(starts) > 1 else None
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:15]
    host = {}
    for e in ev:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            host[e["name"]] = host.get(e["name"], 0.0) + e["dur"]
    return {"file": f.name, "steps": steps, "wall_ms_per_step": wall, "gpu_busy_ms_per_step": busy / steps / 1e3,
            "ms_per_step": {k: v / steps / 1e3 for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"kernel": k[:120], "class": kernel_class(k), "ms_per_step": v / steps / 1e3}
                            for k, v in top],
            "host_top": [{"event": k[:120], "ms_per_step": v / steps / 1e3}
                         for k, v in sorted(host.items(), key=lambda kv: -kv[1])[:25]]}


def copy_bandwidth(device: str = "cuda", gib: int = 4) -> float | None:
    """Bytes/s a device-to-device copy moves, counting bytes read and written (the median of 10 copies of `gib`)."""
    import torch

    if not torch.cuda.is_available():
        return None
    x = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / statistics.median(times[2:])


def last_error_line(log: str) -> str:
    """The line of an engine's log that names why it stopped (its last exception line, else its last line)."""
    lines = [l.strip() for l in log.splitlines() if l.strip()]
    for l in reversed(lines):
        if ("Error" in l or "Exception" in l) and not l.startswith(("File ", "Traceback", "raise ", "^")):
            return l[:400]
    return lines[-1][:400] if lines else "no output"


def run_model(a, name: str, model_dir: str, spec: dict, work: Path, plugin: Path) -> dict:
    """The `engine` step for one model in its own process. An earlier call's part with the same model and settings
    keeps its finished cells (and its profile): only the cells it lacks run, so a long grid spans several calls."""
    key = hashlib.sha256(json.dumps([model_dir, part_settings(spec)], sort_keys=True).encode()).hexdigest()[:16]
    part, spec_file, log = work / f"engine_{name}.json", work / f"engine_{name}_spec.json", work / f"engine_{name}.log"
    kept, kept_profile = {}, None
    if part.exists() and a.reuse:
        done = json.loads(part.read_text())
        if done.get("key") == key:
            kept = {c: r for c, r in (done.get("grid") or {}).items() if "error" not in r or "capacity" in r}
            if done.get("profile") and not spec.get("profile_cell"):
                kept_profile = done["profile"]
        todo = [(c, b) for c, b in spec["grid"] if f"{c}x{b}" not in kept]
        if kept and not todo and "error" not in done and not spec.get("greedy_prompts"):
            print(f"[run] {name}: reusing {part}", flush=True)
            return done
        spec = {**spec, "grid": todo}
    part.unlink(missing_ok=True)
    log = log.with_name(f"engine_{name}_{time.strftime('%Y%m%d-%H%M%S')}.log")
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "engine", "--name", name, "--model", model_dir,
           "--spec", str(spec_file), "--out", str(part), "--log", str(log)]
    t = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=engine_env(plugin),
                                timeout=a.engine_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log.read_text(errors="replace")
    done = json.loads(part.read_text()) if part.exists() else {}
    done.update(key=key, seconds=time.perf_counter() - t, rc=rc, log=log.name)
    done["grid"] = {**kept, **(done.get("grid") or {})}
    if rc != 0:
        done["error"] = (f"timed out after {a.engine_timeout:.0f} s" if rc == "timeout" else last_error_line(text))
        done["log_tail"] = text[-3000:]
        print(f"[run] {name}: FAILED ({done['error']}); log {log}", flush=True)
    if spec.get("profile_cell"):
        try:
            done["profile"] = profile_summary(work / f"profile_{name}")
        except Exception as e:  # a trace that does not parse: the figures stand without it
            done["profile"] = {"error": f"{type(e).__name__}: {e}"}
    elif kept_profile:
        done["profile"] = kept_profile
    part.write_text(json.dumps(done, indent=1))
    return done


def part_settings(spec: dict) -> dict:
    """What makes two calls' cells of one model comparable: the spec less its grid, prompts and profiler window."""
    llm = {k: v for k, v in spec["llm"].items() if k != "profiler_config"}
    return {**{k: v for k, v in spec.items() if k not in ("grid", "greedy_prompts", "profile_cell", "profile_steps")},
            "llm": llm}


def versions() -> dict:
    from importlib import metadata

    out = {}
    for d in ("vllm", "torch", "transformers", "triton", "flash-linear-attention", "fla-core", "xgrammar",
              "llguidance", "flashinfer-python"):
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = None
    return out


def engine_name(a, name: str) -> str:
    """A model's engine part name: the hybrid's carries a non-default state dtype (runs of both dtypes share --work)."""
    return name if name == "teacher" or a.mamba_ssm_cache_dtype == "float32" else f"hybrid_{a.mamba_ssm_cache_dtype}_state"


def grid_rows(a, grid, parts: dict, models: dict, bandwidth: float | None) -> list[dict]:
    """The results file's grid: per cell, each model's decode and prefill tokens/s, its roofline (bytes a step must
    read over the copy bandwidth) and the ratios; a model that cannot hold the batch gets null and the reason."""
    rows = []
    for ctx, seqs in grid:
        cell = f"{ctx}x{seqs}"
        row = {"context": ctx, "parallel": seqs or "max"}
        for name, part in parts.items():
            r = (part.get("grid") or {}).get(cell) or {"error": part.get("error") or "not run"}
            key, col = ("hybrid" if name.startswith("hybrid") else "teacher"), name  # a column per engine part
            n = r.get("sequences", seqs)
            for k in ("decode_tok_s", "prefill_tok_s", "decode_ms_per_step"):
                row[f"{col}_{k}"] = r.get(k)
            if not seqs:
                row[f"{col}_parallel"] = r.get("sequences")
            if "error" in r:
                row[f"{col}_error"] = r["error"]
            state = 2 if "bfloat16" in name or "float16" in name else 4
            if n and bandwidth and key in models:
                sb = step_bytes(models[key], ctx, n, state_bytes=state)
                row[f"{col}_step_bytes"] = sb
                row[f"{col}_roofline_tok_s"] = roofline_tok_s(sb, n, bandwidth)
                if row.get(f"{col}_decode_tok_s"):
                    row[f"{col}_of_roofline"] = row[f"{col}_decode_tok_s"] / row[f"{col}_roofline_tok_s"]
        for k in ("decode", "prefill"):
            t, h = row.get(f"teacher_{k}_tok_s"), row.get(f"hybrid_{k}_tok_s")
            row[f"hybrid_over_teacher_{k}"] = h / t if h and t else None
        t, h = row.get("teacher_roofline_tok_s"), row.get("hybrid_roofline_tok_s")
        row["roofline_hybrid_over_teacher"] = h / t if h and t else None
        rows.append(row)
    return rows


def run_run(a) -> None:
    if reason := vllm_missing():
        raise SystemExit(reason)
    sys.path.insert(0, str(HERE.parent))
    import torch

    from taylor_calibrate.results import record

    work = Path(a.work or Path(a.out).with_suffix("")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    plugin = write_plugin(work / "plugin")
    teacher = a.teacher
    if not (Path(teacher) / "config.json").exists():  # a GGUF file or a spec: its HF copy, made once
        teacher = str(teacher_hf(a.teacher, work / "teacher_hf"))
    models = {"teacher": teacher, "hybrid": a.hybrid}
    limits = {n: model_limits(d) for n, d in models.items()}
    max_model_len = min(l[0] for l in limits.values())
    vocab = min(l[1] for l in limits.values())
    grid = cells(a.grid, allow_max=True)
    if too_long := [f"{c}x{b}" for c, b in grid if c > max_model_len or c <= 1 + a.gen_tokens]:
        raise SystemExit(f"--grid {','.join(too_long)}: a cell's context (prompt + {1 + a.gen_tokens} new tokens) "
                         f"must be above {1 + a.gen_tokens} and at most the models' max_position_embeddings "
                         f"({max_model_len})")
    engine_len = max(c for c, _ in grid)  # vLLM's capacity line is then the largest context's
    prompts = []
    if "greedy" in a.parts:
        from taylor_calibrate.teacher import load_tokenizer

        prompts = held_out_prompts(load_tokenizer(a.hybrid), a.prompts, a.prompt_tokens)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bandwidth = copy_bandwidth() if device == "cuda" else None
    result = {"engine": "vllm", "version": versions().get("vllm"), "shape": a.shape, "params": {},
              "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "versions": versions(),
              "hybrid": a.hybrid, "teacher": a.teacher, "teacher_dir": teacher, "note": a.note,
              "copy_bandwidth_bytes_s": bandwidth, "max_model_len": engine_len}
    for name, d in models.items():
        sb = step_bytes(d, 1, 1)
        result["params"][name] = {"weight_bytes_per_step": sb["weights"], "attention_layers": sb["attention_layers"],
                                  "gdn_layers": sb["gdn_layers"]}
    out = Path(a.out)

    def save():
        record(out, result, a)

    reference = {}
    if prompts:
        for name in a.models:  # transformers first: its GPU memory is given back before vLLM takes its share
            try:
                reference[name] = hf_greedy(models[name], prompts, a.new_tokens, a.hf_dtype, device)
            except Exception as e:  # a kernel of transformers' GPU path refusing: the same model on the CPU
                if device == "cpu":
                    raise
                print(f"[run] transformers {name} on {device} failed ({type(e).__name__}: {e}); on the CPU", flush=True)
                reference[name] = hf_greedy(models[name], prompts, a.new_tokens, a.hf_dtype, "cpu")
                reference[name]["gpu_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"[run] transformers {name} ({reference[name]['class']}, {a.hf_dtype}): "
                  f"{reference[name]['seconds']:.1f} s", flush=True)
        result["greedy_setup"] = {"prompts": len(prompts), "prompt_tokens": a.prompt_tokens,
                                  "new_tokens": a.new_tokens, "eos": "ignored by both",
                                  "reference": {n: {k: r.get(k) for k in ("class", "dtype", "device", "gpu_error")}
                                                for n, r in reference.items()}}
        save()
    for name in a.models:
        ename = engine_name(a, name)
        spec = {"llm": llm_settings(a, name, engine_len, a.max_num_seqs,
                                    work / f"profile_{ename}" if a.profile_cell else None),
                "greedy_prompts": prompts, "new_tokens": a.new_tokens,
                "grid": grid if "throughput" in a.parts else [], "gen_tokens": a.gen_tokens, "vocab": vocab,
                "warmup": a.warmup, "profile_cell": a.profile_cell, "profile_steps": a.profile_steps}
        part = run_model(a, ename, models[name], spec, work, plugin)
        if name in reference:
            result.setdefault("greedy_agreement", {})[ename] = agreement(part.get("greedy"),
                                                                          reference[name]["tokens"])
    # every engine part in --work (earlier calls' too: one model a call is how a long grid fits)
    parts = {p.stem.removeprefix("engine_"): json.loads(p.read_text()) for p in sorted(work.glob("engine_*.json"))
             if not p.stem.endswith("_spec")}
    result["settings"] = {n: {k: e.get(k) for k in ("settings", "resolved", "capacity", "load_s", "seconds", "error",
                                                     "log")} for n, e in parts.items()}
    result["profile"] = {n: e["profile"] for n, e in parts.items() if e.get("profile")}
    if "throughput" in a.parts:  # this call's cells and every earlier call's, in order of context then batch
        done = {tuple(map(int, c.split("x"))) for e in parts.values() for c in (e.get("grid") or {})}
        every = sorted(set(grid) | done, key=lambda c: (c[0], c[1] == 0, c[1]))
        result["grid"] = grid_rows(a, every, parts, models, bandwidth)
    else:
        result["grid"] = []
    save()
    print(json.dumps({k: result.get(k) for k in ("versions", "greedy_agreement", "copy_bandwidth_bytes_s")},
                     indent=1, default=str)[:4000])
    f = lambda v, spec=".0f": "-" if v is None else format(v, spec)
    print("| context x seqs | teacher decode tok/s (roofline) | hybrid decode tok/s (roofline) | x (roofline x) "
          "| teacher prefill | hybrid prefill |")
    print("|" + "---|" * 6)
    for r in result["grid"]:
        print(f"| {r['context']}x{r['parallel']} | {f(r.get('teacher_decode_tok_s'))} "
              f"({f(r.get('teacher_roofline_tok_s'))}) | {f(r.get('hybrid_decode_tok_s'))} "
              f"({f(r.get('hybrid_roofline_tok_s'))}) | {f(r['hybrid_over_teacher_decode'], '.2f')} "
              f"({f(r['roofline_hybrid_over_teacher'], '.2f')}) | {f(r.get('teacher_prefill_tok_s'))} | "
              f"{f(r.get('hybrid_prefill_tok_s'))} |")
    for n, pr in result["profile"].items():
        print(f"[profile] {n}: {json.dumps({k: pr.get(k) for k in ('wall_ms_per_step', 'gpu_busy_ms_per_step', 'ms_per_step')})}")
    failed = {n: e["error"] for n, e in parts.items() if e.get("error")}
    if failed:
        raise SystemExit("serve_vllm: " + "; ".join(f"{n} failed in vLLM: {e}" for n, e in failed.items()))


# ------------------------------------------------------------------------------------------------------ main

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    t = sub.add_parser("teacher-hf", help="save the teacher as an HF directory (vLLM's teacher input)")
    t.add_argument("--teacher", required=True, help="a teacher spec: GGUF file, HF directory or id")
    t.add_argument("--out", required=True)
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    r = sub.add_parser("run", help="greedy agreement and throughput of the hybrid and the teacher in vLLM (GPU)")
    r.add_argument("--hybrid", required=True, help="the hybrid's Qwen3.5-form export (an HF directory)")
    r.add_argument("--teacher", required=True, help="an HF directory, or a spec that teacher-hf converts into --work")
    r.add_argument("--out", required=True, help="results JSON")
    r.add_argument("--work", default=None, help="folder for engine logs, parts and the teacher's HF copy "
                   "(default: --out without its suffix)")
    r.add_argument("--parts", nargs="+", default=["greedy", "throughput"], choices=["greedy", "throughput"])
    r.add_argument("--models", nargs="+", default=["teacher", "hybrid"], choices=["teacher", "hybrid"])
    r.add_argument("--prompts", type=int, default=5)
    r.add_argument("--prompt_tokens", type=int, default=64)
    r.add_argument("--new_tokens", type=int, default=64)
    r.add_argument("--hf_dtype", default="float32", choices=["float32", "bfloat16"],
                   help="transformers' dtype for the reference greedy tokens")
    r.add_argument("--grid", default=DEFAULT_GRID, help="CONTEXTxSEQUENCES cells, comma-separated: context = prompt + "
                   "1 + --gen_tokens (the cache length at the last step); SEQUENCES 0 = the most the engine holds")
    r.add_argument("--shape", default="", help="the shape's name, for the record (e.g. qwen2.5-1.5b)")
    r.add_argument("--gen_tokens", type=int, default=128, help="decode tokens timed per cell (after the first)")
    r.add_argument("--warmup", type=int, default=1, help="untimed short runs at each cell's batch first")
    r.add_argument("--gpu_memory_utilization", type=float, default=0.9)
    r.add_argument("--max_num_batched_tokens", type=int, default=None, help="default: vLLM's")
    r.add_argument("--enforce_eager", action="store_true", help="no torch.compile / CUDA graphs (default: both on)")
    r.add_argument("--compilation_mode", type=int, default=None, help="vLLM's compilation_config.mode (0: no "
                   "torch.compile; default: vLLM's)")
    r.add_argument("--cudagraph_mode", default=None, help="vLLM's compilation_config.cudagraph_mode (e.g. "
                   "FULL_DECODE_ONLY; default: vLLM's)")
    r.add_argument("--max_num_seqs", type=int, default=256, help="vLLM's max_num_seqs (caps the largest batch)")
    r.add_argument("--profile_cell", default=None, help="CONTEXTxSEQUENCES: profile --profile_steps decode steps of "
                   "that cell with vLLM's torch profiler (kernel time per class)")
    r.add_argument("--profile_steps", type=int, default=8)
    r.add_argument("--gdn_prefill_backend", default="triton", choices=["triton", "flashinfer", "cutedsl"],
                   help="hybrid only; vLLM's own default on Hopper is FlashInfer, which the GPU image lacks")
    r.add_argument("--mamba_ssm_cache_dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                   help="hybrid only: the GDN recurrent state's dtype (float32: what Qwen3.5's own configs ask "
                        "for, mamba_ssm_dtype; auto: the model dtype)")
    r.add_argument("--engine_timeout", type=float, default=480, help="seconds for one model's engine process")
    r.add_argument("--no_reuse", dest="reuse", action="store_false",
                   help="rerun a model whose engine part of the same settings is already in --work")
    r.add_argument("--note", default="")
    e = sub.add_parser("engine", help="(internal) one model in vLLM in this process")
    e.add_argument("--name", required=True)
    e.add_argument("--model", required=True)
    e.add_argument("--spec", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--log", default=None, help="this process's own log (vLLM's cache sizing is read from it)")
    a = p.parse_args(argv)
    {"teacher-hf": run_teacher_hf, "run": run_run, "engine": run_engine}[a.step](a)


if __name__ == "__main__":
    main()
