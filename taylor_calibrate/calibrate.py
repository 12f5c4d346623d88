"""Phase 1: analytic calibration of each converted layer's mixer from teacher attention statistics (docs/method.md,
"Phase 1: calibration"). The methods are the mixer's own (its spec's `calibrators`; GDN's: copy, zero_gate, paper,
taylor, in model/mixers/gdn/calibrate.py); this module runs one over the converted layers.
"""
from __future__ import annotations

from tqdm.auto import tqdm

from taylor_calibrate.config import CalibArgs
from taylor_calibrate.model.hybrid import converted_heads, make_mixers
from taylor_calibrate.model.mixers import spec_for_options
from taylor_calibrate.stats import TeacherStats, head_columns, head_subset

def calibrated_mixers(teacher, stats: TeacherStats | None, layers, init: str, calib: CalibArgs, options, backend: str,
                      seed: int = 0, kept_groups: dict[int, list[int]] | None = None):
    """Copy-only mixers for `layers` (of the mixer whose options dataclass `options` is; head-wise where
    `kept_groups` keeps some KV groups: the mixer holds the other heads, calibrated from their own statistics), then
    phase 1 with the mixer's calibrator `init`."""
    calibrators = spec_for_options(options).calibrators
    if init not in calibrators:
        raise ValueError(f"calibration method {init!r} is not one of {tuple(calibrators)} for this mixer")
    mixers = make_mixers(teacher, layers, options, seed, kept_groups)
    for m in mixers.values():
        m.backend = backend
    report = {}
    if init != "copy":
        for i, m in tqdm(mixers.items(), desc=f"phase 1 ({init})", leave=False):
            rows = slice(0, calib.fit_rows)
            device = next(m.parameters()).device
            x, y = stats.inputs[i][rows].to(device), stats.head_outputs[i][rows].to(device)
            st, kept = stats.layers[i], (kept_groups or {}).get(i)
            if kept:
                st = head_subset(st, converted_heads(teacher.config, kept))
                y = y[..., head_columns(teacher.config, kept).to(y.device)]
            report[i] = calibrators[init](m, st, x, y, calib)
    return mixers, report
