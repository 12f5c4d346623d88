"""benchmarks/perf_*.py end to end on tiny shapes (CPU): every benchmark runs, its JSON has the keys its claims rest
on, every measured number is finite, and the markdown rendering is written beside it."""
import json
import math

import pytest

from conftest import load_benchmark

pytestmark = pytest.mark.usefixtures("single_thread")


def _run(name: str, tmp_path, *extra) -> dict:
    mod = load_benchmark(name)
    out = tmp_path / f"{name}.json"
    mod.main(["--tiny", "--device", "cpu", "--out", str(out), *extra])
    res = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().startswith("# taylor-calibrate performance")
    for key in ("command", "env", "wall_s"):
        assert key in res, key
    for path, v in _numbers({k: v for k, v in res.items() if k != "env"}):
        assert math.isfinite(v), path
    return res


def _numbers(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, x


def test_stats(tmp_path):
    res = _run("perf_stats", tmp_path)
    assert set(res["stats_vs_forward"]) == {"64"} and set(res["stats_peak_mem_mb"]) == {"32", "64"}
    # on a CPU there is no peak-memory counter: those are null
    assert all(v is None for v in res["stats_peak_mem_mb"].values())


def test_scale(tmp_path):
    res = _run("perf_scale", tmp_path, "--tokenizer", "bytes")
    assert res["convert_1p5b_s"] > 0 and res["convert_8b_s"] > 0
    assert {"stats_s", "phase1_s", "phase2_s", "hybrid_eval_s"} <= set(res["scale"]["8b"]["stage_s"])


def test_convert(tmp_path):
    """The embedded teacher's conversion: phase 2 timed, both perplexities measured, the hybrid's above the
    teacher's."""
    from taylor_calibrate.teacher import embedded_teacher_path
    try:
        embedded_teacher_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    res = _run("perf_convert", tmp_path)
    assert 0 < res["align_smollm2_s"] < res["convert"]["wall_s"]
    assert 1 < res["convert"]["teacher_ppl"] < res["convert"]["hybrid_ppl"]


def test_align(tmp_path):
    res = _run("perf_align", tmp_path)
    assert res["align_smollm2_warm_s"] > 0 and res["align"]["steps"] > 0


def test_distill(tmp_path):
    res = _run("perf_distill", tmp_path)
    assert res["distill"]["tokens_per_s"] > 0 and res["distill"]["flops_per_token"] > 0
    assert res["distill_mfu_1p5b"] is None  # no known peak FLOP/s for a CPU


def test_inference(tmp_path):
    res = _run("perf_inference", tmp_path)
    assert set(res["decode_speedup"]) == set(res["prefill_speedup"]) == set(res["cache_bytes_ratio"]) == {"32", "64"}
    assert set(res["decode_speedup"]["64"]) == {"1", "2"}
    for row in res["inference"]["rows"].values():
        assert row["hybrid"]["cache_bytes_per_seq"] == row["hybrid_cache_bytes_analytic"]
        assert row["teacher"]["cache_bytes_per_seq"] == row["teacher_cache_bytes_analytic"]
        assert 0 < row["cache_bytes_ratio"] < 1
        assert set(row["hybrid"]["gdn_kernel_calls"]) == {"torch/chunk", "torch/recurrent"}  # decode: recurrent form
    assert "## Inference" in (tmp_path / "perf_inference.md").read_text()


def test_decode(tmp_path):
    """Graph-captured decode (no graph on a CPU): the static decoder reproduces the eager decode's logits, and the
    grid cells (one of them prefilled in two chunks) are all measured."""
    res = _run("perf_decode", tmp_path)
    de = res["decode"]
    assert set(de["logits_rel_err"]) == {"teacher", "hybrid"}
    assert all(e["static"] < 1e-4 for e in de["logits_rel_err"].values()), de["logits_rel_err"]
    assert set(de["rows"]) == {"32x1", "32x3"} and set(res["decode_speedup_graph"]["32"]) == {"1", "3"}
    for row in de["rows"].values():
        assert row["hybrid"]["min_bytes_per_step"] > 0 and row["roofline_speedup"] > 0
    assert "## Decode, graph-captured" in (tmp_path / "perf_decode.md").read_text()


def test_trace_kernels_busy_time_and_launch_scopes():
    """A hand-made chrome trace of two steps: busy time is the union of kernel intervals (an overlap counts once),
    each kernel is tied through its launch's correlation id to the innermost non-generic op around the launch."""
    pc = load_benchmark("perf_common")

    def x(name, cat, ts, dur, tid=1, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}

    events = [x("ProfilerStep#4", "user_annotation", 0, 100), x("ProfilerStep#5", "user_annotation", 100, 100),
              x("## Call CompiledFxGraph abc ##", "cpu_op", 1, 50), x("aten::mm", "cpu_op", 2, 10),
              x("cudaLaunchKernel", "cuda_runtime", 3, 1, correlation=7),
              x("cuLaunchKernelEx", "cuda_driver", 20, 1, correlation=8),
              x("ChunkGatedDeltaRuleFunctionBackward", "cpu_op", 110, 40, tid=2),
              x("cuLaunchKernel", "cuda_driver", 111, 1, tid=2, correlation=9),
              x("gemm", "kernel", 10, 30, pid=0, tid=7, correlation=7),
              x("triton_red", "kernel", 30, 20, pid=0, tid=8, correlation=8),  # overlaps gemm by 10
              x("chunk_bwd", "kernel", 120, 40, pid=0, tid=7, correlation=9),
              x("ProfilerStep#4", "gpu_user_annotation", 0, 100, pid=0)]  # a GPU-side annotation: not a step
    s = pc.trace_kernels({"traceEvents": events})
    assert s["steps"] == 2 and s["wall_ms"] == pytest.approx(0.1)
    assert s["gpu_busy_ms"] == pytest.approx((40 + 40) / 2 / 1e3)  # [10, 50] and [120, 160]
    assert s["gpu_kernel_ms"] == pytest.approx((30 + 20 + 40) / 2 / 1e3)
    k = {r["kernel"]: r for r in s["kernels"]}
    assert [r["kernel"] for r in s["kernels"]] == ["chunk_bwd", "gemm", "triton_red"]
    assert k["gemm"]["scope"] == k["triton_red"]["scope"] == "## Call CompiledFxGraph abc ##"
    assert k["chunk_bwd"]["scope"] == "ChunkGatedDeltaRuleFunctionBackward" and k["gemm"]["calls"] == 0.5
    assert "| gemm | 0.01 |" in pc.kernels_table(s)
