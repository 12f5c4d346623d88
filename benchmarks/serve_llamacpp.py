"""Serve the teacher's GGUF and the exported hybrid's in llama.cpp (CUDA) and compare them in the same engine.

Three steps, because the GPU machine has no network and no copy of this package's environment:

  prepare (here, CPU): export the hybrid (`convert --target qwen3_5`) to an f16 GGUF, write held-out text, score our
      class on it the way llama-perplexity does (chunks of --ctx tokens, the second half of each scored), greedy
      tokens of our class on --prompts prompts, and cut the two GGUFs into parts small enough to carry.
  device (the H200; llama.cpp built by benchmarks/build_llamacpp.sh): the teacher requantised to the hybrid's
      weight type (f16) with llama-quantize, llama-perplexity on both, llama.cpp's own tokenisation and greedy tokens
      through llama-cpp-python's ctypes binding on the built library, and llama-batched-bench over context x parallel
      sequences (prompt and decode tokens/s; KV and recurrent-state bytes from the context's own log); with
      --probe_attention K ..., the same grid for probes of the hybrid's graph with K attention layers.
  collect (here): one results JSON (commit, dirty flag, args, environment) and a table.

Two more run on one machine (the CPU build is enough: benchmarks/build_llamacpp.sh SRC BUILD cpu):

  bytes: held-out loss per byte through llama.cpp's own tokenisation against ours, for the teacher's GGUF beside our
      load of that teacher and / or a hybrid's GGUF export beside our class: llama-tokenize and llama-perplexity on
      the same held-out text file, our model scored the way llama-perplexity scores, nll / UTF-8 bytes of the scored
      tokens on each side, and whether the two tokenisations are the same ids.
  probe: a hybrid's GGUF rewritten with another layer pattern, each layer's mixer copied from the first layer of its
      kind: the weights mean nothing, the graph is llama.cpp's at that pattern, so its speed says what each kind of
      layer costs in the engine. `--attention same` keeps the pattern (any GGUF, a teacher's too) and zeroes every
      tensor, so a probe compresses to its metadata for the trip to a GPU machine.
  mask_timer / steps: where a decode step's time goes. `mask_timer` turns on the timer llama.cpp keeps commented out
      around its KQ-mask build (a CPU loop over every KV cell of every sequence, once per step), printed when
      LLAMA_MASK_TIME is set (build_llamacpp.sh does it with MASK_TIMER=1; `device --mask_time` sets the variable);
      `steps` reads the device log: per model, context and parallel count the decode step, the mask's share of it
      and the rest, each against the teacher.

  python benchmarks/serve_llamacpp.py prepare --hybrid runs/hybrid --stage STAGE
  python benchmarks/serve_llamacpp.py device --stage STAGE --build BUILD --out OUT      # on the GPU machine
  python benchmarks/serve_llamacpp.py collect --ours STAGE/ours.json --device_out OUT --shapes JSON --out X.json
  python benchmarks/serve_llamacpp.py steps --device_out OUT --out X.json
  python benchmarks/serve_llamacpp.py bytes --build BUILD --teacher smollm2-135m --hybrid runs/hybrid --stage STAGE \
      --out X.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

PART_BYTES = 50_000_000  # under the 64 MiB a GPU call carries
MIB = 2 ** 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def split_file(path: Path, out_dir: Path) -> list[str]:
    """Cut `path` into PART_BYTES pieces named NAME.partK under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    with open(path, "rb") as f:
        for k, block in enumerate(iter(lambda: f.read(PART_BYTES), b"")):
            name = f"{path.name}.part{k}"
            (out_dir / name).write_bytes(block)
            names.append(name)
    return names


# ----------------------------------------------------------------------------------------------------- prepare

def heldout_text(n_bytes: int) -> str:
    """Held-out documents of the default corpus (the split `convert` measured its held-out perplexity on), joined."""
    from taylor_calibrate.data import CorpusSpec, load_documents, split_documents

    spec = CorpusSpec()
    _, heldout = split_documents(load_documents(spec), spec.heldout_fraction, source=spec.source)
    parts, size = [], 0
    for _, text in heldout:
        parts.append(text)
        size += len(text.encode())
        if size >= n_bytes:
            break
    # llama.cpp's tools drop one trailing newline of a -f file (llama-tokenize keeps it): end without one, so both
    # read the same text
    return "\n\n".join(parts).rstrip("\n")


def token_bytes(tokenizer, ids) -> list[int]:
    """Bytes each token stands for (byte-level BPE: the token's characters through the byte map)."""
    return [len(tokenizer.convert_tokens_to_string([t]).encode()) for t in tokenizer.convert_ids_to_tokens(ids)]


