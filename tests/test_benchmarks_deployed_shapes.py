"""benchmarks/deployed_shapes.py: the bytes a decode step reads equal what transformers' own caches and weights hold;
zeroed copies keep every header and shape and read as zeros; the deployed configs are the public checkpoints'."""
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import load_benchmark, tiny_teacher


@pytest.fixture
def shapes():
    return load_benchmark("deployed_shapes")


def cache_elements(cache) -> dict:
    """(elements, bytes) of each kind of state a transformers cache holds after a forward (a linear-attention layer
    keeps its states in dicts)."""
    out = {"kv": [0, 0], "recurrent": [0, 0], "conv": [0, 0]}
    for layer in cache.layers:
        for name, kind in (("keys", "kv"), ("values", "kv"), ("recurrent_states", "recurrent"),
                           ("conv_states", "conv")):
            t = getattr(layer, name, None)
            for x in (t.values() if isinstance(t, dict) else [t]):
                if isinstance(x, torch.Tensor) and x.numel():
                    out[kind][0] += x.numel()
                    out[kind][1] += x.numel() * x.element_size()
    return out


def test_teacher_step_bytes_are_its_cache_and_weights(shapes, tmp_path):
    """A bf16 teacher after `ctx` tokens x `batch`: the KV bytes are its DynamicCache's; the weights are every
    parameter once, the input embedding left out when it is not the output head."""
    for tie in (True, False):
        model = tiny_teacher("qwen2", tie_word_embeddings=tie).to(torch.bfloat16)
        d = tmp_path / f"t{tie}"
        model.save_pretrained(d)
        ctx, batch = 24, 3
        with torch.no_grad():
            cache = model(torch.randint(0, 97, (batch, ctx)), use_cache=True).past_key_values
        got = shapes.step_bytes(d, ctx, batch)
        assert got["kv_cache"] == cache_elements(cache)["kv"][1] and got["gdn_state"] == 0
        n = sum(p.numel() for p in model.parameters())  # tied: embed and head are one parameter
        embed = model.get_input_embeddings().weight.numel()
        assert got["weights"] == 2 * (n if tie else n - embed)
        assert got["total"] == got["weights"] + got["kv_cache"]
        assert shapes.roofline_tok_s(got, batch, 1e12) == pytest.approx(batch * 1e12 / got["total"])


def test_hybrid_step_bytes_are_qwen3_5s_cache(shapes, tmp_path):
    """The Qwen3.5 export of a hybrid, run by transformers' own Qwen3_5ForCausalLM in bf16: attention KV bytes equal
    its cache's; the GDN state counted read + written equals twice its cache's recurrent and conv states, the
    recurrent one at 4 bytes an element (vLLM's fp32 state) or 2 (bf16), the conv's K - 1 inputs in bf16."""
    from taylor_calibrate.checkpoint import save_hybrid
    from taylor_calibrate.export.qwen3_5 import export_qwen3_5

    from conftest import VOCAB, tiny_corpus, tiny_tokenizer
    from test_export_qwen3_5 import tiny_hybrid

    tok = tiny_tokenizer([p.read_text() for p in sorted(tiny_corpus(tmp_path / "corpus").iterdir())])
    _, hybrid = tiny_hybrid(gdn_layers=(0, 1, 3), vocab_size=VOCAB)
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    export_qwen3_5(tmp_path / "hybrid", tmp_path / "q")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16).eval()
    ctx, batch = 20, 2
    with torch.no_grad():
        cache = model(torch.randint(0, VOCAB, (batch, ctx)), use_cache=True).past_key_values
    held = cache_elements(cache)
    assert held["kv"][0] and held["recurrent"][0] and held["conv"][0]
    for state_bytes in (4, 2):
        got = shapes.step_bytes(tmp_path / "q", ctx, batch, state_bytes=state_bytes)
        assert (got["attention_layers"], got["gdn_layers"]) == (1, 3)
        assert got["kv_cache"] == held["kv"][1]
        # transformers keeps the conv's last K inputs, an engine the K - 1 that the next step needs
        K = model.config.linear_conv_kernel_dim
        assert got["gdn_state"] == 2 * (held["recurrent"][0] * state_bytes + held["conv"][0] * (K - 1) // K * 2)


def test_zero_copy_keeps_headers_and_reads_as_zeros(shapes, tmp_path):
    """An HF directory and a GGUF file: same names, shapes, dtypes and metadata; every weight zero; other files
    copied as they are; an existing output refused."""
    gguf = pytest.importorskip("gguf")
    model = tiny_teacher("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "note.txt").write_text("kept")
    zeroed = shapes.zero_copy(tmp_path / "m", tmp_path / "z")
    assert zeroed == ["model.safetensors"] and (tmp_path / "z" / "note.txt").read_text() == "kept"
    a, b = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "z" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and not b[k].any() for k in a)
    assert (tmp_path / "z" / "config.json").read_bytes() == (tmp_path / "m" / "config.json").read_bytes()
    with pytest.raises(SystemExit, match="exists"):
        shapes.zero_copy(tmp_path / "m", tmp_path / "z")

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("t", torch.arange(1, 65, dtype=torch.float32).reshape(8, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shapes.zero_copy(tmp_path / "x.gguf", tmp_path / "y.gguf")
    r, z = gguf.GGUFReader(str(tmp_path / "x.gguf")), gguf.GGUFReader(str(tmp_path / "y.gguf"))
    assert [t.name for t in z.tensors] == ["t"] and list(z.tensors[0].shape) == list(r.tensors[0].shape)
    assert z.fields["llama.block_count"].contents() == 1 and not z.tensors[0].data.any() and r.tensors[0].data.any()


def test_deployed_shapes_are_the_public_configs(shapes):
    """Parameter counts of the configs as the public checkpoints state them (1.54B, 1.24B, 8.03B), built on the meta
    device; cells parse, with 0 = the most an engine holds only where allowed."""
    from transformers import AutoConfig

    want = {"qwen2.5-1.5b": 1.54e9, "llama-3.2-1b": 1.24e9, "llama-3.1-8b": 8.03e9}
    for name, (arch, _, fields) in shapes.DEPLOYED.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **fields))
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(want[name], rel=0.01), name
    assert shapes.cells("32768x32,131072x0", allow_max=True) == [(32768, 32), (131072, 0)]
    with pytest.raises(SystemExit, match="CONTEXTxSEQUENCES"):
        shapes.cells("131072x0")
