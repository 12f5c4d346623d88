"""Does phase 2 generalise? Mean per-layer rel-MSE of the converted layers on the calibration rows (what alignment
trains on) and on held-out rows (teacher-forced, the same way), after phase 1 and after alignment, with the hybrid's
held-out perplexity; for a few inits, calibration-set sizes and phase-2 learning-rate factors (--phase2.lr_scale;
`auto`: from the teacher). This is how we found that phase 2 overfitted the 8 / 16 calibration rows the profiles used
to store (docs/decisions.md, "calibration rows"), and that a teacher with smaller attention weights needs smaller
rates ("learning rates across teachers").

    python benchmarks/alignment_generalization.py --calib-seqs 8,64 --inits copy,taylor --device cpu
    python benchmarks/alignment_generalization.py --teacher gemma.gguf --calib-seqs 64 --inits taylor \
        --layers 4,6,10,14,17 --lr-scales 1,0.3,0.1,auto --device cpu
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
    ap.add_argument("--layers", default=None, help="comma-separated layers to convert (default: 3 in 4, uniform)")
    ap.add_argument("--lr-scales", default="auto", help="comma-separated --phase2.lr_scale values; auto: the teacher's")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    prof = load_profile(a.profile)["data"]
    device, backend, teacher = load(a.teacher, a.device)
    model = teacher.model
    n = model.config.num_hidden_layers
    layers = [int(x) for x in a.layers.split(",")] if a.layers else gdn_layers(kept_layers("uniform", n, 4), n)
    scales = [None if s == "auto" else float(s) for s in a.lr_scales.split(",")]
    rows = []
    for calib_seqs in [int(c) for c in a.calib_seqs.split(",")]:
        splits = load_splits(CorpusSpec(), teacher.tokenizer, prof["seq_len"], calib_seqs, prof["eval_seqs"])
        train = TeacherPass.run(model, splits.calib, layers, device, store_far=True)
        held = TeacherPass.run(model, splits.heldout[:a.heldout_rows], layers, device)
        for init, scale in [(i, s) for i in a.inits.split(",") for s in scales]:
            mixers, _ = train.mixers(layers, init, CalibArgs(), GDNConfig(), backend)
            row = {"calib_seqs": calib_seqs, "init": init,
                   "phase1_calib": mean_rel_mse(mixers, train), "phase1_heldout": mean_rel_mse(mixers, held)}
            rep = train.align(mixers, fill_align(AlignArgs(lr_scale=scale), a.profile))
            by_layer = {i: rel_mse(m, held.stats.inputs[i], held.targets[i]) for i, m in mixers.items()}
            row.update(lr_scale=rep["lr_scale"], aligned_calib=mean_rel_mse(mixers, train),
                       aligned_heldout=sum(by_layer.values()) / len(by_layer), aligned_heldout_by_layer=by_layer,
                       aligned_ppl=train.perplexity(mixers, splits.heldout))
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| calibration rows | init | lr scale | rel-MSE calib / held-out after phase 1 | after alignment | "
             "aligned PPL |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['calib_seqs']} | {r['init']} | {r['lr_scale']:g} | {r['phase1_calib']:.3f} / "
                     f"{r['phase1_heldout']:.3f} | {r['aligned_calib']:.3f} / {r['aligned_heldout']:.3f} | "
                     f"{r['aligned_ppl']:.2f} |")
    command = command_line("alignment_generalization.py", a)
    lines += ["", f"Command: `{command}`"]
    print("\n" + "\n".join(lines))
    if a.out:
        record(a.out, {"teacher": a.teacher, "profile": a.profile, "layers": layers, "rows": rows}, a, command=command)


if __name__ == "__main__":
    main()