def perplexity_like_llama_cpp(model, ids: list[int], ctx: int, chunks: int, bos: int | None, device="cpu") -> dict:
    """llama-perplexity's scheme: consecutive chunks of `ctx` tokens (BOS in the first slot when the vocabulary adds
    one), the last ctx/2 - 1 predictions of each chunk scored. Returns PPL, the scored token count and the nll sum."""
    import torch

    first, nll, count, scored = ctx // 2, 0.0, 0, []
    n = min(chunks, len(ids) // ctx)
    for i in range(n):
        chunk = list(ids[i * ctx:(i + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        with torch.no_grad():
            logits = model(torch.tensor([chunk], device=device), use_cache=False).logits[0].double()
        logp = torch.log_softmax(logits[first:ctx - 1], -1)
        target = torch.tensor(chunk[first + 1:ctx], device=device)
        nll -= logp.gather(1, target[:, None]).sum().item()
        count += ctx - 1 - first
        scored.extend(range(i * ctx + first + 1, (i + 1) * ctx))
    return {"ppl": math.exp(nll / count), "nll": nll, "tokens": count, "chunks": n, "scored_positions": scored}


def run_prepare(a) -> None:
    import torch

    from taylor_calibrate.export.gguf import export_gguf
    from taylor_calibrate.teacher import embedded_teacher_path, load_tokenizer
    from transformers import AutoModelForCausalLM

    stage = Path(a.stage)
    stage.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    gguf_dir = stage / "hybrid_gguf"
    if not gguf_dir.exists():
        export_gguf(a.hybrid, gguf_dir, ftype="f16")
    if a.f32 and not (stage / "hybrid_f32_gguf").exists():  # the fidelity reference: fp32 weights
        export_gguf(a.hybrid, stage / "hybrid_f32_gguf", ftype="f32")
    hybrid_gguf = gguf_dir / "model.gguf"
    teacher_gguf = Path(a.teacher_gguf) if a.teacher_gguf else embedded_teacher_path()
    text = heldout_text(a.text_bytes)
    (stage / "heldout.txt").write_text(text)
    tok = load_tokenizer(a.hybrid)
    ids = tok(text, add_special_tokens=False).input_ids
    model = AutoModelForCausalLM.from_pretrained(a.hybrid, dtype=torch.float32).eval().to(a.device)
    t = time.perf_counter()
    ppl = perplexity_like_llama_cpp(model, ids, a.ctx, a.chunks, None, a.device)
    nbytes = token_bytes(tok, ids)
    scored_bytes = sum(nbytes[p] for p in ppl.pop("scored_positions"))
    ppl["loss_per_byte"] = ppl["nll"] / scored_bytes
    ppl["scored_bytes"] = scored_bytes
    ppl["seconds"] = time.perf_counter() - t
    prompts, greedy = [], []
    docs = [d for d in text.split("\n\n") if len(d) > 400][:a.prompts]
    for d in docs:
        p_ids = tok(d, add_special_tokens=False).input_ids[:a.prompt_tokens]
        prompt = tok.decode(p_ids)
        p_ids = tok(prompt, add_special_tokens=False).input_ids
        out = model.generate(torch.tensor([p_ids], device=a.device), max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                             do_sample=False)[0, len(p_ids):]
        prompts.append({"text": prompt, "ids": p_ids})
        greedy.append(out.tolist())
    ours = {"hybrid": a.hybrid, "text_ids": ids, "ppl": ppl, "prompts": prompts, "greedy": greedy,
            "ctx": a.ctx, "chunks": a.chunks, "new_tokens": a.new_tokens,
            "hybrid_gguf": {"name": hybrid_gguf.name, "sha256": sha256(hybrid_gguf), "bytes": hybrid_gguf.stat().st_size},
            "teacher_gguf": {"name": teacher_gguf.name, "sha256": sha256(teacher_gguf),
                             "bytes": teacher_gguf.stat().st_size}}
    ours["device"] = a.device
    (stage / "ours.json").write_text(json.dumps(ours))
    print(json.dumps({k: v for k, v in ours.items() if k not in ("text_ids", "prompts", "greedy")}, indent=1))
    if a.split:  # to carry the two GGUFs to a GPU machine in calls of at most 64 MiB
        parts = {"hybrid": split_file(hybrid_gguf, stage / "parts"), "teacher": split_file(teacher_gguf, stage / "parts")}
        print(json.dumps(parts))


# ------------------------------------------------------------------------------------------------------ device

def _run(cmd: list[str], log: Path, timeout: float) -> str:
    """Run a llama.cpp tool; its whole output goes to `log` and is returned."""
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"), "timeout"
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{out}\n# rc={rc} seconds={time.perf_counter() - t:.1f}\n")
    return out


def memory_bytes(log: str) -> dict:
    """KV cache and recurrent-state sizes as llama.cpp prints them when it creates the context (MiB), and its graph's
    node and split counts: a split is a switch between backends, so more splits than the teacher's means some op of
    the hybrid runs on the CPU (llama.cpp's CUDA backend does not take it)."""
    kv = [float(m) for m in re.findall(r"llama_kv_cache: size = +([\d.]+) MiB", log)]
    rs = [float(m) for m in re.findall(r"llama_memory_recurrent: size = +([\d.]+) MiB", log)]
    graph = re.search(r"graph: nodes = (\d+), splits = (\d+)", log)
    return {"kv_bytes": int(sum(kv) * MIB), "recurrent_bytes": int(sum(rs) * MIB),
            "mem_bytes": int((sum(kv) + sum(rs)) * MIB),
            "graph_nodes": int(graph.group(1)) if graph else None, "graph_splits": int(graph.group(2)) if graph else None}


def engine_checks(model: Path, ours: dict, ctx: int, kv_f32: bool) -> dict:
    """Through llama.cpp's own tokeniser and graph (llama-cpp-python's ctypes binding on the built library): the
    held-out text's token ids against ours, and greedy tokens from each prompt's text against our class's."""
    import llama_cpp

    text = (Path(os.environ["SERVE_STAGE"]) / "heldout.txt").read_text()
    kv = {"type_k": 0, "type_v": 0} if kv_f32 else {}  # GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=ctx, n_gpu_layers=-1, verbose=False, seed=0, **kv)
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    out = {"kv_f32": kv_f32, "text_tokens": len(ids), "text_ids_equal": ids == ours["text_ids"],
           "text_first_mismatch": next((i for i, (x, y) in enumerate(zip(ids, ours["text_ids"])) if x != y), None),
           "prompts": []}
    if out["text_first_mismatch"] is not None:
        i = out["text_first_mismatch"]
        out["text_mismatch_pieces"] = [llm.detokenize([t]).decode(errors="replace") for t in ids[max(0, i - 2):i + 3]]
    first = ctx // 2
    n = min(ours["chunks"], len(ids) // ctx)
    scored = [p for i in range(n) for p in range(i * ctx + first + 1, (i + 1) * ctx)]
    out["scored_bytes"] = sum(len(llm.detokenize([ids[p]])) for p in scored)
    out["scored_tokens"] = len(scored)
    for p, want in zip(ours["prompts"], ours["greedy"]):
        p_ids = llm.tokenize(p["text"].encode(), add_bos=False, special=False)
        llm.reset()
        got = []
        for t in llm.generate(p["ids"], temp=0.0, top_k=1, reset=True):  # our prompt ids: greedy alone is compared
            got.append(int(t))
            if len(got) == len(want):
                break
        out["prompts"].append({"prompt_ids_equal": p_ids == p["ids"], "greedy": got,
                               "agree": sum(x == y for x, y in zip(got, want)), "n": len(want),
                               "first_divergence": next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                                                        None)})
    del llm
    return out


def run_device(a) -> None:
    stage, build, out = Path(a.stage), Path(a.build), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["SERVE_STAGE"] = str(stage)
    if a.mask_time:  # a build with mask_timer prints each KQ-mask build's time (the `steps` step reads them)
        os.environ["LLAMA_MASK_TIME"] = "1"
    log = out / "llama_log.txt"
    ours = json.loads((stage / "ours.json").read_text())
    bin_ = build / "bin"
    res_path = out / "device.json"
    res = json.loads(res_path.read_text()) if res_path.exists() else {}

    def save():
        res_path.write_text(json.dumps(res, indent=1))

    models = {"teacher": stage / "teacher_f16.gguf", "hybrid": stage / "hybrid_gguf" / ours["hybrid_gguf"]["name"]}
    hybrid_f32 = stage / "hybrid_f32_gguf" / "model.gguf"
    if not models["teacher"].exists():
        _run([str(bin_ / "llama-quantize"), "--allow-requantize", str(a.teacher_gguf),
              str(models["teacher"]), "F16"], log, 300)
    res["teacher_requantised"] = f"{ours['teacher_gguf']['name']} -> F16 (llama-quantize --allow-requantize)"
    for k in a.probe_attention:  # speed probes: the hybrid's graph with k attention layers (0..k-1), weights copied
        path = stage / f"probe_a{k}.gguf"
        if not path.exists():
            layer_pattern_gguf(models["hybrid"], path, lambda i, k=k: i < k)
        models[f"probe_a{k}"] = path
    if shutil.which("nvidia-smi"):  # a CPU build runs the same steps (probes, a quick check of the script)
        res.setdefault("nvidia_smi", subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                                     "--format=csv,noheader"], capture_output=True, text=True).stdout)
    if "ppl" in a.parts:  # the served setting (f16 weights, f16 KV), then f32 KV, then f32 weights (fidelity)
        res.setdefault("ppl", {})
        variants = [("teacher", models["teacher"], False), ("hybrid", models["hybrid"], False),
                    ("hybrid_kv_f32", models["hybrid"], True), ("hybrid_f32_kv_f32", hybrid_f32, True)]
        for name, path, kv_f32 in variants:
            if name in res["ppl"] or not path.exists():
                continue
            cmd = [str(bin_ / "llama-perplexity"), "-m", str(path), "-f", str(stage / "heldout.txt"),
                   "-c", str(ours["ctx"]), "-b", str(ours["ctx"]), "--chunks", str(ours["chunks"]), "-ngl", "99",
                   "-fa", "on", "--no-escape"] + (["-ctk", "f32", "-ctv", "f32"] if kv_f32 else [])
            text = _run(cmd, log, 300)
            m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", text)
            res["ppl"][name] = {"ppl": float(m.group(1)), "stderr": float(m.group(2)),
                                "command": " ".join(cmd[1:])} if m else None
        save()
    if "checks" in a.parts:
        res.setdefault("checks", {})
        for name, path, kv_f32 in (("hybrid", models["hybrid"], False), ("hybrid_f32_kv_f32", hybrid_f32, True)):
            if name not in res["checks"] and path.exists():
                res["checks"][name] = engine_checks(path, ours, ours["ctx"], kv_f32)
                save()
    if "memory" in a.parts:  # what llama.cpp allocates for each cell's context: KV cells and recurrent states
        res.setdefault("memory", {})
        for ctx in a.contexts:
            for pl in a.parallel:
                for name, path in models.items():
                    key = f"{name}@{ctx}x{pl}"
                    if key in res["memory"]:
                        continue
                    cmd = [str(bin_ / "llama-batched-bench"), "-m", str(path), "-c", str(pl * (ctx + a.gen_tokens)),
                           "-npp", "16", "-ntg", "1", "-npl", str(pl), "-ngl", "99", "-fa", "on", "-lv", "4"]
                    res["memory"][key] = memory_bytes(_run(cmd, log, 120))
                    save()
    res.setdefault("grid", [])
    done = {(g["model"], g["context"]) for g in res["grid"]}
    if "grid" in a.parts:  # one llama-batched-bench per context, all parallel counts; the context holds the largest
        # (each sequence prefills its own copy of the prompt: llama-batched-bench's shared prompt, -pps, fails on
        # Qwen3.5's M-RoPE at the first generated token, "inconsistent sequence positions")
        for ctx in a.contexts:
            for name, path in models.items():
                if (name, ctx) in done:
                    continue
                cmd = [str(bin_ / "llama-batched-bench"), "-m", str(path), "-c", str(max(a.parallel) * (ctx + a.gen_tokens)),
                       "-b", "2048", "-ub", "512", "-npp", str(ctx), "-ntg", str(a.gen_tokens),
                       "-npl", ",".join(map(str, a.parallel)), "-ngl", "99", "-fa", "on", "--output-format", "jsonl"]
                text = _run(cmd, log, a.cell_timeout)
                rows = [json.loads(l) for l in text.splitlines() if l.startswith('{"n_kv_max"')]
                res["grid"].append({"model": name, "context": ctx, "command": " ".join(cmd[1:]), "rows": rows})
                save()
    save()
    print(json.dumps({k: v for k, v in res.items() if k != "checks"}, indent=1)[:6000])


# --------------------------------------------------------------------------------------------- mask_timer, steps

MASK_TIMER = {  # llama.cpp's own commented-out timer around set_input_kq_mask, switched on by an environment variable
    "    //const int64_t t_start = ggml_time_us();\n": "    const int64_t t_start = ggml_time_us();\n",
    "    //const int64_t t_end = ggml_time_us();\n": "    const int64_t t_end = ggml_time_us();\n",
    '    //LLAMA_LOG_ERROR("%s: kq mask time: %0.3f ms\\n", __func__, (t_end - t_start)/1000.0);\n':
        '    static const bool mask_time = getenv("LLAMA_MASK_TIME") != nullptr;\n'
        '    if (mask_time) LLAMA_LOG_ERROR("%s: kq mask time: %0.3f ms n_kv %lld n_tokens %u\\n", __func__, '
        '(t_end - t_start)/1000.0, (long long) n_kv, n_tokens);\n',
}
MASK_LINE = re.compile(r"kq mask time: ([\d.]+) ms n_kv (\d+) n_tokens (\d+)")


def run_mask_timer(a) -> None:
    path = Path(a.src) / "src" / "llama-kv-cache.cpp"
    text = path.read_text()
    if all(new in text for new in MASK_TIMER.values()):
        print(f"{path}: mask timer already on")
        return
    missing = [old.strip() for old in MASK_TIMER if text.count(old) != 1]
    if missing:
        sys.exit(f"error: {path} does not hold llama.cpp's commented-out mask timer ({missing[0]!r}); "
                 "this llama.cpp version needs another patch")
    for old, new in MASK_TIMER.items():
        text = text.replace(old, new)
    path.write_text(text)
    print(f"{path}: mask timer on (prints when LLAMA_MASK_TIME is set)")


def decode_steps(log: str) -> list[dict]:
    """Per llama-batched-bench run in a device log and per parallel count: the decode step (t_tg / tg) and the mean
    KQ-mask build time of its decode steps: the last tg mask lines with n_tokens == the parallel count (the log holds
    the run's stdout, its rows, before its stderr, the mask lines; prefill builds masks for whole micro-batches)."""
    out = []
    for chunk in ("\n" + log).split("\n$ ")[1:]:
        head = chunk.split("\n", 1)[0]
        m = re.search(r"llama-batched-bench -m (\S+)", head)
        if not m:
            continue
        path = Path(m.group(1))  # STAGE/teacher_f16.gguf, STAGE/hybrid_gguf/model.gguf, STAGE/probe_aK.gguf
        model = path.parent.name.removesuffix("_gguf") if path.stem == "model" else path.stem
        masks = [(float(mm.group(1)), int(mm.group(3))) for mm in MASK_LINE.finditer(chunk)]
        for line in chunk.splitlines():
            if not line.startswith('{"n_kv_max"'):
                continue
            r = json.loads(line)
            dec = [ms for ms, n in masks if n == r["pl"]][-r["tg"]:] if r["tg"] else []
            step = 1000 * r["t_tg"] / r["tg"] if r["tg"] else None
            mask = sum(dec) / len(dec) if dec else None
            out.append({"model": model, "context": r["pp"], "parallel": r["pl"], "decode_ms_per_step": step,
                        "mask_ms_per_step": mask, "mask_steps": len(dec),
                        "step_less_mask_ms": step - mask if step is not None and mask is not None else None,
                        "decode_tok_s": r["speed_tg"], "command": head})
    return out


def run_steps(a) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from taylor_calibrate.results import record

    _, logs = _merged(a.device_out)
    rows = decode_steps(logs)
    if not rows:
        sys.exit("error: no llama-batched-bench rows in the device logs; run the device step's grid first")
    teacher = {(r["context"], r["parallel"]): r for r in rows if r["model"].startswith("teacher")}
    for r in rows:
        t = teacher.get((r["context"], r["parallel"]))
        r["speedup"] = t["decode_ms_per_step"] / r["decode_ms_per_step"] if t else None
        r["speedup_less_mask"] = (t["step_less_mask_ms"] / r["step_less_mask_ms"]
                                  if t and t["step_less_mask_ms"] and r["step_less_mask_ms"] else None)
    result = record(a.out, {"engine": "llama.cpp (CUDA) with benchmarks/serve_llamacpp.py's mask_timer", "version":
                            a.engine_version, "rows": rows, "note": a.note}, a, command=a.command)
    print("| model | context | parallel | step ms | mask ms | step - mask ms | x teacher | x teacher, less mask |")
    print("|" + "---|" * 8)
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)
    for r in result["rows"]:
        print(f"| {r['model']} | {r['context']} | {r['parallel']} | {f(r['decode_ms_per_step'])} | "
              f"{f(r['mask_ms_per_step'])} | {f(r['step_less_mask_ms'])} | {f(r['speedup'])} | "
              f"{f(r['speedup_less_mask'])} |")


# ----------------------------------------------------------------------------------------------------- collect

def cache_bytes(shape: dict, cells: int, seqs: int) -> dict:
    """Bytes of the KV cache (f16 K and V for `cells` cells in every attention layer) and of the recurrent state
    (fp32 conv window and delta-rule state per sequence in every GDN layer), as llama.cpp's kv-cache and
    memory-recurrent modules allocate them for a GGUF of this shape."""
    kv = cells * shape["attention_layers"] * 2 * shape["kv_dim"] * 2
    per_seq = shape.get("gdn_layers", 0) * 4 * ((shape.get("conv_kernel", 1) - 1) * shape.get("conv_channels", 0)
                                                 + shape.get("ssm_heads", 0) * shape.get("ssm_dk", 0) * shape.get("ssm_dv", 0))
    return {"kv_bytes": kv, "recurrent_bytes": seqs * per_seq, "mem_bytes": kv + seqs * per_seq}


def _merged(dirs: list[str]) -> tuple[dict, str]:
    """device.json of several device runs, later ones filling what earlier ones lack; their llama logs joined."""
    dev, logs = {}, ""
    for d in dirs:
        part = json.loads((Path(d) / "device.json").read_text())
        for k, v in part.items():
            if v not in (None, [], {}, ""):
                dev[k] = v
        if (Path(d) / "llama_log.txt").exists():
            logs += (Path(d) / "llama_log.txt").read_text(errors="replace")
    return dev, logs


def run_collect(a) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from taylor_calibrate.results import record

    dev, logs = _merged(a.device_out)
    ours = json.loads(Path(a.ours).read_text())
    shapes = json.loads(a.shapes)
    # cells llama.cpp allocated for each memory-pass context (its n_kv_max, rounded up from the -c asked for)
    n_kv = {}
    for m in re.finditer(r"\$ \S*llama-batched-bench -m \S*/(teacher_f16|hybrid_gguf/model)\.gguf -c (\d+) -npp 16 -ntg 1 "
                         r"-npl (\d+).*?n_kv_max = (\d+)", logs, re.S):
        name = "teacher" if m.group(1).startswith("teacher") else "hybrid"
        n_kv[(name, int(m.group(2)), int(m.group(3)))] = int(m.group(4))
    grid = []
    runs = {(g["model"], g["context"]): g for g in dev.get("grid", [])}
    steps = {(r["model"].removesuffix("_f16"), r["context"], r["parallel"]): r for r in decode_steps(logs)}
    for ctx in sorted({g["context"] for g in dev.get("grid", [])}):
        for pl in a.parallel:
            row = {"context": ctx, "parallel": pl}
            for name in ("teacher", "hybrid"):
                r = next((r for r in (runs.get((name, ctx)) or {}).get("rows", []) if r["pl"] == pl), None)
                row[f"{name}_decode_tok_s"] = r["speed_tg"] if r else None
                row[f"{name}_prompt_tok_s"] = r["speed_pp"] if r else None
                # a device step run with --mask_time on a mask_timer build: the CPU mask's share of a decode step
                row[f"{name}_decode_mask_ms"] = (steps.get((name, ctx, pl)) or {}).get("mask_ms_per_step")
                cells = n_kv.get((name, pl * (ctx + a.gen_tokens), pl))
                mem = cache_bytes(shapes[name], cells, pl) if cells else None
                own = dev.get("memory", {}).get(f"{name}@{ctx}x{pl}") or {}
                if own.get("mem_bytes"):  # llama.cpp's own size lines (printed at -lv 4) win over the count
                    mem = {k: own[k] for k in ("mem_bytes", "kv_bytes", "recurrent_bytes")}
                row[f"{name}_mem_bytes"] = mem and mem["mem_bytes"]
                row[f"{name}_kv_bytes"] = mem and mem["kv_bytes"]
                row[f"{name}_recurrent_bytes"] = mem and mem["recurrent_bytes"]
                row[f"{name}_cells"] = cells
            row["decode_speedup"] = (row["hybrid_decode_tok_s"] / row["teacher_decode_tok_s"]
                                     if row["hybrid_decode_tok_s"] and row["teacher_decode_tok_s"] else None)
            row["prompt_speedup"] = (row["hybrid_prompt_tok_s"] / row["teacher_prompt_tok_s"]
                                     if row["hybrid_prompt_tok_s"] and row["teacher_prompt_tok_s"] else None)
            row["mem_ratio"] = (row["hybrid_mem_bytes"] / row["teacher_mem_bytes"]
                                if row["hybrid_mem_bytes"] and row["teacher_mem_bytes"] else None)
            grid.append(row)
    ppl = {k: (v or {}).get("ppl") for k, v in dev.get("ppl", {}).items()}

    def agreement(checks):
        total = sum(p["n"] for p in checks.get("prompts", []))
        return sum(p["agree"] for p in checks.get("prompts", [])) / total if total else None

    checks = dev.get("checks", {})
    served = checks.get("hybrid", {})
    lpb = (served["scored_tokens"] * math.log(ppl["hybrid"]) / served["scored_bytes"]
           if ppl.get("hybrid") and served.get("scored_bytes") else None)
    result = {
        "engine": "llama.cpp (CUDA, sm_90; llama-batched-bench, llama-perplexity, libllama through "
                  "llama-cpp-python's ctypes binding), built by benchmarks/build_llamacpp.sh",
        "version": a.engine_version,
        "device": dev.get("nvidia_smi", "").strip(),
        "hybrid": {"convert": a.convert_command, "gguf": ours["hybrid_gguf"], "note": a.note},
        "teacher_gguf": ours["teacher_gguf"], "teacher_requantised": dev.get("teacher_requantised"),
        "weights": "f16 for both (teacher: its Q4_1 GGUF requantised to F16 by llama-quantize --allow-requantize; "
                   "hybrid: export_gguf(ftype='f16')); KV cache f16 (llama.cpp's default) unless named",
        "ppl": {"teacher": ppl.get("teacher"), "hybrid_engine": ppl.get("hybrid"), "hybrid_ours": ours["ppl"]["ppl"],
                "hybrid_engine_kv_f32": ppl.get("hybrid_kv_f32"),
                "hybrid_engine_f32_weights_kv_f32": ppl.get("hybrid_f32_kv_f32"),
                "hybrid_engine_over_ours": ppl["hybrid"] / ours["ppl"]["ppl"] if ppl.get("hybrid") else None,
                "ctx": ours["ctx"], "chunks": ours["ppl"]["chunks"], "scored_tokens": ours["ppl"]["tokens"],
                "ours_device": ours.get("device"),
                "commands": {k: (v or {}).get("command") for k, v in dev.get("ppl", {}).items()}},
        "loss_per_byte": {"hybrid_engine": lpb, "hybrid_ours": ours["ppl"]["loss_per_byte"],
                          "engine_over_ours": lpb / ours["ppl"]["loss_per_byte"] if lpb else None,
                          "engine_scored_bytes": served.get("scored_bytes"),
                          "ours_scored_bytes": ours["ppl"]["scored_bytes"],
                          "text_ids_equal": served.get("text_ids_equal"),
                          "text_first_mismatch": served.get("text_first_mismatch"),
                          "text_mismatch_pieces": served.get("text_mismatch_pieces")},
        "greedy_agreement": {"f32_weights_f32_kv": agreement(checks.get("hybrid_f32_kv_f32", {})),
                             "f16_weights_f16_kv": agreement(served)},
        "greedy": {"prompts": len(served.get("prompts", [])), "new_tokens": ours["new_tokens"],
                   "note": "llama.cpp generates from our prompt token ids; tokens compared position by position",
                   "per_prompt": {k: [{f: p[f] for f in ("agree", "n", "first_divergence", "prompt_ids_equal")}
                                      for p in c.get("prompts", [])] for k, c in checks.items()}},
        "grid": grid,
        "grid_commands": {f"{g['model']}@{g['context']}": g["command"] for g in dev.get("grid", [])},
        "grid_note": ("-pps: each context's one prompt is prefilled once and copied to every sequence, so prompt tok/s "
                      "is one sequence's prefill; decode is each sequence attending over its own copy"
                      if any("-pps" in g["command"] for g in dev.get("grid", [])) else None),
        "memory_shapes": shapes,
        "graph": {name: sorted({(m.get("graph_nodes"), m.get("graph_splits")) for k, m in dev.get("memory", {}).items()
                                if k.startswith(name + "@") and m.get("graph_splits") is not None})
                  for name in ("teacher", "hybrid")},
        "gen_tokens": a.gen_tokens,
        "probes": {f"{g['model']}@{g['context']}": {"command": g["command"],
                                "rows": [{"parallel": r["pl"], "decode_tok_s": r["speed_tg"], "prompt_tok_s": r["speed_pp"],
                                          "decode_ms_per_step": 1000 * r["t_tg"] / r["tg"]} for r in g["rows"]]}
                   for g in dev.get("grid", []) if g["model"].startswith("probe_")} or None,
        "not_run": a.not_run,
    }
    result = record(a.out, result, a, command=a.command)
    print(json.dumps({k: result[k] for k in ("ppl", "loss_per_byte", "greedy_agreement")}, indent=1))
    print("| context | parallel | teacher decode tok/s | hybrid decode tok/s | x | teacher prompt tok/s | "
          "hybrid prompt tok/s | teacher MiB | hybrid MiB |")
    print("|" + "---|" * 9)
    f = lambda v, spec=".0f": "-" if v is None else format(v, spec)
    for r in grid:
        print(f"| {r['context']} | {r['parallel']} | {f(r['teacher_decode_tok_s'])} | {f(r['hybrid_decode_tok_s'])} | "
              f"{f(r['decode_speedup'], '.2f')} | {f(r['teacher_prompt_tok_s'])} | {f(r['hybrid_prompt_tok_s'])} | "
              f"{f(r['teacher_mem_bytes'] and r['teacher_mem_bytes'] / MIB)} | "
              f"{f(r['hybrid_mem_bytes'] and r['hybrid_mem_bytes'] / MIB)} |")


# ------------------------------------------------------------------------------------------------------- bytes

# llama.cpp's tools read a -f file through escape processing (`\n`, `\t`, `\\` ... become the characters; source code
# is full of them) unless told not to; llama-tokenize also parses special-token text unless told not to, which
# llama-perplexity never does.
RAW_TEXT = ["--no-escape"]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level map, character -> byte (the alphabet byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def gguf_token_bytes(path: Path) -> list[int]:
    """UTF-8 bytes each id of a byte-level BPE GGUF stands for in text (control tokens: 0), from its own token list."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    model = fields.get("tokenizer.ggml.model")
    if model is None or bytes(model.parts[model.data[0]]).decode() != "gpt2":
        raise ValueError(f"{path}: loss per byte is counted here for byte-level BPE GGUFs (tokenizer.ggml.model gpt2)")
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    types = fields["tokenizer.ggml.token_type"]
    types = [int(types.parts[i][0]) for i in types.data]
    dec = _byte_decoder()
    # NORMAL tokens are written in the byte alphabet; USER_DEFINED ones (added tokens) as the text itself
    return [len(bytes(dec[c] for c in t)) if ty == 1 and all(c in dec for c in t) else
            (len(t.encode()) if ty == 4 else 0) for t, ty in zip(tokens, types)]


def llama_tokenize(bin_: Path, model: Path, text_file: Path, bos: bool) -> list[int]:
    """llama.cpp's token ids for the file's text, as llama-perplexity tokenises it (BOS when `bos` and the
    vocabulary adds one, special-token text as text)."""
    cmd = [str(bin_ / "llama-tokenize"), "-m", str(model), "-f", str(text_file), "--ids", "--log-disable",
           "--no-parse-special", *RAW_TEXT] + ([] if bos else ["--no-bos"])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def parse_perplexity(log: str) -> dict:
    """llama-perplexity's result from its log (run with --ppl-output-type 1: one line per chunk with the running
    mean nll to 6 decimals, on stdout): PPL, mean nll and the chunk count. Its closing "Final estimate" line (stderr,
    through an asynchronous logger) is sometimes missing from a short run's output: the rows carry the figure."""
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", log, re.M)
    planned = re.search(r"calculating perplexity over (\d+) chunks", log)
    if not rows or planned is None or len(rows) != int(planned.group(1)):
        raise ValueError("no perplexity (a row for every chunk) in llama-perplexity's output:\n" + log[-3000:])
    final = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)
    mean_nll = float(rows[-1][2])
    return {"ppl": float(final.group(1)) if final else round(math.exp(mean_nll), 4),
            "stderr": float(final.group(2)) if final else None, "mean_nll": mean_nll, "chunks": len(rows)}


