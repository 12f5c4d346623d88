"""Peak host memory (RSS) of `taylor-calibrate distill` at token budgets 10x apart: it must not grow with the budget.

Training data are windows of memory-mapped token shards (data.write_tokens), so the budget only sets the number of
steps. The script tokenises the corpus once (`taylor-calibrate tokenize`), builds a tiny random hybrid with the
embedded teacher's tokenizer (its 49K vocabulary), then starts `distill` at each budget as its own process, reads
the process's peak RSS (VmHWM) once it has logged --steps steps, and kills it (the rest of a run repeats those
steps). Prints JSON + a table.

    python benchmarks/distill_memory.py --budgets 10000000,100000000 --out /tmp/distill_memory.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from taylor_calibrate.config import GDNConfig
from taylor_calibrate.checkpoint import save_hybrid
from taylor_calibrate.results import record
from taylor_calibrate.model.hybrid import convert_teacher
from taylor_calibrate.teacher import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def vm_hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cli(*argv) -> list[str]:
    return [sys.executable, "-m", "taylor_calibrate", *argv]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def build(work: Path, tokenizer_spec: str) -> Path:
    """A tiny random llama (2 of 4 layers converted) with the real tokenizer, saved as teacher and hybrid."""
    tok = load_tokenizer(tokenizer_spec)
    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cfg)
    teacher.save_pretrained(work / "teacher")
    tok.save_pretrained(work / "teacher")
    student = convert_teacher(teacher, [1, 3], GDNConfig(), teacher_name=str(work / "teacher"))
    save_hybrid(student, tok, work / "student")
    return work / "student"


def measure(student: Path, tokens: Path, budget: int, a, out: Path) -> dict:
    argv = cli("distill", "--student", str(student), "--out", str(out), "--device", "cpu", "--backend", "torch",
               "--data.source", str(tokens), "--data.seq_len", str(a.seq_len), "--data.eval_seqs", "2",
               "--train.tokens", str(budget), "--train.batch_size", str(a.batch_size), "--train.log_every", "1",
               "--train.eval_every", str(10 ** 9), "--train.save_every", str(10 ** 9), "--eval_batch_size", "2")
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, peak, step = out / "metrics.jsonl", None, 0
    while p.poll() is None and time.perf_counter() - t0 < a.timeout:
        peak = vm_hwm_mb(p.pid) or peak
        if metrics.exists():
            steps = [json.loads(l).get("step", 0) for l in metrics.read_text().splitlines() if '"loss"' in l]
            step = max(steps, default=0)
            if step >= a.steps:
                break
        time.sleep(0.05)
    peak = vm_hwm_mb(p.pid) or peak
    if p.poll() is not None:
        raise RuntimeError(f"distill at budget {budget:,} exited ({p.returncode}) before step {a.steps}: "
                           f"{p.stderr.read()[-2000:]}")
    p.send_signal(signal.SIGKILL)
    p.wait()
    if step < a.steps:
        raise RuntimeError(f"distill at budget {budget:,} logged {step} steps in {a.timeout} s")
    return {"budget_tokens": budget, "steps_logged": step, "peak_rss_mb": peak, "seconds": time.perf_counter() - t0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="10000000,100000000", help="comma list of --train.tokens values")
    ap.add_argument("--corpus", default="builtin", help="--data.source to tokenise")
    ap.add_argument("--tokenizer", default="smollm2-135m", help="whose tokenizer (a teacher spec)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="measure once this many steps are logged")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per distill process")
    ap.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="results JSON (a .md table is written beside it)")
    a = ap.parse_args()
    budgets = [int(float(b)) for b in a.budgets.split(",")]
    work = Path(a.work or tempfile.mkdtemp(prefix="distill_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    student = build(work, a.tokenizer)
    tokens = work / "tokens"
    t0 = time.perf_counter()
    subprocess.run(cli("tokenize", "--model", str(work / "teacher"), "--data.source", a.corpus, "--out", str(tokens)),
                   env=env(), check=True, stdout=subprocess.DEVNULL)
    meta = json.loads((tokens / "tokens.json").read_text())
    rows = [measure(student, tokens, b, a, work / f"run_{b}") for b in budgets]
    base = rows[0]["peak_rss_mb"]
    for r in rows:
        r["vs_first"] = r["peak_rss_mb"] / base
    res = {"what": "peak RSS of distill (tiny random hybrid, real tokenizer, CPU) once it has logged "
                   f"{a.steps} steps, by --train.tokens", "corpus": a.corpus, "corpus_tokens": meta["tokens"],
           "tokenize_s": time.perf_counter() - t0, "rows": rows}
    table = ["| budget (tokens) | steps logged | peak RSS MB | / first |", "|---|---|---|---|"]
    table += [f"| {r['budget_tokens']:,} | {r['steps_logged']} | {r['peak_rss_mb']:.0f} | {r['vs_first']:.3f} |"
              for r in rows]
    print(json.dumps(res, indent=1))
    print("\n".join(table))
    if a.out:
        res = record(a.out, res, a)
        Path(a.out).with_suffix(".md").write_text(res["what"] + "\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
