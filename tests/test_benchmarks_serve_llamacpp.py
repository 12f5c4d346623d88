"""benchmarks/serve_llamacpp.py's `bytes` step (held-out loss per byte through llama.cpp's own tokenisation against
ours): the byte count of a GGUF's tokens, the parse of llama-perplexity's output, and, with llama.cpp's tools built
(`llama-tokenize` and `llama-perplexity` side by side, found as the tests of test_export_gguf.py find llama-tokenize),
the whole step on a tiny hybrid."""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from taylor_calibrate.checkpoint import save_hybrid
from taylor_calibrate.export.gguf import export_gguf

from conftest import VOCAB, load_benchmark, tiny_corpus, tiny_tokenizer
from test_export_gguf import TEXT
from test_export_qwen3_5 import tiny_hybrid

pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("single_thread")


def saved_hybrid(tmp_path):
    tok = tiny_tokenizer([p.read_text() for p in sorted(tiny_corpus(tmp_path / "corpus").iterdir())])
    _, hybrid = tiny_hybrid(gdn_layers=(0, 1, 2), vocab_size=VOCAB)
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    return tok, tmp_path / "hybrid"


def test_gguf_token_bytes_count_every_byte_of_the_text(tmp_path):
    """Bytes per id from the GGUF's own token list: over the tokens of a text they add up to its UTF-8 length
    (multi-byte characters split across tokens included); the EOS (a control token) counts none."""
    mod = load_benchmark("serve_llamacpp")
    tok, hybrid = saved_hybrid(tmp_path)
    sizes = mod.gguf_token_bytes(export_gguf(hybrid, tmp_path / "gguf"))
    ids = tok(TEXT, add_special_tokens=False).input_ids
    assert sum(sizes[i] for i in ids) == len(TEXT.encode()) > len(TEXT)
    assert sizes[tok.eos_token_id] == 0
    assert max(sizes[i] for i in ids) > 1  # merged tokens stand for several bytes


def test_parse_perplexity_reads_the_mean_nll_of_the_last_chunk():
    mod = load_benchmark("serve_llamacpp")
    log = ("perplexity: calculating perplexity over 2 chunks, n_ctx=64, batch_size=64, n_seq=1\n"
           "       0  3.1000  1.131402  0.051000\n      64  3.2000  1.163151  0.049000\n\n"
           "Final estimate: PPL = 3.2000 +/- 0.04900\n")
    assert mod.parse_perplexity(log) == {"ppl": 3.2, "stderr": 0.049, "mean_nll": 1.163151, "chunks": 2}
    # the closing line missing (seen on a short run): the last row's mean nll gives the figure
    cut = log[:log.index("Final")]
    assert mod.parse_perplexity(cut) == {"ppl": 3.2, "stderr": None, "mean_nll": 1.163151, "chunks": 2}
    for bad in ("main: error: failed to load model\n", cut[:cut.index("      64")]):  # no rows; a chunk's row missing
        with pytest.raises(ValueError, match="no perplexity .a row for every chunk. in llama-perplexity's output"):
            mod.parse_perplexity(bad)


def _build_dir():
    binary = os.environ.get("LLAMA_TOKENIZE") or shutil.which("llama-tokenize")
    if binary is None or not (Path(binary).parent / "llama-perplexity").is_file():
        return None
    return Path(binary).resolve().parent.parent


@pytest.mark.skipif(_build_dir() is None, reason="llama-tokenize and llama-perplexity (PATH or $LLAMA_TOKENIZE's "
                    "folder) are not here")