_OURS: dict = {}


def loss_per_byte_of(name: str, model, tok, gguf_path: Path, text_file: Path, a, log: Path) -> dict:
    """One model's held-out loss per byte in llama.cpp (its GGUF, its tokenisation) and in ours (the same weights in
    our class, our tokenizer), both scored llama-perplexity's way on the same text file."""
    import torch

    bin_ = Path(a.build) / "bin"
    text = text_file.read_text()
    engine_text_ids = llama_tokenize(bin_, gguf_path, text_file, bos=False)
    engine_ids = llama_tokenize(bin_, gguf_path, text_file, bos=True)
    bos = engine_ids[:len(engine_ids) - len(engine_text_ids)]  # [BOS] when the vocabulary adds one, else []
    ours_ids = bos + tok(text, add_special_tokens=False).input_ids
    first_mismatch = next((i for i, (x, y) in enumerate(zip(engine_ids, ours_ids)) if x != y),
                          None if len(engine_ids) == len(ours_ids) else min(len(engine_ids), len(ours_ids)))
    vocab_bytes = gguf_token_bytes(gguf_path)
    cmd = [str(bin_ / "llama-perplexity"), "-m", str(gguf_path), "-f", str(text_file), "-c", str(a.ctx),
           "-b", str(a.ctx), "--chunks", str(a.chunks), "-t", str(a.threads), "--ppl-output-type", "1", *RAW_TEXT]
    cmd += ["-ctk", a.kv, "-ctv", a.kv]
    t = time.perf_counter()
    engine = parse_perplexity(_run(cmd, log, a.timeout))
    engine["seconds"] = time.perf_counter() - t
    first = a.ctx // 2
    scored = [p for i in range(engine["chunks"]) for p in range(i * a.ctx + first + 1, (i + 1) * a.ctx)]
    engine["scored_tokens"] = len(scored)
    engine["nll"] = engine["mean_nll"] * len(scored)
    engine["scored_bytes"] = sum(vocab_bytes[engine_ids[p]] for p in scored)
    engine["loss_per_byte"] = engine["nll"] / engine["scored_bytes"]
    engine["command"] = " ".join(Path(c).name if i in (0, 2, 4) else c for i, c in enumerate(cmd))
    key = (id(model), tuple(ours_ids))
    if key not in _OURS:  # one model measured against two GGUFs of it (the teacher as shipped and in F32)
        t = time.perf_counter()
        ours = perplexity_like_llama_cpp(model, ours_ids, a.ctx, a.chunks, bos[0] if bos else None)
        nbytes = token_bytes(tok, ours_ids)
        ours["scored_bytes"] = sum(nbytes[p] for p in ours.pop("scored_positions"))
        ours["loss_per_byte"] = ours["nll"] / ours["scored_bytes"]
        ours["seconds"] = time.perf_counter() - t
        _OURS[key] = ours
    ours = _OURS[key]
    out = {"gguf": {"name": gguf_path.name, "sha256": sha256(gguf_path), "bytes": gguf_path.stat().st_size},
           "engine": engine, "ours": ours,
           "engine_over_ours": engine["loss_per_byte"] / ours["loss_per_byte"],
           "text_ids_equal": engine_ids == ours_ids, "engine_tokens": len(engine_ids), "ours_tokens": len(ours_ids),
           "first_mismatch": first_mismatch,
           # every byte of the file in llama.cpp's tokens: what it scored is the text as written
           "engine_token_bytes": sum(vocab_bytes[i] for i in engine_text_ids), "text_bytes": len(text.encode())}
    if first_mismatch is not None:
        i = first_mismatch
        out["mismatch"] = {"engine": tok.convert_ids_to_tokens(engine_ids[max(0, i - 2):i + 3]),
                           "ours": tok.convert_ids_to_tokens(ours_ids[max(0, i - 2):i + 3])}
    print(f"{name}: loss/byte engine {engine['loss_per_byte']:.5f} ours {ours['loss_per_byte']:.5f} "
          f"(x{out['engine_over_ours']:.5f}); ppl engine {engine['ppl']:.4f} ours {ours['ppl']:.4f}; "
          f"ids equal {out['text_ids_equal']}", flush=True)
    return out


