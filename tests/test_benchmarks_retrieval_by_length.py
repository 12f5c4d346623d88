"""benchmarks/retrieval_by_length.py: the goal check it prints from a results file (means over runs against 0.9x the
teacher, multikey 8K over the prompt seeds) and the figure it draws."""
from conftest import load_benchmark


def _grid(single, multikey):
    return {"single": {"1024": single}, "multikey": {"1024": multikey}}


def _result(teacher_right, phase_right):
    """Teacher single 1.0 / multikey 0.5; zero-shot runs 0.2 / 0.4, 0.4 / 0.0, 0.3 / 0.2 (means 0.3 / 0.2); phase runs
    1.0 / 0.5, 0.8 / 0.4, 0.9 / 0.3, 0.9 / 0.4 (means 0.9 / 0.4: single meets 0.9x, multikey misses 0.45)."""
    run = lambda s, m: {"niah": _grid(s, m)}
    return {"apart": {
        "sharpness_lr_seed_0": {"rows": {"zero_shot": run(0.2, 0.4), "e2e_4096_lr_1e-3": run(1.0, 0.5)}},
        "default_seeds": {"teacher": run(1.0, 0.5),
                          "seeds": {"1": {"zero_shot": run(0.4, 0.0), "e2e_4096": run(0.8, 0.4)},
                                    "2": {"zero_shot": run(0.3, 0.2), "e2e_4096": run(0.9, 0.3)}}},
        "phase_multikey_8k_seeds": {
            "convert": {"kv_fraction": 0.25},
            "rows": {"plain": {**run(0.9, 0.4), "distill": {"tokens": 20_000_000},
                               "multikey_8k_pooled": {"right": phase_right, "teacher_right": teacher_right,
                                                      "prompts": 100}}}}}}


def test_means_over_runs_against_the_goal():
    rbl = load_benchmark("retrieval_by_length")
    s = rbl.summary(_result(teacher_right=38, phase_right=35))
    single, multikey = s["cells"]["single"]["1024"], s["cells"]["multikey"]["1024"]
    assert abs(single["zero_shot"] - 0.3) < 1e-9 and abs(single["phase"] - 0.9) < 1e-9
    assert abs(multikey["phase"] - 0.4) < 1e-9 and abs(multikey["goal"] - 0.45) < 1e-9
    assert single["phase_met"] and not multikey["phase_met"]
    assert s["multikey_8192_seeds_0_4"]["phase_met"]  # 35 >= 0.9 x 38
    assert not rbl.summary(_result(teacher_right=38, phase_right=34))["multikey_8192_seeds_0_4"]["phase_met"]
    table = rbl.markdown(s)
    assert "| single | 1024 | 1.00 | 0.900 | 0.300 | 0.900 | yes |" in table
    assert "| multikey | 1024 | 0.50 | 0.450 | 0.200 | 0.400 | no |" in table


def test_the_committed_results_give_the_table_and_figure(tmp_path, capsys):
    rbl = load_benchmark("retrieval_by_length")
    s = rbl.main(["--out", str(tmp_path / "f.png")])
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(s["cells"]) == {"single", "multikey", "passkey"}
    assert "| passkey | 8192 |" in capsys.readouterr().out
