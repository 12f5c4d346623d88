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
      --grid cell (prompt length x sequences, random prompt ids shared by both models) timed as generate with 1 and
      with 1 + --gen_tokens new tokens (--repeats medians after --warmup untimed runs; prefix caching off): prefill
      tok/s, decode tok/s (the difference), and hybrid / teacher ratios. Each model runs in its own process (the
      `engine` step), so one that fails to load leaves the other's figures and a one-line reason.

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
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGIN_DIST = "taylor_calibrate_vllm_qwen3_5_text"
PLUGIN_NAME = "taylor_calibrate_qwen3_5_text"
ADAPTER = "vllm_qwen3_5_text:Qwen3_5TextForCausalLM"
ARCHITECTURE = "Qwen3_5ForCausalLM"
DEFAULT_GRID = "4096x1,4096x32,8000x32"


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

def cells(grid: str) -> list[tuple[int, int]]:
    """'4096x1,8000x32' -> [(4096, 1), (8000, 32)] (prompt tokens x sequences)."""
    try:
        out = [tuple(int(x) for x in c.split("x")) for c in grid.split(",")]
    except ValueError:
        out = []
    if not out or any(len(c) != 2 or min(c) < 1 for c in out):
        raise SystemExit(f"--grid {grid!r}: give cells as PROMPTxSEQUENCES, comma-separated (e.g. {DEFAULT_GRID})")
    return out


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
              "num_gpu_blocks": "cache_config.num_gpu_blocks",
              "mamba_ssm_cache_dtype": "cache_config.mamba_ssm_cache_dtype",
              "cudagraph_mode": "compilation_config.cudagraph_mode", "compilation_mode": "compilation_config.mode",
              "gdn_prefill_backend": "additional_config"}
    res["resolved"] = {k: _attr(config, path) for k, path in fields.items()}
    save()
    print(f"[engine] {a.name}: loaded in {res['load_s']:.1f} s: {json.dumps(res['resolved'])}", flush=True)

    def generate(prompts, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    if spec.get("greedy_prompts"):
        outs = generate(spec["greedy_prompts"], spec["new_tokens"])
        res["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
        save()
    rows = {}
    for ctx, seqs in spec.get("grid", []):
        prompts = random_prompts(ctx, seqs, spec["vocab"])
        gen = spec["gen_tokens"]
        try:
            for _ in range(spec["warmup"]):
                generate(prompts, 1 + gen)
            firsts, fulls = [], []
            for _ in range(spec["repeats"]):
                t = time.perf_counter()
                generate(prompts, 1)
                firsts.append(time.perf_counter() - t)
                t = time.perf_counter()
                outs = generate(prompts, 1 + gen)
                fulls.append(time.perf_counter() - t)
            if any(len(o.outputs[0].token_ids) != 1 + gen for o in outs):
                raise RuntimeError("a sequence stopped before 1 + gen_tokens tokens")
            first, full = statistics.median(firsts), statistics.median(fulls)
            if full <= first:
                raise RuntimeError(f"generate with {1 + gen} tokens took no longer than with 1 ({full:.4f} s)")
            rows[f"{ctx}x{seqs}"] = {
                "prefill_s": first, "generate_s": full, "decode_s": full - first,
                "prefill_tok_s": seqs * ctx / first, "decode_tok_s": seqs * gen / (full - first),
                "decode_ms_per_step": 1e3 * (full - first) / gen, "generate_tok_s": seqs * (1 + gen) / full,
                "firsts": firsts, "fulls": fulls}
        except Exception as e:  # out of memory, a kernel refusing a shape: the cell's error, the other cells run
            rows[f"{ctx}x{seqs}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        res["grid"] = rows
        save()
        print(f"[engine] {a.name} {ctx}x{seqs}: {json.dumps(rows[f'{ctx}x{seqs}'])}", flush=True)
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


def llm_settings(a, name: str, max_model_len: int, max_seqs: int) -> dict:
    """vLLM's constructor arguments: the same for both models, except the hybrid-only state cache dtype and GDN
    prefill backend."""
    kw = {"dtype": "bfloat16", "enforce_eager": a.enforce_eager, "gpu_memory_utilization": a.gpu_memory_utilization,
          "max_model_len": max_model_len, "max_num_seqs": max_seqs, "enable_prefix_caching": False, "seed": 0}
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    if name == "hybrid":
        kw["gdn_prefill_backend"] = a.gdn_prefill_backend
        if a.mamba_ssm_cache_dtype != "auto":
            kw["mamba_ssm_cache_dtype"] = a.mamba_ssm_cache_dtype
    return kw


def last_error_line(log: str) -> str:
    """The line of an engine's log that names why it stopped (its last exception line, else its last line)."""
    lines = [l.strip() for l in log.splitlines() if l.strip()]
    for l in reversed(lines):
        if ("Error" in l or "Exception" in l) and not l.startswith(("File ", "Traceback", "raise ", "^")):
            return l[:400]
    return lines[-1][:400] if lines else "no output"


def run_model(a, name: str, model_dir: str, spec: dict, work: Path, plugin: Path) -> dict:
    """The `engine` step for one model in its own process (reused when an earlier run of the same spec finished)."""
    key = hashlib.sha256(json.dumps([model_dir, spec], sort_keys=True).encode()).hexdigest()[:16]
    part, spec_file, log = work / f"engine_{name}.json", work / f"engine_{name}_spec.json", work / f"engine_{name}.log"
    if part.exists() and a.reuse:
        done = json.loads(part.read_text())
        if done.get("key") == key and "error" not in done and len(done.get("grid", {})) == len(spec["grid"]):
            print(f"[run] {name}: reusing {part}", flush=True)
            return done
    part.unlink(missing_ok=True)
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "engine", "--name", name, "--model", model_dir,
           "--spec", str(spec_file), "--out", str(part)]
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
    if rc != 0:
        done["error"] = (f"timed out after {a.engine_timeout:.0f} s" if rc == "timeout" else last_error_line(text))
        done["log_tail"] = text[-3000:]
        print(f"[run] {name}: FAILED ({done['error']}); log {log}", flush=True)
    part.write_text(json.dumps(done, indent=1))
    return done


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


def run_run(a) -> None:
    if reason := vllm_missing():
        raise SystemExit(reason)
    sys.path.insert(0, str(HERE.parent))
    import torch

    from taylor_calibrate.results import record
    from taylor_calibrate.teacher import load_tokenizer

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
    grid = cells(a.grid)
    if too_long := [f"{c}x{b}" for c, b in grid if c + 1 + a.gen_tokens > max_model_len]:
        raise SystemExit(f"--grid {','.join(too_long)}: prompt + {1 + a.gen_tokens} new tokens exceeds the models' "
                         f"max_position_embeddings ({max_model_len}); use prompts up to "
                         f"{max_model_len - 1 - a.gen_tokens}")
    tok = load_tokenizer(a.hybrid)
    prompts = held_out_prompts(tok, a.prompts, a.prompt_tokens) if "greedy" in a.parts else []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"engine": "vLLM (offline LLM.generate; one process per model)", "device": torch.cuda.get_device_name(0)
              if device == "cuda" else "cpu", "versions": versions(), "hybrid": a.hybrid, "teacher": a.teacher,
              "teacher_dir": teacher, "note": a.note, "max_model_len": max_model_len}
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
    engines = {}
    for name in a.models:
        spec = {"llm": llm_settings(a, name, max_model_len, max(b for _, b in grid)),
                "greedy_prompts": prompts, "new_tokens": a.new_tokens,
                "grid": grid if "throughput" in a.parts else [], "gen_tokens": a.gen_tokens, "vocab": vocab,
                "repeats": a.repeats, "warmup": a.warmup}
        engines[name] = run_model(a, name, models[name], spec, work, plugin)
        result.setdefault("engines", {})[name] = {k: engines[name].get(k) for k in
                                                  ("settings", "resolved", "load_s", "seconds", "error", "log")}
        if name in reference:
            result.setdefault("greedy_agreement", {})[name] = agreement(engines[name].get("greedy"),
                                                                         reference[name]["tokens"])
        save()
    rows = []
    for ctx, seqs in grid if "throughput" in a.parts else []:
        cell = f"{ctx}x{seqs}"
        row = {"cell": cell, "prompt_tokens": ctx, "sequences": seqs, "gen_tokens": a.gen_tokens}
        for name in a.models:
            r = (engines[name].get("grid") or {}).get(cell) or {"error": engines[name].get("error", "not run")}
            for k in ("prefill_tok_s", "decode_tok_s", "decode_ms_per_step", "generate_tok_s"):
                row[f"{name}_{k}"] = r.get(k)
            if "error" in r:
                row[f"{name}_error"] = r["error"]
        for k in ("prefill_tok_s", "decode_tok_s", "generate_tok_s"):
            t, h = row.get(f"teacher_{k}"), row.get(f"hybrid_{k}")
            row[f"hybrid_over_teacher_{k.removesuffix('_tok_s')}"] = h / t if h and t else None
        rows.append(row)
    result["throughput"] = rows
    save()
    print(json.dumps({k: result.get(k) for k in ("versions", "greedy_agreement")}, indent=1, default=str)[:4000])
    print("| cell | teacher prefill tok/s | hybrid prefill tok/s | x | teacher decode tok/s | hybrid decode tok/s "
          "| x |")
    print("|" + "---|" * 7)
    f = lambda v, spec=".0f": "-" if v is None else format(v, spec)
    for r in rows:
        print(f"| {r['cell']} | {f(r.get('teacher_prefill_tok_s'))} | {f(r.get('hybrid_prefill_tok_s'))} | "
              f"{f(r['hybrid_over_teacher_prefill'], '.2f')} | {f(r.get('teacher_decode_tok_s'))} | "
              f"{f(r.get('hybrid_decode_tok_s'))} | {f(r['hybrid_over_teacher_decode'], '.2f')} |")
    failed = {n: e["error"] for n, e in engines.items() if e.get("error")}
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
    r.add_argument("--grid", default=DEFAULT_GRID, help="PROMPTxSEQUENCES cells, comma-separated")
    r.add_argument("--gen_tokens", type=int, default=128, help="decode tokens timed per cell (after the first)")
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--warmup", type=int, default=1)
    r.add_argument("--gpu_memory_utilization", type=float, default=0.5)
    r.add_argument("--max_num_batched_tokens", type=int, default=None, help="default: vLLM's")
    r.add_argument("--enforce_eager", action="store_true", help="no torch.compile / CUDA graphs (default: both on)")
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
    a = p.parse_args(argv)
    {"teacher-hf": run_teacher_hf, "run": run_run, "engine": run_engine}[a.step](a)


if __name__ == "__main__":
    main()