def run_bytes(a) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from taylor_calibrate.export.gguf import export_gguf
    from taylor_calibrate.results import record
    from taylor_calibrate.teacher import load_teacher, load_tokenizer, teacher_gguf_path

    if not (a.teacher or a.hybrid):
        raise SystemExit("bytes: pass --teacher, --hybrid or both")
    bin_ = Path(a.build) / "bin"
    missing = [t for t in ("llama-tokenize", "llama-perplexity") if not (bin_ / t).is_file()]
    if missing:
        raise SystemExit(f"bytes: {', '.join(missing)} not in {bin_}; build them with benchmarks/build_llamacpp.sh")
    stage = Path(a.stage)
    stage.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    text_file = stage / "heldout.txt"
    text_file.write_text(heldout_text(a.text_bytes))
    log = stage / "llama_log.txt"
    result = {"engine": "llama.cpp on the CPU (llama-tokenize, llama-perplexity), built by "
                        "benchmarks/build_llamacpp.sh ... cpu", "version": a.engine_version,
              "text": {"source": "the default corpus's held-out split (CorpusSpec())", "bytes": len(
                  text_file.read_text().encode())},
              "ctx": a.ctx, "chunks": a.chunks, "kv": a.kv, "models": {}}
    if a.teacher:
        path = Path(a.teacher_gguf) if a.teacher_gguf else teacher_gguf_path(a.teacher)
        if path is None:
            raise SystemExit(f"bytes: teacher {a.teacher!r} is not a GGUF; pass its GGUF as --teacher_gguf")
        teacher = load_teacher(a.teacher, dtype=torch.float32)
        result["models"]["teacher"] = {"spec": a.teacher, **loss_per_byte_of(
            "teacher", teacher.model, teacher.tokenizer, path, text_file, a, log)}
        if a.teacher_f32:  # the weights our load dequantised to, in fp32 arithmetic: the tokenisation alone differs
            f32 = stage / "teacher_f32.gguf"
            if not f32.exists():
                _run([str(bin_ / "llama-quantize"), "--allow-requantize", str(path), str(f32), "F32"], log, a.timeout)
            if not f32.exists():
                raise SystemExit(f"bytes: llama-quantize did not write {f32}; see {log}")
            result["models"]["teacher_f32"] = {"spec": a.teacher, "requantised": f"{path.name} -> F32 (llama-quantize "
                                               "--allow-requantize)", **loss_per_byte_of(
                "teacher_f32", teacher.model, teacher.tokenizer, f32, text_file, a, log)}
        del teacher
    if a.hybrid:
        path = Path(a.hybrid_gguf) if a.hybrid_gguf else stage / "hybrid_f32_gguf" / "model.gguf"
        if not path.exists():
            export_gguf(a.hybrid, path.parent, ftype="f32")
        model = AutoModelForCausalLM.from_pretrained(a.hybrid, dtype=torch.float32).eval()
        result["models"]["hybrid"] = {"dir": Path(a.hybrid).name, "convert": a.convert_command, **loss_per_byte_of(
            "hybrid", model, load_tokenizer(a.hybrid), path, text_file, a, log)}
    record(a.out, result, a, command=a.command)


