"""The `damage` experiment on a tiny local teacher: one row per converted set, its bytes and costs; rows of layers cut
to a window; and the selection probes' lengths, which pass every sliding window."""
import json

import pytest
import torch
from conftest import one_thread, tiny_config, tiny_local_teacher, tiny_teacher
from transformers import AutoModelForCausalLM

from taylor_calibrate.config import AlignArgs, DamageArgs, DataArgs
from taylor_calibrate.experiments.damage import parse_window, run_damage, windowed
from taylor_calibrate.retrieval import selection_lengths


@pytest.mark.parametrize("arch, window, expected", [
    ("llama", None, [512, 2048]),  # no window: the rows' length and 4x
    ("gemma3_text", 1024, [512, 2048]),  # 4x already passes the window twice
    ("gemma3_text", 2048, [512, 4096]),  # the long probes stretch to twice the window
    ("mistral", 4096, [512, 8192]),  # every layer windowed
])
def test_selection_probes_pass_every_window(arch, window, expected):
    over = {"max_position_embeddings": 32768} | ({"sliding_window": window} if window else {})
    assert selection_lengths(512, tiny_config(arch, **over)) == expected


def test_selection_probes_stay_within_the_context():
    cfg = tiny_config("gemma3_text", sliding_window=2048, max_position_embeddings=3000)
    assert selection_lengths(512, cfg) == [512, 3000]


def test_one_row_per_set(tmp_path):
    teacher, corpus = tiny_local_teacher(tmp_path, max_position_embeddings=2048)
    args = DamageArgs(teacher=str(teacher), out=str(tmp_path / "out"), sets=["1", "0,2"], profile="quick",
                      data=DataArgs(source=str(corpus), seq_len=32, calib_seqs=4, eval_seqs=2),
                      phase2=AlignArgs(steps=2, batch_size=2), device="cpu", backend="torch", eval_batch_size=2,
                      probe_samples=1, command="pytest tests/test_damage.py")
    with one_thread():
        result = run_damage(args)
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["1", "0,2"] and rows["0,2"]["converted"] == [0, 2]
    assert rows["0,2"]["kv_fraction"] < rows["1"]["kv_fraction"] < 1  # converting more keeps fewer bytes
    for r in rows.values():
        assert r["kl"] > 0 and set(r["probes"]["tasks"]) == {"single", "multikey", "passkey"}
    assert result["probe_lengths"][-1] >= 4 * result["probe_lengths"][0] or result["probe_lengths"][-1] == 2048
    saved = json.loads((tmp_path / "out" / "damage.json").read_text())
    assert saved["commit"] and saved["rows"][1]["name"] == "0,2"
    assert "| 0,2 |" in (tmp_path / "out" / "damage.md").read_text()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_windowed_layers_attend_as_transformers_sliding_window(attn):
    """`windowed` on every layer of a Llama gives the logits of the same weights as a Mistral with that sliding
    window (transformers' own window); on a layer already windowed it narrows the window; outside it, nothing
    changes."""
    llama = tiny_teacher("llama", rope_theta=10000.0)
    llama.config._attn_implementation = attn
    mistral = AutoModelForCausalLM.from_config(tiny_config("mistral", sliding_window=6, rope_theta=10000.0),
                                               attn_implementation=attn, dtype=torch.float32).eval()
    mistral.load_state_dict(llama.state_dict())
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full = llama(input_ids=ids).logits
        with windowed(llama, [0, 1, 2, 3], 6):
            narrow = llama(input_ids=ids).logits
        again = llama(input_ids=ids).logits
        want = mistral(input_ids=ids).logits
        torch.testing.assert_close(narrow, want)
        torch.testing.assert_close(again, full)  # the hooks are gone
        assert not torch.allclose(narrow[:, 6:], full[:, 6:]) and torch.allclose(narrow[:, :6], full[:, :6])
        with windowed(mistral, [0, 1, 2, 3], 4):  # a window inside the model's own: the narrower one holds
            inner = mistral(input_ids=ids).logits
        with windowed(llama, [0, 1, 2, 3], 4):
            torch.testing.assert_close(inner, llama(input_ids=ids).logits)


def test_window_rows_measure_reach_and_bytes(tmp_path):
    """--windows rows: the teacher with a layer's attention cut to its last W positions; a window past the probes'
    length changes nothing, a short one changes the predictions and keeps fewer bytes; bad entries are refused."""
    teacher, corpus = tiny_local_teacher(tmp_path, max_position_embeddings=2048)
    args = DamageArgs(teacher=str(teacher), out=str(tmp_path / "out"), windows=["3:4096", "0-3:2"], profile="quick",
                      data=DataArgs(source=str(corpus), seq_len=32, calib_seqs=4, eval_seqs=2), context=2048,
                      device="cpu", backend="torch", eval_batch_size=2, probe_samples=1,
                      command="pytest tests/test_damage.py")
    with one_thread():
        result = run_damage(args)
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["3@4096", "0,1,2,3@2"]  # no conversion rows when only windows are asked for
    wide, narrow = rows["3@4096"], rows["0,1,2,3@2"]
    assert wide["converted"] == [] and wide["windowed"] == [3] and wide["window"] == 4096
    assert wide["kl"] == pytest.approx(0, abs=1e-6) and wide["kv_fraction"] == pytest.approx(1)
    assert narrow["kl"] > 1e-3 and narrow["kv_fraction"] == pytest.approx(2 / 2048)
    assert "| 0,1,2,3@2 |" in (tmp_path / "out" / "damage.md").read_text()
    for bad in ("5", "5:", "5:x", "5:0"):
        with pytest.raises(ValueError, match="LAYERS:W"):
            parse_window(bad, 4)