def test_bytes_step_on_a_tiny_hybrid(tmp_path):
    """llama.cpp tokenises the held-out text (Python source) as our tokenizer does, reads every byte of it, and its
    loss per byte on the fp32 GGUF (fp32 KV) equals ours."""
    mod = load_benchmark("serve_llamacpp")
    _, hybrid = saved_hybrid(tmp_path)
    out = tmp_path / "bytes.json"
    mod.main(["bytes", "--build", str(_build_dir()), "--hybrid", str(hybrid), "--stage", str(tmp_path / "stage"),
              "--out", str(out), "--text_bytes", "6000", "--ctx", "64", "--chunks", "4", "--threads", "1"])
    res = json.loads(out.read_text())
    m = res["models"]["hybrid"]
    assert m["text_ids_equal"] and m["first_mismatch"] is None
    assert m["engine_token_bytes"] == m["text_bytes"] == res["text"]["bytes"] > 6000
    assert m["engine"]["chunks"] == m["ours"]["chunks"] == 4 and m["engine"]["scored_tokens"] == 4 * 31
    assert m["engine"]["scored_bytes"] == m["ours"]["scored_bytes"]
    assert abs(m["engine_over_ours"] - 1) < 1e-4
    assert "commit" in res and "dirty" in res and "/" not in m["engine"]["command"].split()[2]


def test_memory_lines_and_graph_splits_are_read_from_llama_cpp_log():
    """The context-creation lines llama.cpp prints at -lv 4 (copied from an H200 run): cache sizes in MiB, and the
    graph's node / split counts (50 splits for a hybrid whose GDN conv ran on the CPU)."""
    log = ("0.00.512.278 I llama_kv_cache: size =   19.12 MiB (  4352 cells,   6 layers,  1/1 seqs), K (f16):    9.56 "
           "MiB, V (f16):    9.56 MiB\n0.00.512.483 I llama_memory_recurrent: size =    3.85 MiB (     1 cells,  30 "
           "layers,  1 seqs  0 rs_seq), R (f32):    0.47 MiB, S (f32):    3.38 MiB, P (f32):    0.00 MiB\n"
           "0.00.533.633 I sched_reserve: graph: nodes = 1801, splits = 50, input objects = 4, input tensors = 7\n")
    got = load_benchmark("serve_llamacpp").memory_bytes(log)
    assert got["kv_bytes"] == int(19.12 * 2 ** 20) and got["recurrent_bytes"] == int(3.85 * 2 ** 20)
    assert got["mem_bytes"] == int((19.12 + 3.85) * 2 ** 20)
    assert (got["graph_nodes"], got["graph_splits"]) == (1801, 50)
    assert load_benchmark("serve_llamacpp").memory_bytes("")["graph_splits"] is None


@pytest.mark.parametrize("attention", ["all", "none", "1"])
def test_probe_rewrites_the_layer_pattern_with_each_kinds_tensors(tmp_path, attention):
    """`probe` (speed probes of llama.cpp's qwen35 graph): the GGUF's recurrent_layers follows the asked pattern, each
    layer holds exactly the mixer tensors of its kind, copied from the first layer of that kind, and everything else
    (metadata, norms, MLPs, embeddings) is the source's."""
    import gguf

    mod = load_benchmark("serve_llamacpp")
    _, hybrid = saved_hybrid(tmp_path)  # layers 0-2 GDN, 3 attention
    src = export_gguf(hybrid, tmp_path / "gguf", ftype="f16")
    mod.main(["probe", "--gguf", str(src), "--attention", attention, "--out", str(tmp_path / "p.gguf")])
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(tmp_path / "p.gguf"))
    key = "qwen35.attention.recurrent_layers"
    n = len(a.fields[key].contents())
    want = {"all": [True] * n, "none": [False] * n, "1": [i == 1 for i in range(n)]}[attention]
    assert b.fields[key].contents() == [not x for x in want]
    assert {k: f.contents() for k, f in a.fields.items() if k != key and not k.startswith("GGUF.")} == \
           {k: f.contents() for k, f in b.fields.items() if k != key and not k.startswith("GGUF.")}
    src_t, out_t = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    recurrent = a.fields[key].contents()
    donor = {kind: recurrent.index(kind) for kind in (True, False)}
    names = lambda layer, tensors: {k.split(".", 2)[2] for k in tensors if k.startswith(f"blk.{layer}.")}
    for i, is_attn in enumerate(want):
        assert names(i, out_t) == names(donor[not is_attn], src_t)
        for suffix in names(i, out_t):
            from_layer = i if suffix in names(i, src_t) and suffix in names(donor[is_attn], src_t) else donor[not is_attn]
            assert (out_t[f"blk.{i}.{suffix}"].data == src_t[f"blk.{from_layer}.{suffix}"].data).all()
    assert all((out_t[k].data == t.data).all() for k, t in src_t.items() if not k.startswith("blk."))