# ------------------------------------------------------------------------------------------------------- probe

def rewrite_gguf(r, out: Path, tensors, fields: dict | None = None) -> None:
    """Write `out`: the metadata of the GGUFReader `r` (each key in `fields` given that value, a list of bools) and
    `tensors`, an iterable of (name, data, tensor type)."""
    import gguf

    w = gguf.GGUFWriter(str(out), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if fields and name in fields:
            w.add_key_value(name, fields[name], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)
            continue
        vtype = f.types[0]
        w.add_key_value(name, f.contents(), vtype, f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for name, data, kind in tensors:
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def layer_pattern_gguf(src: Path, out: Path, is_attention) -> int:
    """A speed probe: the hybrid GGUF `src` rewritten with another layer pattern (`is_attention(i)`: layer i attention),
    each layer's mixer tensors copied from the first layer of that kind in `src`. The weights mean nothing; the
    graph is llama.cpp's qwen35 at that pattern, so decode and prefill times say what each kind of layer costs.
    Returns the number of attention layers written."""
    import gguf

    r = gguf.GGUFReader(str(src))
    key = "qwen35.attention.recurrent_layers"
    recurrent = list(r.fields[key].contents())
    attention = [bool(is_attention(i)) for i in range(len(recurrent))]
    donor = {kind: recurrent.index(kind) for kind in (True, False)}  # first GDN layer, first attention layer
    tensors = {t.name: t for t in r.tensors}
    mixer = {True: set(), False: set()}  # per-layer tensor suffixes of each kind (norms and MLP are in every layer)
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.(.+)$", t.name)
        if m:
            mixer[recurrent[int(m.group(1))]].add(m.group(2))
    shared = mixer[True] & mixer[False]
    kept = [(t.name, t.data, t.tensor_type) for t in r.tensors
            if not (m := re.match(r"blk\.(\d+)\.(.+)$", t.name)) or m.group(2) in shared]
    copied = [(f"blk.{i}.{suffix}", tensors[f"blk.{donor[not a]}.{suffix}"].data,
               tensors[f"blk.{donor[not a]}.{suffix}"].tensor_type)
              for i, a in enumerate(attention) for suffix in sorted(mixer[not a] - shared)]
    rewrite_gguf(r, out, kept + copied, {key: [not a for a in attention]})
    return sum(attention)


def zero_gguf(src: Path, out: Path) -> int:
    """`src` with every tensor's bytes zero: same metadata, names, shapes and types. Speed probes only (llama.cpp's
    kernels do not branch on weight values); such a file compresses to its metadata, so it travels to a GPU machine
    in one call. Returns the number of tensors."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(src))
    rewrite_gguf(r, out, ((t.name, np.zeros_like(t.data), t.tensor_type) for t in r.tensors))
    return len(r.tensors)


def run_probe(a) -> None:
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.attention == "same":
        print(f"{out}: {zero_gguf(Path(a.gguf), out)} tensors, every one zero (speed probe)")
        return
    kept = None if a.attention in ("all", "none") else {int(i) for i in a.attention.split(",")}
    k = layer_pattern_gguf(Path(a.gguf), out, lambda i: a.attention == "all" or (kept is not None and i in kept))
    print(f"{out}: {k} attention layers, the rest GDN (speed probe; weights copied)")


def _text_options(parser) -> None:
    """The held-out text and how llama-perplexity cuts it, as both steps that score it take them."""
    parser.add_argument("--text_bytes", type=int, default=400_000)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--chunks", type=int, default=32)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    q = sub.add_parser("prepare")
    q.add_argument("--hybrid", required=True, help="a `convert --target qwen3_5` output directory")
    q.add_argument("--stage", required=True)
    _text_options(q)
    q.add_argument("--prompts", type=int, default=5)
    q.add_argument("--prompt_tokens", type=int, default=64)
    q.add_argument("--new_tokens", type=int, default=64)
    q.add_argument("--threads", type=int, default=2)
    q.add_argument("--device", default="cpu", help="where our class runs (cpu, cuda)")
    q.add_argument("--teacher_gguf", default=None, help="the teacher's GGUF (default: the embedded teacher's)")
    q.add_argument("--f32", action="store_true", help="also export an fp32 GGUF (llama.cpp's fidelity reference)")
    q.add_argument("--split", action="store_true", help="also cut both GGUFs into parts of PART_BYTES")
    d = sub.add_parser("device")
    d.add_argument("--stage", required=True)
    d.add_argument("--build", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--teacher_gguf", required=True)
    d.add_argument("--parts", nargs="+", default=["ppl", "checks", "memory", "grid"])
    for s in (d, sub.add_parser("collect")):
        s.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
        s.add_argument("--parallel", type=int, nargs="+", default=[1, 8, 32])
        s.add_argument("--gen_tokens", type=int, default=128)
    d.add_argument("--cell_timeout", type=float, default=300)
    d.add_argument("--mask_time", action="store_true", help="log llama.cpp's KQ-mask build times (a mask_timer build)")
    d.add_argument("--probe_attention", type=int, nargs="*", default=[],
                   help="also time probes of the hybrid's graph with K attention layers (and the rest GDN; K < layers: "
                        "llama.cpp refuses a qwen35 model without a GDN layer), weights copied (`probe`)")
    c = sub.choices["collect"]
    c.add_argument("--ours", required=True, help="ours.json written by prepare")
    c.add_argument("--device_out", nargs="+", required=True, help="device step output folders (later ones fill in)")
    c.add_argument("--out", required=True)
    c.add_argument("--shapes", required=True, help="JSON: per model, attention_layers, kv_dim, and for a hybrid "
                   "gdn_layers, conv_kernel, conv_channels, ssm_heads, ssm_dk, ssm_dv (memory per cell / sequence)")
    c.add_argument("--engine_version", default="")
    c.add_argument("--convert_command", default="")
    c.add_argument("--command", default=None, help="the command lines that produced the inputs, for the record")
    c.add_argument("--note", default="")
    c.add_argument("--not_run", default="")
    b = sub.add_parser("bytes")
    b.add_argument("--build", required=True, help="llama.cpp build folder (tools under BUILD/bin)")
    b.add_argument("--teacher", default=None, help="a GGUF teacher spec (e.g. smollm2-135m): its GGUF in llama.cpp "
                   "against load_teacher's model and tokenizer")
    b.add_argument("--teacher_gguf", default=None, help="the teacher's GGUF (default: the one --teacher loads)")
    b.add_argument("--teacher_f32", action="store_true", help="also the teacher's GGUF requantised to F32 by "
                   "llama-quantize (needs it in BUILD/bin)")
    b.add_argument("--hybrid", default=None, help="a `convert --target qwen3_5` output directory")
    b.add_argument("--hybrid_gguf", default=None, help="its GGUF (default: exported in fp32 into --stage)")
    b.add_argument("--stage", required=True, help="folder for the text, the export and llama.cpp's log")
    b.add_argument("--out", required=True)
    _text_options(b)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--kv", default="f32", choices=["f32", "f16"], help="llama.cpp's KV cache type")
    b.add_argument("--timeout", type=float, default=3600, help="seconds for one llama-perplexity run")
    b.add_argument("--engine_version", default="")
    b.add_argument("--convert_command", default="")
    b.add_argument("--command", default=None, help="the command lines that produced the inputs, for the record")
    mt = sub.add_parser("mask_timer")
    mt.add_argument("--src", required=True, help="llama.cpp's source folder (patched in place)")
    st = sub.add_parser("steps")
    st.add_argument("--device_out", nargs="+", required=True, help="device step output folders (run with --mask_time)")
    st.add_argument("--out", required=True)
    st.add_argument("--engine_version", default="")
    st.add_argument("--command", default=None, help="the command lines that produced the inputs, for the record")
    st.add_argument("--note", default="")
    pr = sub.add_parser("probe")
    pr.add_argument("--gguf", required=True,
                    help="a hybrid's qwen35 GGUF (export --format gguf); with --attention same, any GGUF")
    pr.add_argument("--attention", required=True, help='"all", "none", the attention layers comma-separated, or '
                    '"same": the GGUF as it is with every tensor zero (compresses to its metadata, for carrying)')
    pr.add_argument("--out", required=True)
    a = p.parse_args(argv)
    {"prepare": run_prepare, "device": run_device, "collect": run_collect, "bytes": run_bytes,
     "probe": run_probe, "mask_timer": run_mask_timer, "steps": run_steps}[a.step](a)


if __name__ == "__main__":
    main()
