"""generate() of a teacher and of a hybrid converted from it, as a transformers user runs them: eager (DynamicCache)
and static cache + torch.compile (transformers' own compile of the decode step; on a GPU its default mode captures
CUDA graphs), over a context x batch grid (--grid), greedy. Decode is separated from prefill by timing generate
with 1 and with 1 + --new-tokens new tokens; the compiled hybrid's tokens are checked against its eager ones.

    python benchmarks/generate_speed.py --teacher smollm2-135m --hybrid runs/smollm2 --out generate_speed.json
    python benchmarks/generate_speed.py --tiny --device cpu --teacher TEACHER_DIR --hybrid HYBRID_DIR --out /tmp/g.json
"""
from __future__ import annotations

import json
import statistics

import torch

# perf_common.py sits beside this script (its directory is on sys.path when it runs)
from perf_common import free, mb, measure, ratio, run_benchmark

DEFAULTS = {
    "grid": ("4096x1,4096x8,8000x8,8000x32", "16x1,24x2"),
    "new_tokens": (64, 4),
    "repeats": (3, 1),
    "warmup": (2, 1),
}
"""Flag defaults: (full, --tiny)."""

MODES = ("eager", "compiled")


def compile_config(a):
    """transformers' CompileConfig from the flags (its own defaults where a flag is not given), forced on every
    device: generate compiles by itself on CUDA only."""
    from transformers import CompileConfig

    given = {"backend": a.compile_backend, "mode": a.compile_mode, "fullgraph": a.fullgraph or None}
    config = CompileConfig(**{k: v for k, v in given.items() if v is not None})
    config._compile_all_devices = True
    return config


def generate_kwargs(mode: str, config) -> dict:
    """generate() arguments of a mode: eager on a DynamicCache (compile off), or a StaticCache with the decode step
    compiled by generate itself."""
    if mode == "eager":
        return {"disable_compile": True}
    return {"cache_implementation": "static", "compile_config": config}


@torch.inference_mode()
def generate_row(model, ids, new_tokens: int, mode: str, config, a, device) -> tuple[dict, torch.Tensor]:
    """Time generate with 1 and with 1 + `new_tokens` greedy tokens (--repeats each, medians; --warmup untimed runs
    first, which also compile and capture): the difference is the decode of `new_tokens` steps. Returns the row and
    the generated tokens (B, 1 + new_tokens)."""
    B, T = ids.shape
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **generate_kwargs(mode, config))

    def gen(n):
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)  # min: no early stop at EOS

    for _ in range(a.warmup):
        gen(1 + new_tokens)
    firsts, fulls, peaks, out = [], [], [], None
    for _ in range(a.repeats):
        firsts.append(measure(lambda: gen(1), device)[1])
        out, seconds, peak = measure(lambda: gen(1 + new_tokens), device)
        fulls.append(seconds)
        peaks.append(peak)
    first_s, full_s = statistics.median(firsts), statistics.median(fulls)
    decode_s = full_s - first_s
    row = {"prefill_s": first_s, "generate_s": full_s, "decode_s": decode_s,
           "decode_ms_per_step": 1e3 * decode_s / new_tokens, "decode_tok_s": ratio(B * new_tokens, decode_s),
           "prefill_tok_s": ratio(B * T, first_s), "peak_mb": mb(None if None in peaks else max(peaks))}
    return row, out[:, T:].cpu()