def test_collect_reports_the_grid_and_the_probes(tmp_path):
    """`collect` on a device step's output: grid rows pair teacher and hybrid per context x parallel with their
    ratio, and probe runs (`device --probe_attention`) come out per probe and context with the step time."""
    mod = load_benchmark("serve_llamacpp")
    row = lambda pl, tg, pp: {"pl": pl, "tg": 128, "t_tg": 128 * pl / tg, "speed_tg": tg, "speed_pp": pp}
    dev = {"grid": [{"model": "teacher", "context": 4096, "command": "t", "rows": [row(1, 100.0, 1000.0)]},
                    {"model": "hybrid", "context": 4096, "command": "h", "rows": [row(1, 150.0, 900.0)]},
                    {"model": "probe_a29", "context": 4096, "command": "p", "rows": [row(1, 80.0, 950.0)]}]}
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "device.json").write_text(json.dumps(dev))
    ours = {"hybrid_gguf": {"name": "model.gguf"}, "teacher_gguf": {"name": "t.gguf"}, "ctx": 1024, "new_tokens": 64,
            "ppl": {"ppl": 3.0, "chunks": 32, "tokens": 16352, "loss_per_byte": 0.5, "scored_bytes": 40000}}
    (tmp_path / "ours.json").write_text(json.dumps(ours))
    out = tmp_path / "r.json"
    mod.main(["collect", "--ours", str(tmp_path / "ours.json"), "--device_out", str(tmp_path / "dev"), "--out",
              str(out), "--parallel", "1", "--shapes", json.dumps({"teacher": {}, "hybrid": {}})])
    res = json.loads(out.read_text())
    (cell,) = res["grid"]
    assert (cell["context"], cell["parallel"], cell["teacher_decode_tok_s"], cell["hybrid_decode_tok_s"]) == \
           (4096, 1, 100.0, 150.0) and cell["decode_speedup"] == pytest.approx(1.5)
    (probe,) = res["probes"]["probe_a29@4096"]["rows"]
    assert probe == {"parallel": 1, "decode_tok_s": 80.0, "prompt_tok_s": 950.0, "decode_ms_per_step": 12.5}
    assert cell["teacher_decode_mask_ms"] is None  # no log: a build without mask_timer
    # with a mask_timer build's log, each cell carries the CPU mask's share of a decode step
    def bench(path, tg, pl, ms):
        masks = [f"E set_input_kq_mask: kq mask time: {ms} ms n_kv 4352 n_tokens {pl}"] * 128
        rows = json.dumps({"n_kv_max": 1, **row(pl, tg, 1.0), "pp": 4096})
        return f"$ bin/llama-batched-bench -m {path} -c 2\n{rows}\n" + "\n".join(masks) + "\n"

    (tmp_path / "dev" / "llama_log.txt").write_text(bench("stage/teacher_f16.gguf", 100.0, 1, 0.5) +
                                                    bench("stage/hybrid_gguf/model.gguf", 150.0, 1, 0.25))
    mod.main(["collect", "--ours", str(tmp_path / "ours.json"), "--device_out", str(tmp_path / "dev"), "--out",
              str(out), "--parallel", "1", "--shapes", json.dumps({"teacher": {}, "hybrid": {}})])
    (cell,) = json.loads(out.read_text())["grid"]
    assert (cell["teacher_decode_mask_ms"], cell["hybrid_decode_mask_ms"]) == (0.5, 0.25)


KV_CACHE_TIMER = """void llama_kv_cache::set_input_kq_mask(ggml_tensor * dst, const llama_ubatch * ub, bool causal) const {
    //const int64_t t_start = ggml_time_us();

    set_input_kq_mask_impl(args, data);

    //const int64_t t_end = ggml_time_us();

    //LLAMA_LOG_ERROR("%s: kq mask time: %0.3f ms\\n", __func__, (t_end - t_start)/1000.0);
}
"""


