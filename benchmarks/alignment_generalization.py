"""Does phase 2 generalise? Mean per-layer rel-MSE of the converted layers on the calibration rows (what alignment
trains on) and on held-out rows (teacher-forced, the same way), after phase 1 and after alignment, with the hybrid's
held-out perplexity; for a few inits and calibration-set sizes. This is how we found that phase 2 overfitted the 8 /
16 calibration rows the profiles used to store (docs/decisions.md, "calibration rows").

    python benchmarks/alignment_generalization.py --calib-seqs 8,64 --inits copy,taylor --device cpu
"""
from __future__ import annotations

import argparse
import json

from decisions import command_line, load  # benchmarks/ is the script's directory

from taylor_calibrate.experiments.ablate import TeacherPass
from taylor_calibrate.align import rel_mse
from taylor_calibrate.config import PROFILES, AlignArgs, CalibArgs, GDNConfig, fill_align, load_profile
from taylor_calibrate.config import CorpusSpec
from taylor_calibrate.data import load_splits
from taylor_calibrate.results import record
from taylor_calibrate.policy import gdn_layers, kept_layers


def mean_rel_mse(mixers, tp: TeacherPass) -> float:
    """Mean over the mixers' layers of the teacher-forced rel-MSE on the rows of teacher pass `tp`."""
    return sum(rel_mse(m, tp.stats.inputs[i], tp.targets[i]) for i, m in mixers.items()) / len(mixers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--profile", default="quick", choices=sorted(PROFILES))
    ap.add_argument("--calib-seqs", default="8,64", help="comma-separated calibration-set sizes (rows)")
    ap.add_argument("--inits", default="copy,taylor", help="comma-separated phase-1 methods")
    ap.add_argument("--heldout-rows", type=int, default=8, help="held-out rows for the teacher-forced rel-MSE")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    prof = load_profile(a.profile)["data"]
    device, backend, teacher = load(a.teacher, a.device)
    model = teacher.model
    n = model.config.num_hidden_layers
    layers = gdn_layers(kept_layers("uniform", n, 4), n)
    align = fill_align(AlignArgs(), a.profile)
    rows = []
    for calib_seqs in [int(c) for c in a.calib_seqs.split(",")]:
        splits = load_splits(CorpusSpec(), teacher.tokenizer, prof["seq_len"], calib_seqs, prof["eval_seqs"])
        train = TeacherPass.run(model, splits.calib, layers, device)
        held = TeacherPass.run(model, splits.heldout[:a.heldout_rows], layers, device)
        for init in a.inits.split(","):
            mixers, _ = train.mixers(layers, init, CalibArgs(), GDNConfig(), backend)
            row = {"calib_seqs": calib_seqs, "init": init,
                   "phase1_calib": mean_rel_mse(mixers, train), "phase1_heldout": mean_rel_mse(mixers, held)}
            train.align(mixers, align)
            row.update(aligned_calib=mean_rel_mse(mixers, train), aligned_heldout=mean_rel_mse(mixers, held),
                       aligned_ppl=train.perplexity(mixers, splits.heldout))
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| calibration rows | init | rel-MSE calib / held-out after phase 1 | after alignment | aligned PPL |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['calib_seqs']} | {r['init']} | {r['phase1_calib']:.3f} / {r['phase1_heldout']:.3f} | "
                     f"{r['aligned_calib']:.3f} / {r['aligned_heldout']:.3f} | {r['aligned_ppl']:.2f} |")
    command = command_line("alignment_generalization.py", a)
    lines += ["", f"Command: `{command}`"]
    print("\n" + "\n".join(lines))
    if a.out:
        record(a.out, {"teacher": a.teacher, "profile": a.profile, "layers": layers, "rows": rows}, a, command=command)


if __name__ == "__main__":
    main()
