"""Distillation of one teacher's hybrid with the full-logits loss (`--train.head logits`, the path before the fused
one) against the fused loss (`--train.head fused`: no tokens x vocabulary logits), in one run: tokens/s, MFU, peak
GPU memory, and both loss curves over the same steps (same initial student, same rows), with their max difference.

The teacher: --teacher, a spec as `convert --teacher` takes it (default the embedded SmolLM2-135M; a .gguf path such
as Gemma 3 270M's, an HF directory). The hybrid: --student DIR (a `convert` output), or converted here by `convert`
with --convert's flags (default: head-wise at 25% of the KV bytes, copy-only mixers, no phase 2 and little data, as
throughput does not depend on the init). Training rows: --source through the token cache (`data.distill_data`).
Each path runs `distill.distill` as the distill command does (fp32 master weights, bf16 autocast, torch.compile on
CUDA by default); the first step (compilation) is untimed. A path that runs out of memory is recorded as such.
--attentions sdpa,flex_attention runs each path with each (`--train.attention`; flex_vs_sdpa in the comparison).
--tiny: a tiny random Llama, its copy-only hybrid and random rows (CPU is fine), to check the script. The JSON is
rewritten after every path; a markdown twin goes beside it.

    python benchmarks/distill_throughput.py --out benchmarks/results/performance/distill_fused_smollm2_h200.json
    python benchmarks/distill_throughput.py --teacher /models/gemma-3-270m-Q4_K_M.gguf --seq-len 4096 \\
        --batch-size 16 --micro 4 --out benchmarks/results/performance/distill_fused_gemma3_h200.json
    python benchmarks/distill_throughput.py --tiny --device cpu --out /tmp/distill_throughput_tiny.json
"""
from __future__ import annotations

import argparse
import copy
import gzip
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from perf_common import build_teacher, fmt, free, kernels_table, print_profile, top_ops, trace_kernels

from taylor_calibrate.config import DataArgs, GDNConfig, LOSS_HEADS, TrainArgs
from taylor_calibrate.distill import distill
from taylor_calibrate.ops import LOSS_BACKENDS, resolve_loss_backend
from taylor_calibrate.results import record
from taylor_calibrate.teacher import DEFAULT_TEACHER, resolve_device
from taylor_calibrate.training import resolve_attention

CONVERT = "--policy heads --kv_budget 0.25 --init copy --align false --probe_samples 2 --data.seq_len 256 " \
          "--data.calib_seqs 4 --data.eval_seqs 2"


