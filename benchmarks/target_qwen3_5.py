"""What serving costs: our own format against `--target qwen3_5` exported and run in transformers' own class.

Runs, at the same profile and budget: `convert` (our format), `convert --target qwen3_5`, `export --format qwen3_5`,
then `eval --niah` on our hybrid (with the teacher) and on the export (loaded as transformers' Qwen3_5ForCausalLM).
Prints JSON and a table: held-out perplexity of teacher / ours / the export, the export's over ours, NIAH accuracy.

    python benchmarks/target_qwen3_5.py --out benchmarks/results/zero_shot/target_qwen3_5_smollm2_h200.json   # GPU, SmolLM2
    python benchmarks/target_qwen3_5.py --teacher DIR --work /tmp/w --out /tmp/t.json -- --data.source CORPUS ...
Arguments after `--` go to every convert and eval call (data options, --device, ...); --convert-args (one quoted
string) to the two convert calls only (e.g. "--phase2.steps 100").
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from taylor_calibrate.cli import main as cli
from taylor_calibrate.results import record


def run(argv: list[str]) -> None:
    print("$ taylor-calibrate " + " ".join(argv), flush=True)
    if cli(argv) != 0:
        raise SystemExit(f"taylor-calibrate {argv[0]} failed")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--work", default="out/target_qwen3_5", help="directory for the models (must not hold them yet)")
    ap.add_argument("--niah-lengths", default="1024,2048,4096,8192")
    ap.add_argument("--niah-samples", default="20")
    ap.add_argument("--out", default=None, help="JSON path (a .md table is written beside it)")
    ap.add_argument("--policy", default="uniform",
                    help="layer policy of both conversions (the same layers kept: the cost of the format alone; the "
                         "default head-wise conversion has no Qwen3.5 form)")
    ap.add_argument("--convert-args", default="", help="extra arguments of both convert calls (one quoted string)")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    w = Path(a.work)
    niah = ["--niah", "true", "--niah_lengths", f"[{a.niah_lengths}]", "--niah_samples", a.niah_samples]
    conv = ["--policy", a.policy, *shlex.split(a.convert_args), *extra]
    run(["convert", "--teacher", a.teacher, "--out", str(w / "ours"), *conv])
    run(["convert", "--teacher", a.teacher, "--target", "qwen3_5", "--out", str(w / "target"), *conv])
    run(["export", "--model", str(w / "target"), "--format", "qwen3_5", "--out", str(w / "served")])
    run(["eval", "--model", str(w / "ours"), "--teacher", a.teacher, "--out", str(w / "eval_ours"), *niah, *extra])
    run(["eval", "--model", str(w / "served"), "--out", str(w / "eval_served"), *niah, *extra])
    ours = json.loads((w / "eval_ours" / "report.json").read_text())
    served = json.loads((w / "eval_served" / "report.json").read_text())
    target = json.loads((w / "target" / "report.json").read_text())
    res = {"command": "python benchmarks/target_qwen3_5.py " + " ".join(argv),
           "teacher": a.teacher, "teacher_ppl": ours.get("teacher_ppl"), "ours_ppl": ours["model_ppl"],
           "served_ppl": served["model_ppl"], "served_over_ours": served["model_ppl"] / ours["model_ppl"],
           "target_convert_ppl": target["hybrid_ppl"], "kept_layers": target["kept_layers"],
           "phase2_attention": {k: target["phase2_attention"][k] for k in ("mean_rel_mse_before", "mean_rel_mse_after")}
           if target.get("phase2_attention") else None,
           "niah": {"teacher": ours.get("teacher_niah"), "ours": ours.get("niah"), "served": served.get("niah")},
           "eval_tokens": served["eval_tokens"], "args": vars(a), "extra": extra}
    lines = ["| model | held-out PPL |", "|---|---|",
             f"| teacher | {res['teacher_ppl']:.3f} |" if res["teacher_ppl"] else "| teacher | - |",
             f"| ours (HybridForCausalLM) | {res['ours_ppl']:.3f} |",
             f"| --target qwen3_5, exported (transformers' Qwen3_5ForCausalLM) | {res['served_ppl']:.3f} "
             f"({100 * (res['served_over_ours'] - 1):+.1f}% vs ours) |", ""]
    for who, scores in res["niah"].items():
        for task, by_len in (scores or {}).items():
            cells = ", ".join(f"{n}: {'-' if v is None else f'{v:.2f}'}" for n, v in by_len.items())
            lines.append(f"- NIAH {task} ({who}): {cells}")
    if a.out:
        res.update(record(a.out, res, a, command=res["command"]))
        Path(a.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(json.dumps(res, indent=2, default=str))
    print("\n".join(lines))
    return res


if __name__ == "__main__":
    main()
