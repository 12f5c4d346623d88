"""GGUF export for llama.cpp's qwen35 (taylor_calibrate/export/gguf.py): tensor names, shapes and metadata are the ones
llama.cpp's loader reads; with llama-cpp-python installed, llama.cpp's logits equal our hybrid's."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from taylor_calibrate.checkpoint import save_hybrid
from taylor_calibrate.export.gguf import export_gguf

from conftest import VOCAB, tiny_corpus, tiny_tokenizer
from test_export_qwen3_5 import tiny_hybrid

gguf = pytest.importorskip("gguf")

# What llama.cpp's qwen35 loader (src/models/qwen35.cpp, llama.cpp vendored in llama-cpp-python 0.3.36) creates for a
# dense model: per layer kind, GGUF tensor name -> shape as GGUF lists it (ne0 first), in terms of the config.
def expected_tensors(n_layers, gdn_layers, E, F, H, Hkv, D, K, V, G=None):
    """G: the GDN layers' heads in the file (H, or more where export pads zero heads for llama.cpp's CUDA conv)."""
    G = G or H
    out = {"token_embd.weight": [E, V], "output_norm.weight": [E], "output.weight": [E, V]}
    for i in range(n_layers):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": [E], b + "post_attention_norm.weight": [E], b + "ffn_gate.weight": [E, F],
                    b + "ffn_up.weight": [E, F], b + "ffn_down.weight": [F, E]})
        if i in gdn_layers:
            out.update({b + "attn_qkv.weight": [E, 3 * G * D], b + "attn_gate.weight": [E, G * D],
                        b + "ssm_conv1d.weight": [K, 3 * G * D], b + "ssm_dt.bias": [G], b + "ssm_a": [G],
                        b + "ssm_beta.weight": [E, G], b + "ssm_alpha.weight": [E, G], b + "ssm_norm.weight": [D],
                        b + "ssm_out.weight": [G * D, E]})
        else:
            out.update({b + "attn_q.weight": [E, 2 * H * D], b + "attn_k.weight": [E, Hkv * D],
                        b + "attn_v.weight": [E, Hkv * D], b + "attn_output.weight": [H * D, E],
                        b + "attn_q_norm.weight": [D], b + "attn_k_norm.weight": [D]})
    return out


REQUIRED_KEYS = ("general.architecture", "qwen35.context_length", "qwen35.embedding_length", "qwen35.block_count",
                 "qwen35.feed_forward_length", "qwen35.attention.head_count", "qwen35.attention.head_count_kv",
                 "qwen35.attention.layer_norm_rms_epsilon", "qwen35.rope.dimension_sections", "qwen35.ssm.conv_kernel",
                 "qwen35.ssm.inner_size", "qwen35.ssm.state_size", "qwen35.ssm.time_step_rank",
                 "qwen35.ssm.group_count", "qwen35.attention.recurrent_layers", "qwen35.rope.dimension_count",
                 "qwen35.rope.freq_base", "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def export(tmp_path, gdn_layers=(0, 1, 2), **over):
    tok = tiny_tokenizer([p.read_text() for p in sorted(tiny_corpus(tmp_path / "corpus").iterdir())])
    _, hybrid = tiny_hybrid(gdn_layers=gdn_layers, vocab_size=VOCAB, **over)
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    return hybrid, tok, export_gguf(tmp_path / "hybrid", tmp_path / "gguf")


@pytest.fixture
def exported(tmp_path):
    return export(tmp_path)


def _field(reader, key):
    f = reader.fields[key]
    if len(f.data) == 1 and f.types[0] != gguf.GGUFValueType.ARRAY:
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]
    return [f.parts[i].tolist()[0] if f.types[-1] != gguf.GGUFValueType.STRING else bytes(f.parts[i]).decode()
            for i in f.data]


def test_gguf_tensors_and_metadata_are_what_llama_cpp_reads(exported):
    hybrid, _, path = exported
    c = hybrid.config
    r = gguf.GGUFReader(str(path))
    got = {t.name: t.shape.tolist() for t in r.tensors}
    # 4 GDN heads x 3 x 16 = 192 conv channels; 4 zero heads make 384, a multiple of llama.cpp's CUDA conv's 128
    assert got == expected_tensors(4, {0, 1, 2}, c.hidden_size, 96, 4, 2, 16, 4, c.vocab_size, G=8)
    assert _field(r, "qwen35.ssm.group_count") == _field(r, "qwen35.ssm.time_step_rank") == 8
    assert all(k in r.fields for k in REQUIRED_KEYS)
    assert _field(r, "general.architecture") == "qwen35"
    assert _field(r, "qwen35.attention.recurrent_layers") == [True, True, True, False]
    assert _field(r, "qwen35.full_attention_interval") == 4
    assert _field(r, "qwen35.rope.dimension_count") == 16  # full rotary, not the converter's 0.25 default
    assert sum(_field(r, "qwen35.rope.dimension_sections")) == 8
    # the transforms llama.cpp's converter applies: A = -exp(A_log); norms as the multiplier itself
    tensors = {t.name: np.asarray(t.data) for t in r.tensors}
    m = hybrid.gdn_mixers[0]
    assert np.allclose(tensors["blk.0.ssm_a"][:4], -m.A_log.exp().detach().numpy())  # then the 4 zero heads
    assert np.allclose(tensors["blk.0.ssm_norm.weight"], m.o_norm.weight.detach().numpy())
    assert np.allclose(tensors["blk.3.attn_q_norm.weight"],
                       hybrid.model.layers[3].self_attn.q_norm.weight.detach().numpy(), atol=1e-6)


def test_zero_heads_padded_for_llama_cpp_cuda_change_nothing():
    """pad_linear_heads: conv channels become a multiple of 128, and transformers' own Qwen3_5ForCausalLM gives the
    same logits with the zero heads as without (llama.cpp's graph: the test below, where llama-cpp-python is here)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from taylor_calibrate.export.gguf import pad_linear_heads
    from taylor_calibrate.export.qwen3_5 import qwen3_5_config, qwen3_5_state_dict

    _, hybrid = tiny_hybrid(gdn_layers=(0, 2), vocab_size=VOCAB, short_conv="random")
    config = qwen3_5_config(hybrid.config, torch.float32)
    weights = qwen3_5_state_dict(hybrid.config, hybrid.state_dict())
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = []
    for pad in (False, True):
        if pad:
            assert pad_linear_heads(config, weights) == 4  # 4 heads x 48 channels -> 8 x 48 = 384 = 3 x 128
            assert (2 * 16 + 16) * config["linear_num_key_heads"] % 128 == 0
            assert pad_linear_heads(config, weights) == 0  # already a multiple: nothing more
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config)).eval()
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and not [k for k in missing if "rotary" not in k]
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="pip install llama-cpp-python")
@pytest.mark.parametrize("gdn_layers,short_conv", [((0, 1, 2), "random"), ((1, 3), "none"), ((1, 2, 3), "random")])
def test_llama_cpp_runs_the_export_like_ours(tmp_path, gdn_layers, short_conv):
    """llama.cpp's own qwen35 graph on the GGUF: logits within 1e-4 of ours (fp32 weights and, unlike llama.cpp's
    default f16, an fp32 KV cache), greedy tokens equal; periodic and non-periodic layer patterns."""
    import llama_cpp

    hybrid, tok, path = export(tmp_path, gdn_layers, short_conv=short_conv)
    ids = tok("the river moves slowly over quiet hills while birds call and water runs").input_ids[:20]
    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1, type_k=f32,
                          type_v=f32)
    llm.eval(ids)
    theirs = np.asarray(llm.scores[:len(ids)])
    with torch.no_grad():
        ours = hybrid(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    assert np.abs(ours - theirs).max() < 1e-4
    llm.reset()
    out = llm.generate(ids[:8], temp=0.0)
    theirs_greedy = [next(out) for _ in range(6)]
    ours_greedy = hybrid.generate(torch.tensor([ids[:8]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 8:]
    assert theirs_greedy == ours_greedy.tolist()


# --- the tokenizer llama.cpp reads: pre-tokenizer, special ids and flags ------------------------------------------

def _family_tokenizer(family, texts):
    """A tiny byte-level BPE tokenizer with the pre-tokenizer of a supported teacher family (tokenizer.json form)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from taylor_calibrate.export.gguf import _LLAMA3_SPLIT, _QWEN2_SPLIT

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    pre = {"gpt-2": pre_tokenizers.ByteLevel(add_prefix_space=False),
           "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False)]),
           "llama-bpe": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"), byte_level]),
           "qwen2": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"), byte_level])}
    pre["smaug-bpe"] = pre["llama-bpe"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre[family]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.model.ignore_merges = family == "llama-bpe"  # as Llama 3's tokenizer.json; smaug-bpe: its split, every merge
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


FAMILIES = ("gpt-2", "smollm", "llama-bpe", "smaug-bpe", "qwen2")
# digits, contractions, runs of spaces and newlines, punctuation, non-ASCII, backslash escapes as source code writes
# them: where the pre-tokenizers (and a tool reading text through escape processing) differ
TEXT = ("The river's 12345 stones don't move;  they've   waited 2024 years.\n\n\tdef f(x):\n        return x+1  # ok\n"
        "Grüße, naïve café — 3.14159 and 1,000,000!\r\n    print('a\\tb\\n', r\"\\d+\")\n  end  ")


def export_family(tmp_path, family):
    texts = [p.read_text() for p in sorted(tiny_corpus(tmp_path / "corpus").iterdir())]
    tok = _family_tokenizer(family, texts)
    _, hybrid = tiny_hybrid(gdn_layers=(0, 1, 2), vocab_size=VOCAB)
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    return tok, export_gguf(tmp_path / "hybrid", tmp_path / "gguf")


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_names_the_pre_tokenizer_of_each_family(tmp_path, family):
    _, path = export_family(tmp_path, family)
    r = gguf.GGUFReader(str(path))
    assert _field(r, "tokenizer.ggml.pre") == family
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.eos_token_id") == 0 and _field(r, "tokenizer.ggml.add_bos_token") is False


def test_gguf_refuses_a_pre_tokenizer_llama_cpp_would_split_differently(tmp_path):
    from tokenizers import pre_tokenizers

    tok = _family_tokenizer("gpt-2", [p.read_text() for p in sorted(tiny_corpus(tmp_path / "corpus").iterdir())])
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Punctuation(),
                                                                   pre_tokenizers.ByteLevel(add_prefix_space=False)])
    _, hybrid = tiny_hybrid(gdn_layers=(0, 1, 2), vocab_size=VOCAB)
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    with pytest.raises(ValueError, match="Punctuation, ByteLevel.*no GGUF is written"):
        export_gguf(tmp_path / "hybrid", tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


def test_gguf_refuses_a_recorded_pre_tokenizer_whose_merges_the_tokenizer_does_not_follow(tmp_path):
    """A GGUF teacher's recorded `llama-bpe` (llama.cpp takes a word that is a vocabulary entry whole) with a saved
    tokenizer.json that always merges (as transformers' GGUF loader built it before teacher.with_gguf_split set
    ignore_merges): refused, naming the setting to change."""
    from taylor_calibrate.teacher import GGUF_TOKENIZER_KEY

    tok = _family_tokenizer("smaug-bpe", [p.read_text() for p in sorted(tiny_corpus(tmp_path / "corpus").iterdir())])
    tok.init_kwargs[GGUF_TOKENIZER_KEY] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe"}
    _, hybrid = tiny_hybrid(gdn_layers=(0, 1, 2), vocab_size=VOCAB)
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    with pytest.raises(ValueError, match="'llama-bpe'.*ignore_merges True.*ignore_merges False.*\"ignore_merges\" in "
                                         "tokenizer.json to true"):
        export_gguf(tmp_path / "hybrid", tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


def test_gguf_refuses_a_recorded_pre_tokenizer_whose_split_the_tokenizer_does_not_follow(tmp_path):
    """A GGUF teacher's recorded `smollm` (single digits, then GPT-2's split) with a saved tokenizer.json that has no
    Digits step (as transformers' GGUF loader built it before teacher.with_gguf_split added it): refused."""
    from taylor_calibrate.teacher import GGUF_TOKENIZER_KEY

    tok = _family_tokenizer("gpt-2", [p.read_text() for p in sorted(tiny_corpus(tmp_path / "corpus").iterdir())])
    tok.init_kwargs[GGUF_TOKENIZER_KEY] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm"}
    _, hybrid = tiny_hybrid(gdn_layers=(0, 1, 2), vocab_size=VOCAB)
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    with pytest.raises(ValueError, match="'smollm'.*splits text as ByteLevel.*run `convert` again"):
        export_gguf(tmp_path / "hybrid", tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


def _llama_tokenize_binary():
    import os
    import shutil

    return os.environ.get("LLAMA_TOKENIZE") or shutil.which("llama-tokenize")


NO_LLAMA_CPP = "neither llama-cpp-python nor llama-tokenize (PATH or $LLAMA_TOKENIZE) is here"


def _llama_cpp_tokenize(path, text):
    """Token ids llama.cpp gives `text` (no BOS; the text of a special token, such as SmolLM2's `<filename>` in
    held-out source, as that token: the model's tokenizer does so), through llama-cpp-python or a `llama-tokenize`
    binary (told to read the text as written: by default it processes escapes such as `\\n`); None when neither is
    here."""
    import subprocess

    if importlib.util.find_spec("llama_cpp") is not None:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        return llm.tokenize(text.encode(), add_bos=False, special=True)
    binary = _llama_tokenize_binary()
    if binary is None:
        return None
    out = subprocess.run([binary, "-m", str(path), "--stdin", "--ids", "--no-bos", "--log-disable", "--no-escape"],
                         input=text, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_tokenises_text_like_the_model(tmp_path, family):
    """Text, not ids: llama.cpp's own tokeniser on the exported GGUF gives the model tokenizer's ids."""
    tok, path = export_family(tmp_path, family)
    theirs = _llama_cpp_tokenize(path, TEXT)
    if theirs is None:
        pytest.skip(NO_LLAMA_CPP)
    assert theirs == tok(TEXT, add_special_tokens=False).input_ids


@pytest.mark.slow
def test_gguf_tokenizer_metadata_equals_the_embedded_teachers(tmp_path):
    """The embedded teacher (a GGUF, pre-tokenizer `smollm`): convert records its tokenizer.ggml.* scalars, and the
    export carries every tokenizer.* value of the teacher's GGUF unchanged."""
    from taylor_calibrate.teacher import (GGUF_TOKENIZER_KEY, embedded_teacher_path, gguf_tokenizer_metadata,
                                          load_tokenizer)

    teacher = embedded_teacher_path()
    tok = load_tokenizer("smollm2-135m")
    tok.init_kwargs[GGUF_TOKENIZER_KEY] = gguf_tokenizer_metadata(teacher)
    _, hybrid = tiny_hybrid(gdn_layers=(0, 1, 2), vocab_size=len(tok))
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    path = export_gguf(tmp_path / "hybrid", tmp_path / "gguf")
    theirs, ours = gguf.GGUFReader(str(teacher)), gguf.GGUFReader(str(path))
    keys = sorted(k for k in theirs.fields if k.startswith("tokenizer."))
    assert "tokenizer.ggml.pre" in keys and "tokenizer.chat_template" in keys
    assert sorted(k for k in ours.fields if k.startswith("tokenizer.")) == keys
    for k in keys:
        assert _field(ours, k) == _field(theirs, k), k
    assert _field(ours, "tokenizer.ggml.pre") == "smollm"


@pytest.mark.slow
def test_llama_cpp_tokenises_held_out_text_like_the_embedded_teacher(tmp_path):
    """Text, not ids, for the embedded teacher (a GGUF, pre-tokenizer `smollm`): llama.cpp's own tokeniser on a
    hybrid's GGUF export and on the teacher's own GGUF gives the ids of the tokenizer the hybrid saves (the one it was
    converted and is evaluated with), on TEXT and on every held-out document of the default corpus (Python source:
    digits after runs of spaces, escapes, non-ASCII) joined into one text."""
    if importlib.util.find_spec("llama_cpp") is None and _llama_tokenize_binary() is None:
        pytest.skip(NO_LLAMA_CPP)
    from taylor_calibrate.config import CorpusSpec
    from taylor_calibrate.data import load_documents, split_documents
    from taylor_calibrate.teacher import (GGUF_TOKENIZER_KEY, embedded_teacher_path, gguf_tokenizer_metadata,
                                          load_tokenizer)

    teacher = embedded_teacher_path()
    tok = load_tokenizer("smollm2-135m")
    tok.init_kwargs[GGUF_TOKENIZER_KEY] = gguf_tokenizer_metadata(teacher)  # as `convert` records it
    _, hybrid = tiny_hybrid(gdn_layers=(0, 1, 2), vocab_size=len(tok))
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    path = export_gguf(tmp_path / "hybrid", tmp_path / "gguf")
    spec = CorpusSpec()
    _, heldout = split_documents(load_documents(spec), spec.heldout_fraction, source=spec.source)
    text = "\n\n".join([TEXT, *(t for _, t in heldout)])
    ours = load_tokenizer(str(tmp_path / "hybrid"))(text, add_special_tokens=False).input_ids
    assert len(heldout) > 10 and len(ours) > 100_000
    for gguf_file in (path, teacher):
        theirs = _llama_cpp_tokenize(gguf_file, text)
        i = next((i for i, (x, y) in enumerate(zip(theirs, ours)) if x != y), min(len(theirs), len(ours)))
        assert theirs == ours, (gguf_file.name, i, tok.convert_ids_to_tokens(theirs[max(0, i - 2):i + 3]),
                                tok.convert_ids_to_tokens(ours[max(0, i - 2):i + 3]))


# Vocabularies llama.cpp ships for its own tokenizer tests (its source's models/ folder, $LLAMA_CPP_VOCABS): the
# real tokenizers of the supported families it tokenises as byte-level BPE, with test strings (.inp) and the original
# tokenizer's ids for them (.out). Llama 2 / Mistral (SentencePiece) and Gemma 3 have no GGUF export here.
REAL_VOCABS = {"llama-bpe": "Llama 3", "qwen2": "Qwen2 and Qwen3"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_VOCABS))
def test_llama_cpp_tokenises_text_like_a_real_family_tokenizer(tmp_path, name):
    """A real family vocabulary as a GGUF teacher's: our tokenizer (teacher.load_tokenizer) gives the original
    tokenizer's ids on llama.cpp's test strings, and a hybrid saved with it, exported with the teacher's recorded
    tokenizer metadata or with the pre-tokenizer named from tokenizer.json alone, tokenises those strings and TEXT in
    llama.cpp as ours does."""
    import os

    from taylor_calibrate.teacher import GGUF_TOKENIZER_KEY, gguf_tokenizer_metadata, load_tokenizer

    folder = os.environ.get("LLAMA_CPP_VOCABS")
    if not folder:
        pytest.skip("$LLAMA_CPP_VOCABS (llama.cpp's models/ folder, with ggml-vocab-*.gguf) is not set")
    if importlib.util.find_spec("llama_cpp") is None and _llama_tokenize_binary() is None:
        pytest.skip(NO_LLAMA_CPP)
    vocab = Path(folder) / f"ggml-vocab-{name}.gguf"
    tok = load_tokenizer(str(vocab))
    strings = Path(f"{vocab}.inp").read_text().split("\n__ggml_vocab_test__\n")
    originals = Path(f"{vocab}.out").read_text().split("\n")
    assert len(strings) > 40
    for text, want in zip(strings, originals):
        assert tok(text, add_special_tokens=False).input_ids == [int(x) for x in want.split()], text
    text = "\n\n".join([TEXT, *strings])
    ours = tok(text, add_special_tokens=False).input_ids
    _, hybrid = tiny_hybrid(gdn_layers=(0, 1, 2), vocab_size=len(tok))
    for recorded in (True, False):
        if recorded:
            tok.init_kwargs[GGUF_TOKENIZER_KEY] = gguf_tokenizer_metadata(vocab)
        else:
            tok.init_kwargs.pop(GGUF_TOKENIZER_KEY)
        save_hybrid(hybrid, tok, tmp_path / f"hybrid{recorded}")
        path = export_gguf(tmp_path / f"hybrid{recorded}", tmp_path / f"gguf{recorded}")
        assert _field(gguf.GGUFReader(str(path)), "tokenizer.ggml.pre") == name
        assert _llama_cpp_tokenize(path, text) == ours, recorded


def test_convert_of_an_exported_model_names_it_and_the_teacher_to_pass(tmp_path, capsys):
    """Our GGUF export (qwen35), our Qwen3.5 export and our hybrid directory given to `convert --teacher`: one line
    saying it already is a hybrid and naming the teacher it was converted from (the GGUF records it); so is a
    truncated copy of the GGUF (its metadata comes first), which said "download it again"."""
    from taylor_calibrate.cli import main
    from taylor_calibrate.export.qwen3_5 import export_qwen3_5

    tok = tiny_tokenizer([p.read_text() for p in sorted(tiny_corpus(tmp_path / "corpus").iterdir())])
    _, hybrid = tiny_hybrid(vocab_size=VOCAB)
    hybrid.config.teacher_name = "/models/its-teacher"
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    exported = [export_gguf(tmp_path / "hybrid", tmp_path / "gguf"), export_qwen3_5(tmp_path / "hybrid", tmp_path / "q")]
    cut = tmp_path / "cut" / "model.gguf"
    cut.parent.mkdir()
    cut.write_bytes(exported[0].read_bytes()[:exported[0].stat().st_size // 2])
    for teacher, origin in zip([*exported, cut, tmp_path / "hybrid"], [True, False, True, True]):
        capsys.readouterr()
        assert main(["convert", "--teacher", str(teacher), "--out", str(tmp_path / "out"), "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "is a Qwen3.5 model" in err or "is a taylor-calibrate hybrid" in err, err
        assert "Pass the Transformer it was converted from" + (" (/models/its-teacher)" if origin else " as") in err
        assert "distill --student" in err and "download" not in err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_transformers_cannot_read_from_our_gguf_names_the_export(tmp_path, monkeypatch):
    """`tokenize --model <our GGUF export>` where transformers' GGUF tokenizer reader fails (it wants keys of the
    architectures it loads; KeyError 'qwen35.full_attention_interval' on a real export) said the tokenizer files
    were damaged; it names the file as an export of a hybrid instead."""
    import taylor_calibrate.teacher as teacher_mod

    tok = tiny_tokenizer([p.read_text() for p in sorted(tiny_corpus(tmp_path / "corpus").iterdir())])
    _, hybrid = tiny_hybrid(vocab_size=VOCAB)
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    path = export_gguf(tmp_path / "hybrid", tmp_path / "gguf")

    def unreadable(where, kw):
        raise KeyError("qwen35.full_attention_interval")

    monkeypatch.setattr(teacher_mod, "_tokenizer", unreadable)
    with pytest.raises(ValueError, match="is a Qwen3.5 model") as e:
        teacher_mod.load_tokenizer(str(path))
    assert "damaged" not in str(e.value)


def test_export_cli_writes_f16_matrices_on_request(tmp_path, capsys):
    """`export --format gguf --gguf_type f16`: the weight matrices in f16 (what llama.cpp serves), the rest fp32;
    --gguf_type with --format qwen3_5 is refused at parse."""
    from taylor_calibrate.cli import main

    tok = tiny_tokenizer([p.read_text() for p in sorted(tiny_corpus(tmp_path / "corpus").iterdir())])
    _, hybrid = tiny_hybrid(vocab_size=VOCAB)
    save_hybrid(hybrid, tok, tmp_path / "hybrid")
    assert main(["export", "--model", str(tmp_path / "hybrid"), "--format", "gguf", "--gguf_type", "f16",
                 "--out", str(tmp_path / "g")]) == 0
    assert f"serve: llama-server -m {tmp_path / 'g' / 'model.gguf'} -fa on -np N --no-kv-unified" in \
        capsys.readouterr().out  # the settings the measurements chose (docs/serving.md)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "g" / "model.gguf")).tensors}
    assert types["blk.0.attn_qkv.weight"] == types["token_embd.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == gguf.GGMLQuantizationType.F32
    capsys.readouterr()
    assert main(["export", "--model", str(tmp_path / "hybrid"), "--gguf_type", "f16", "--out", str(tmp_path / "q")]) != 0
    assert "applies to --format gguf only" in capsys.readouterr().err and not (tmp_path / "q").exists()
