"""Does the default conversion keep the teacher's retrieval? Read from the committed H200 results (no model is run):
NIAH accuracy of every task at every length, for the teacher, the default conversion zero-shot and after the
end-to-end phase (each the mean over its runs), against 0.9x the teacher's; and multikey at 8K over the
five NIAH prompt seeds both were scored on. Prints a markdown table (`--json`: the numbers), draws the curves.

    python benchmarks/retrieval_by_length.py --out docs/retrieval_by_length_smollm2.png

The runs are the `apart` entries below (docs/decisions.md, "Open", says how each was made); every run is scored on
NIAH seed 0's prompts, 20 a cell.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "retrieval_smollm2.json"
RATIO = 0.9  # the goal: every cell at least this fraction of the teacher's accuracy
# (apart entry, path to a run's niah) of each run; conversion seeds 0 / 1 / 2, and seed 0 again
ZERO_SHOT = [("sharpness_lr_seed_0", "rows.zero_shot"), ("default_seeds", "seeds.1.zero_shot"),
             ("default_seeds", "seeds.2.zero_shot")]
PHASE = [("sharpness_lr_seed_0", "rows.e2e_4096_lr_1e-3"), ("default_seeds", "seeds.1.e2e_4096"),
         ("default_seeds", "seeds.2.e2e_4096"), ("phase_multikey_8k_seeds", "rows.plain")]
TEACHER = ("default_seeds", "teacher")
SEEDS = "phase_multikey_8k_seeds"  # the phase and the teacher on multikey 8K over NIAH seeds 0-4


def _at(entry: dict, path: str) -> dict:
    for key in path.split("."):
        entry = entry[key]
    return entry


def _mean(grids: list[dict]) -> dict:
    return {t: {n: sum(g[t][n] for g in grids) / len(grids) for n in grids[0][t]} for t in grids[0]}


def summary(result: dict) -> dict:
    """Teacher, zero-shot mean and phase mean per task and length, the goal (RATIO x teacher), and multikey 8K over
    the prompt seeds (prompts right, pooled)."""
    apart = result["apart"]
    teacher = _at(apart[TEACHER[0]], TEACHER[1])["niah"]
    zero = _mean([_at(apart[e], p)["niah"] for e, p in ZERO_SHOT])
    phase = _mean([_at(apart[e], p)["niah"] for e, p in PHASE])
    cells = {t: {n: {"teacher": teacher[t][n], "goal": RATIO * teacher[t][n], "zero_shot": zero[t][n],
                     "phase": phase[t][n], "phase_met": phase[t][n] >= RATIO * teacher[t][n] - 1e-9}
                 for n in teacher[t]} for t in teacher}
    plain = apart[SEEDS]["rows"]["plain"]
    pooled = plain["multikey_8k_pooled"]
    return {"cells": cells, "zero_shot_runs": len(ZERO_SHOT), "phase_runs": len(PHASE),
            "kv_fraction": apart[SEEDS]["convert"]["kv_fraction"], "phase_tokens": plain["distill"]["tokens"],
            "multikey_8192_seeds_0_4": {"teacher_right": pooled["teacher_right"], "phase_right": pooled["right"],
                                        "prompts": pooled["prompts"],
                                        "phase_met": pooled["right"] >= RATIO * pooled["teacher_right"]}}


def markdown(s: dict) -> str:
    lines = [f"| task | length | teacher | goal ({RATIO}x) | zero-shot mean | after the phase, mean | met |",
             "|---|---|---|---|---|---|---|"]
    for t, by_len in s["cells"].items():
        for n, c in by_len.items():
            lines.append(f"| {t} | {n} | {c['teacher']:.2f} | {c['goal']:.3f} | {c['zero_shot']:.3f} | "
                         f"{c['phase']:.3f} | {'yes' if c['phase_met'] else 'no'} |")
    m = s["multikey_8192_seeds_0_4"]
    lines.append(f"\nZero-shot: mean of {s['zero_shot_runs']} runs; after the phase: mean of {s['phase_runs']}; "
                 f"NIAH seed 0, 20 prompts a cell. Multikey 8K over NIAH seeds 0-4 ({m['prompts']} prompts): after "
                 f"the phase {m['phase_right']} right, teacher {m['teacher_right']} "
                 f"({m['phase_right'] / m['teacher_right']:.2f}x; met: {'yes' if m['phase_met'] else 'no'}).")
    return "\n".join(lines)


def plot(s: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(s["cells"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4.4), sharey=True)
    for ax, t in zip(axes, tasks):
        lengths = list(s["cells"][t])
        x = [int(n) for n in lengths]
        phase = f"+ {s['phase_tokens'] / 1e6:.0f}M-token phase (mean of {s['phase_runs']})"
        for key, style, label in (("teacher", "k-o", "teacher"), ("goal", "k:", f"{RATIO}x teacher"),
                                  ("zero_shot", "C0-o", f"zero-shot (mean of {s['zero_shot_runs']})"),
                                  ("phase", "C1-s", phase)):
            ax.plot(x, [s["cells"][t][n][key] for n in lengths], style, label=label)
        if t == "multikey":
            m = s["multikey_8192_seeds_0_4"]
            ax.plot([8192], [m["teacher_right"] / m["prompts"]], "kD", mfc="none", ms=8,
                    label=f"teacher, seeds 0-4 ({m['prompts']} prompts)")
            ax.plot([8192], [m["phase_right"] / m["prompts"]], "C1D", mfc="none", ms=8,
                    label=f"+ phase, seeds 0-4 ({m['prompts']} prompts)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{n // 1024}K" for n in x])
        ax.set(title=t, xlabel="prompt length (tokens)", ylim=(-0.03, 1.05))
    axes[0].set_ylabel("NIAH accuracy")
    handles, labels = axes[tasks.index("multikey") if "multikey" in tasks else 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"Default conversion ({s['kv_fraction']:.1%} of the KV cache kept): needle retrieval by prompt length")
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the retrieval results file")
    ap.add_argument("--out", type=Path, help="PNG to write (the figure's curves are the table's columns)")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON too")
    args = ap.parse_args(argv)
    s = summary(json.loads(args.results.read_text()))
    print(markdown(s))
    if args.json:
        print(json.dumps(s, indent=1))
    if args.out:
        plot(s, args.out)
    return s


if __name__ == "__main__":
    main()