def first_mismatch(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first generated position where any sequence differs between two runs (None: identical)."""
    diff = (a != b).any(0).nonzero()
    return int(diff[0]) if len(diff) else None


def load_models(a, device, dtype):
    """The teacher (a teacher spec) and the hybrid (a `convert` output directory), GDN backend resolved once."""
    from taylor_calibrate.checkpoint import load_model
    from taylor_calibrate.teacher import load_teacher

    teacher = load_teacher(a.teacher, device, dtype).model
    hybrid, _ = load_model(a.hybrid, device, dtype)
    hybrid.requires_grad_(False)
    return teacher, hybrid, hybrid.set_backend(a.gdn_backend)


def part_generate(a, device, dtype, res, save):
    """One row per --grid cell: decode tok/s of teacher and hybrid, eager and compiled, their ratios, and whether
    each model's compiled tokens equal its eager ones."""
    teacher, hybrid, backend = load_models(a, device, dtype)
    config = compile_config(a)
    plain = {k: v if isinstance(v, (str, bool, type(None))) else str(v) for k, v in config.to_dict().items()}
    models = {"teacher": teacher, "hybrid": hybrid}
    vocab = min(teacher.config.vocab_size, hybrid.config.vocab_size)
    detail = res.setdefault("generate", {})
    detail.update(teacher=a.teacher, hybrid=a.hybrid, hybrid_teacher=hybrid.config.teacher_name,
                  gdn_layers=len(hybrid.config.gdn_layers), layers=hybrid.config.num_hidden_layers,
                  headwise_layers=len(hybrid.config.attention_heads or {}), gdn_backend=backend,
                  dtype=str(dtype).replace("torch.", ""), new_tokens=a.new_tokens, repeats=a.repeats,
                  warmup=a.warmup, compile=plain, rows={})
    cells = [tuple(int(x) for x in cell.split("x")) for cell in a.grid.split(",")]
    limit = min(m.config.max_position_embeddings for m in models.values())
    if too_long := [f"{c}x{b}" for c, b in cells if c + 1 + a.new_tokens > limit]:
        raise SystemExit(f"--grid {','.join(too_long)}: context + {1 + a.new_tokens} new tokens exceeds the models' "
                         f"max_position_embeddings ({limit}); use contexts up to {limit - 1 - a.new_tokens}")
    for ctx, B in cells:
        cell = f"{ctx}x{B}"
        ids = torch.randint(0, vocab, (B, ctx), generator=torch.Generator().manual_seed(ctx + B)).to(device)
        rows = {}
        for name, model in models.items():
            rows[name], tokens = {}, {}
            for mode in MODES:
                try:
                    rows[name][mode], tokens[mode] = generate_row(model, ids, a.new_tokens, mode, config, a, device)
                except RuntimeError as e:  # out of memory, or a compile failure
                    rows[name][mode] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                free(device)
            if len(tokens) == len(MODES):
                rows[name]["compiled_first_mismatch"] = first_mismatch(tokens["eager"], tokens["compiled"])
                rows[name]["compiled_tokens_equal"] = rows[name]["compiled_first_mismatch"] is None
            rows[name]["compiled_over_eager"] = ratio(rows[name]["compiled"].get("decode_tok_s"),
                                                      rows[name]["eager"].get("decode_tok_s"))
        rows["hybrid_over_teacher"] = {mode: ratio(rows["hybrid"][mode].get("decode_tok_s"),
                                                   rows["teacher"][mode].get("decode_tok_s")) for mode in MODES}
        detail["rows"][cell] = rows
        res.setdefault("generate_hybrid_over_teacher", {})[cell] = rows["hybrid_over_teacher"]
        res["hybrid_compiled_tokens_equal"] = all(r["hybrid"].get("compiled_tokens_equal", False)
                                                  for r in detail["rows"].values())
        print(f"[generate] {cell}: " + json.dumps(rows), flush=True)
        save()
        del ids
    del models, teacher, hybrid
    free(device)


def add_arguments(ap):
    ap.add_argument("--teacher", default="smollm2-135m", help="teacher spec (as convert's --teacher)")
    ap.add_argument("--hybrid", required=True, help="a hybrid directory written by convert (of that teacher)")
    ap.add_argument("--gdn-backend", default="auto", choices=("auto", "torch", "fla"))
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default: CompileConfig's)")
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode (default: CompileConfig's); 'default' "
                    "for a backend other than inductor")
    ap.add_argument("--fullgraph", action="store_true", help="compile the decode step as one graph (a break fails)")


def main(argv=None):
    return run_benchmark("generate_speed", __doc__, part_generate, DEFAULTS, add_arguments, argv,
                         weights="the teacher's and the hybrid's own weights")


if __name__ == "__main__":
    main()