def models(a, device, dtype) -> tuple:
    """(student in fp32, teacher, rows, held-out rows, what they are)."""
    B, T, steps = a.batch_size, a.seq_len, a.steps
    if a.tiny:
        from taylor_calibrate.model.hybrid import convert_teacher
        from taylor_calibrate.policy import gdn_layers, kept_layers

        teacher = build_teacher("smollm2", True, device, dtype)
        n = teacher.config.num_hidden_layers
        student = convert_teacher(teacher, gdn_layers(kept_layers("uniform", n, 4), n), GDNConfig())
        g = torch.Generator().manual_seed(0)
        rows = torch.randint(0, teacher.config.vocab_size, (B * steps, T), generator=g)
        return student.float(), teacher, rows, rows[:a.eval_rows], {"teacher": "tiny random llama", "rows": "random"}
    from taylor_calibrate.data import distill_data
    from taylor_calibrate.teacher import load_teacher

    t0 = time.perf_counter()
    loaded = load_teacher(a.teacher, device, dtype)
    what = {"teacher": a.teacher, "vocab": loaded.model.config.vocab_size, "load_teacher_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    if a.student:
        from taylor_calibrate.checkpoint import load_model

        student, _ = load_model(a.student, device, torch.float32)
        what["student"] = a.student
    else:
        from taylor_calibrate.config import ConvertArgs, parse_args_of
        from taylor_calibrate.convert import convert, resolve_runtime

        conv_args = parse_args_of(ConvertArgs, ["--teacher", a.teacher, "--device", device.type,
                                                "--backend", a.backend, *shlex.split(a.convert)])
        conv = convert(conv_args, loaded, resolve_runtime(conv_args))
        student = conv.hybrid.float()
        what.update(convert=a.convert, policy=conv.report["policy"], gdn_layers=conv.report["gdn_layers"],
                    headwise_kept_groups=conv.report["headwise_kept_groups"], kv_fraction=conv.report.get("kv_fraction"))
    what["student_s"] = time.perf_counter() - t0
    student.set_backend(a.backend)
    t0 = time.perf_counter()
    rows, heldout = distill_data(DataArgs(source=a.source, seq_len=T, eval_seqs=a.eval_rows), loaded.tokenizer,
                                 B * T * steps)
    what.update(rows=f"{a.source} ({rows.root})", data_s=time.perf_counter() - t0)
    return student, loaded.model, rows, heldout, what


PROFILE_WAIT, PROFILE_STEPS = 3, 3  # profiled: after step 0's evaluation, two steps and one warm-up step


def run_path(head: str, student0, teacher, rows, heldout, a, device, prof=None, loss_kernel: str = "auto",
             attention: str = "auto") -> dict:
    """`distill` of a fresh copy of the student with the loss path `head`: throughput, peak memory, loss curve.
    `prof` (a torch.profiler schedule) steps at each optimizer step, so it sees whole steady steps only."""
    B, T, steps = a.batch_size, a.seq_len, a.steps
    micro = min(a.micro, B)
    args = TrainArgs(tokens=B * T * steps, batch_size=B, micro_batch_size=micro, train=a.train, head=head,
                     kl_chunk=a.kl_chunk, loss_kernel=loss_kernel, attention=attention, eval_every=10 ** 9,
                     save_every=10 ** 9,
                     log_every=1, compile=a.compile)
    row = {"head": head, "loss_kernel": resolve_loss_backend(loss_kernel, device),
           "attention": resolve_attention(attention, student0.config, T, device), "micro_batch": micro, "batch": B,
           "seq_len": T, "kl_chunk": a.kl_chunk}
    student = copy.deepcopy(student0)
    torch._dynamo.reset()  # each path compiles afresh (in its untimed first step), not within the other's graph budget
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ends = []  # wall clock at the end of every optimizer step (on_step is outside distill's timed window)

    def on_step(step, _):
        if device.type == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
        if prof is not None:
            prof.step()

    try:
        with tempfile.TemporaryDirectory() as tmp:
            rep = distill(student, teacher, rows, heldout, args, tmp, resume=False, eval_batch_size=a.eval_rows,
                          desc=f"{head} micro {micro}", on_step=on_step)
            metrics = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        row.update({k: rep[k] for k in ("steps", "tokens_per_step", "tokens_per_s", "flops_per_token", "mfu",
                                        "first_step_s")})
        step_s = [b - e for e, b in zip(ends[1:], ends[2:])]  # steps 2.. (ends[0] is step 0's evaluation)
        row.update(timed_steps=steps - 1, heldout_kl=rep["heldout_kl"], step_s=step_s,
                   median_step_tokens_per_s=rep["tokens_per_step"] / statistics.median(step_s) if step_s else None,
                   loss=[r["loss"] for r in metrics if "lr" in r])  # training records
    except torch.OutOfMemoryError:
        row["oom"] = True
    row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None
    del student
    free(device)
    return row


def _curve_gap(a: dict, b: dict) -> dict:
    diffs = [abs(x - y) for x, y in zip(a["loss"], b["loss"])]
    rel = [d / abs(x) for d, x in zip(diffs, a["loss"]) if x]
    return {"steps": len(diffs), "max_abs_loss_diff": max(diffs), "max_rel_loss_diff": max(rel, default=None),
            "final_loss_diff": b["loss"][-1] - a["loss"][-1]}


def compare(rows: list[dict]) -> dict | None:
    """The fused loss curve against the full-logits one, step by step (the first run of each); the fused path's
    Triton loss kernel against its compiled PyTorch reference (`triton_vs_torch`). A path run twice with the same
    kernel (`--heads logits,fused,logits`) gives the run-to-run gap of the same loss, the floor the other gaps are read
    against: on a GPU the kernels are not bitwise deterministic and training amplifies their noise."""
    done = [r for r in rows if r.get("loss")]
    by, out = {}, {}
    for r in done:
        by.setdefault((r["head"], r["loss_kernel"], r.get("attention")), r)
    first = {}
    for r in done:
        first.setdefault(r["head"], r)
    if {"logits", "fused"} <= set(first):
        a, b = first["logits"], first["fused"]
        out.update(**_curve_gap(a, b), final_loss={"logits": a["loss"][-1], "fused": b["loss"][-1]},
                   final_heldout_kl={"logits": a["heldout_kl"][-1], "fused": b["heldout_kl"][-1]})
        if a.get("tokens_per_s") and b.get("tokens_per_s"):
            out["speedup"] = b["tokens_per_s"] / a["tokens_per_s"]
        if a.get("peak_mem_gb") and b.get("peak_mem_gb"):
            out["peak_mem_ratio"] = b["peak_mem_gb"] / a["peak_mem_gb"]
    again = next((r for r in done if r is not by[r["head"], r["loss_kernel"], r.get("attention")]), None)
    if again is not None:
        first_of = by[again["head"], again["loss_kernel"], again.get("attention")]
        out["same_path_rerun"] = {"head": again["head"], **_curve_gap(first_of, again)}
    pick = {(k[0], k[1]): r for k, r in reversed(by.items())}  # (head, kernel): its first row
    torch_, triton_ = pick.get(("fused", "torch")), pick.get(("fused", "triton"))
    if torch_ and triton_:
        out["triton_vs_torch"] = _curve_gap(torch_, triton_)
        if torch_.get("tokens_per_s") and triton_.get("tokens_per_s"):
            out["triton_kernel_speedup"] = triton_["tokens_per_s"] / torch_["tokens_per_s"]
    attn = {k[2]: r for k, r in reversed(by.items())}
    if {"sdpa", "flex_attention"} <= set(attn):
        sdpa, flex = attn["sdpa"], attn["flex_attention"]
        out["flex_vs_sdpa"] = _curve_gap(sdpa, flex)
        if sdpa.get("tokens_per_s") and flex.get("tokens_per_s"):
            out["flex_speedup"] = flex["tokens_per_s"] / sdpa["tokens_per_s"]
    return out or None


def table(res: dict) -> str:
    out = ["| loss path | loss kernel | attention | micro-batch | tokens/step | tokens/s | median-step tokens/s | MFU | peak GB | "
           "first step s | step 2 s | first -> last loss |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        tps = "OOM" if r.get("oom") else f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        gb = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") is not None else "-"
        loss = f"{r['loss'][0]:.4f} -> {r['loss'][-1]:.4f}" if r.get("loss") else "-"
        med = f"{r['median_step_tokens_per_s']:,.0f}" if r.get("median_step_tokens_per_s") else "-"
        first = fmt(r.get("first_step_s"), ".1f")
        second = fmt(r["step_s"][0], ".2f") if r.get("step_s") else "-"
        out.append(f"| {r['head']} | {r.get('loss_kernel', '-')} | {r.get('attention', 'sdpa')} | {r['micro_batch']} x {r['seq_len']} | {r['batch'] * r['seq_len']:,} | {tps} | "
                   f"{med} | {mfu} | {gb} | {first} | {second} | {loss} |")
    c = res.get("comparison") or {}
    if "max_abs_loss_diff" in c:
        extra = "".join(f", {k.replace('_', ' ')} {c[k]:.2f}x" for k in ("speedup", "peak_mem_ratio") if k in c)
        out += ["", f"Loss curves over {c['steps']} steps: max |fused - logits| = {c['max_abs_loss_diff']:.2e} "
                    f"(relative {c['max_rel_loss_diff']:.2e}){extra}."]
    if "triton_vs_torch" in c:
        r, sp = c["triton_vs_torch"], c.get("triton_kernel_speedup")
        out += ["", f"The fused path's loss kernel, Triton against compiled PyTorch, over {r['steps']} steps: max "
                    f"|difference| = {r['max_abs_loss_diff']:.2e}, final loss {r['final_loss_diff']:+.4f}"
                    + (f", speedup {sp:.2f}x." if sp else ".")]
    if "flex_vs_sdpa" in c:
        r, sp = c["flex_vs_sdpa"], c.get("flex_speedup")
        out += ["", f"flex_attention against sdpa over {r['steps']} steps: max |difference| = "
                    f"{r['max_abs_loss_diff']:.2e}, final loss {r['final_loss_diff']:+.4f}"
                    + (f", speedup {sp:.2f}x." if sp else ".")]
    if "same_path_rerun" in c:
        r = c["same_path_rerun"]
        out.append(f"The same path ({r['head']}) run again: max |difference| = {r['max_abs_loss_diff']:.2e}, final "
                   f"loss {r['final_loss_diff']:+.4f}.")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="teacher spec (as `convert --teacher`): .gguf, HF dir")
    ap.add_argument("--student", default=None, help="a `convert` output directory (default: convert here)")
    ap.add_argument("--convert", default=CONVERT, help="`convert` flags for the hybrid built here")
    ap.add_argument("--source", default="builtin", help="training text (--data.source), through the token cache")
    ap.add_argument("--heads", default="logits,fused",
                    help="loss paths to run, in order; a path named twice measures the run-to-run noise floor")
    ap.add_argument("--batch-size", type=int, default=32, help="rows per optimizer step")
    ap.add_argument("--micro", type=int, default=32, help="rows per forward pass (micro-batch)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per path (the first is untimed)")
    ap.add_argument("--kl-chunk", type=int, default=TrainArgs.kl_chunk, help="tokens per chunk of the loss")
    ap.add_argument("--loss-kernels", default="auto",
                    help=f"--train.loss_kernel values ({', '.join(LOSS_BACKENDS)}) to run each path with, in order")
    ap.add_argument("--attentions", default="auto",
                    help="comma list of --train.attention values, each a run of every path (auto, sdpa, flex_attention)")
    ap.add_argument("--train", default="mixers", help="which parameters train (--train.train)")
    ap.add_argument("--eval-rows", type=int, default=2, help="held-out rows evaluated at the start and the end")
    ap.add_argument("--compile", default="auto", choices=("auto", "true", "false"))
    ap.add_argument("--backend", default="auto", help="GDN kernels: auto, torch, fla")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--profile", action="store_true",
                    help="then a short run of the last path with its steady steps 4-6 under torch.profiler (top ops)")
    ap.add_argument("--trace", default=None, help="with --profile: keep its chrome trace here (gzipped JSON)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model and rows (CPU check of the script)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = resolve_device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a.compile = None if a.compile == "auto" else a.compile == "true"
    if a.tiny:
        a.batch_size, a.micro, a.seq_len, a.steps = min(a.batch_size, 4), min(a.micro, 2), min(a.seq_len, 32), \
            min(a.steps, 4)
    heads = a.heads.split(",")
    if set(heads) - set(LOSS_HEADS):
        ap.error(f"--heads: each of {LOSS_HEADS}")
    student, teacher, rows, heldout, what = models(a, device, dtype)
    res = {"what": " ".join(__doc__.split("\n\n")[0].split()), "models": what, "rows": []}

    def save():
        if a.out:
            res.update(record(a.out, res, a))
            Path(a.out).with_suffix(".md").write_text(f"{res['what']}\n\n{json.dumps(what)}\n\n{table(res)}\n\n"
                                                      f"Command: `{res['command']}` at {res['commit']}\n")

    for head in heads:
        for kernel in a.loss_kernels.split(","):
            for attention in a.attentions.split(","):
                row = run_path(head, student, teacher, rows, heldout, a, device, loss_kernel=kernel,
                               attention=attention)
                print(json.dumps({k: v for k, v in row.items() if k != "loss"}), flush=True)
                res["rows"].append(row)
                res["comparison"] = compare(res["rows"])
                save()
    print(json.dumps(res, indent=1))
    print(table(res))
    if a.profile:  # a run of its own: the profiler's overhead stays out of the timed paths
        a.steps = PROFILE_WAIT + 1 + PROFILE_STEPS + 1  # the run's last step and final evaluation stay outside too
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                         if device.type == "cuda" else [])
        sched = torch.profiler.schedule(wait=PROFILE_WAIT, warmup=1, active=PROFILE_STEPS, repeat=1)
        with torch.profiler.profile(activities=acts, schedule=sched, record_shapes=True) as prof:
            run_path(heads[-1], student, teacher, rows, heldout, a, device, prof, a.loss_kernels.split(",")[-1],
                     a.attentions.split(",")[-1])
        print_profile(prof, device)
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            trace = Path(f"{tmp}/trace.json").read_bytes()
        if a.trace:
            Path(a.trace).write_bytes(gzip.compress(trace))
        kernels = trace_kernels(json.loads(trace))
        print(kernels_table(kernels), flush=True)
        res["profile"] = {"head": heads[-1], "steps": PROFILE_STEPS, "unit": "self device ms and calls per step",
                          "ops": top_ops(prof, PROFILE_STEPS), "by_shape": top_ops(prof, PROFILE_STEPS, by_shape=True),
                          "kernels": kernels}
        save()

if __name__ == "__main__":
    sys.exit(main())