def test_mask_timer_switches_on_llama_cpps_commented_timer_once(tmp_path, capsys):
    mod = load_benchmark("serve_llamacpp")
    src = tmp_path / "llama.cpp" / "src" / "llama-kv-cache.cpp"
    src.parent.mkdir(parents=True)
    src.write_text(KV_CACHE_TIMER)
    mod.main(["mask_timer", "--src", str(src.parents[1])])
    text = src.read_text()
    assert "    const int64_t t_start = ggml_time_us();" in text and "//" not in text
    assert 'getenv("LLAMA_MASK_TIME")' in text and "n_kv %lld n_tokens %u" in text
    mod.main(["mask_timer", "--src", str(src.parents[1])])  # a second run leaves it as it is
    assert src.read_text() == text and "already on" in capsys.readouterr().out
    src.write_text("void f() {}\n")  # another llama.cpp version: named, not half-patched
    with pytest.raises(SystemExit, match="does not hold llama.cpp's commented-out mask timer"):
        mod.main(["mask_timer", "--src", str(src.parents[1])])
    assert src.read_text() == "void f() {}\n"


def test_steps_splits_each_decode_step_into_mask_and_the_rest(tmp_path):
    """`steps` on a device log: per run and parallel count the decode step (t_tg / tg), the mean of the last tg mask
    builds with n_tokens == parallel (stderr follows the rows in the log; prefill masks are whole micro-batches),
    and both ratios to the teacher."""
    mod = load_benchmark("serve_llamacpp")

    def run(model, step_ms, mask_ms, tg=2, pl=4):
        row = {"n_kv_max": 1, "pp": 64, "tg": tg, "pl": pl, "t_tg": tg * step_ms / 1000,
               "speed_tg": 1000 * pl / step_ms}
        masks = [f"0.01 E set_input_kq_mask: kq mask time: 9.000 ms n_kv 256 n_tokens 512"]  # prefill
        masks += [f"0.02 E set_input_kq_mask: kq mask time: {m:.3f} ms n_kv 256 n_tokens {pl}" for m in mask_ms]
        return f"$ build/bin/llama-batched-bench -m {model} -c 272 -npp 64\n{json.dumps(row)}\n" + "\n".join(masks) + \
               "\n# rc=0 seconds=1.0\n"

    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "device.json").write_text("{}")
    (tmp_path / "dev" / "llama_log.txt").write_text(
        run("stage/teacher_f16.gguf", 10.0, [5.0, 4.0, 4.0]) + run("stage/hybrid_gguf/model.gguf", 6.0, [4.0, 4.0]))
    out = tmp_path / "steps.json"
    mod.main(["steps", "--device_out", str(tmp_path / "dev"), "--out", str(out)])
    teacher, hybrid = json.loads(out.read_text())["rows"]
    assert (teacher["model"], teacher["decode_ms_per_step"], teacher["mask_ms_per_step"], teacher["mask_steps"]) == \
           ("teacher_f16", pytest.approx(10.0), pytest.approx(4.0), 2)
    assert hybrid["model"] == "hybrid" and hybrid["step_less_mask_ms"] == pytest.approx(2.0)
    assert hybrid["speedup"] == pytest.approx(10 / 6) and hybrid["speedup_less_mask"] == pytest.approx(3.0)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "device.json").write_text("{}")
    with pytest.raises(SystemExit, match="no llama-batched-bench rows"):
        mod.main(["steps", "--device_out", str(empty), "--out", str(tmp_path / "none.json")])


def test_probe_same_zeroes_every_tensor_and_keeps_the_rest(tmp_path):
    gguf = pytest.importorskip("gguf")
    mod = load_benchmark("serve_llamacpp")
    src = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", (np.arange(12, dtype=np.float32) + 1).reshape(3, 4))
    w.add_tensor("blk.0.attn_q.weight", np.ones((4, 4), dtype=np.float16))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    out = tmp_path / "z.gguf"
    mod.main(["probe", "--gguf", str(src), "--attention", "same", "--out", str(out)])
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(out))
    kinds = lambda r: [(t.name, t.tensor_type, tuple(t.shape)) for t in r.tensors]
    assert kinds(a) == kinds(b)
    assert all(not t.data.any() for t in b.tensors) and b.fields["llama.block_count"].contents() == 2
    assert b.fields["general.architecture"].contents() == "llama"
