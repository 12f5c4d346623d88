"""Teacher loading: clear errors for everything a user can get wrong."""
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from taylor_calibrate.teacher import check_architecture, load_teacher, resolve_device, resolve_dtype


def test_unsupported_architecture_lists_supported():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gpt2", n_layer=1)
    with pytest.raises(ValueError, match="unsupported teacher architecture 'gpt2'.*llama, qwen2, qwen3, mistral"):
        check_architecture(cfg)


def test_local_checkpoint_roundtrip(tmp_path):
    from conftest import tiny_teacher

    teacher = tiny_teacher("qwen3")
    teacher.save_pretrained(tmp_path)
    # a tokenizer is needed beside it: reuse a tiny one built offline
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    loaded = load_teacher(str(tmp_path))
    assert loaded.model.config.model_type == "qwen3"
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_unsupported_local_checkpoint(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("gpt2", n_layer=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported teacher architecture"):
        load_teacher(str(tmp_path))


@pytest.mark.parametrize("spec, err, match", [
    ("/nonexistent/model.gguf", FileNotFoundError, "does not exist"),
    ("./no/such/dir", FileNotFoundError, "neither an HF checkpoint directory"),
])
def test_missing_paths(spec, err, match):
    with pytest.raises(err, match=match):
        load_teacher(spec)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json; pass an HF checkpoint directory"):
        load_teacher(str(tmp_path))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # an `export --format gguf` output: the file is what to pass
    with pytest.raises(FileNotFoundError, match="no config.json; it holds model.gguf: pass that file instead"):
        load_teacher(str(tmp_path))


def test_unreachable_hub_id(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: the env alone is late
    with pytest.raises(OSError, match="hub is not reachable"):
        load_teacher("some-org/some-model-that-is-not-cached")


def test_device_and_dtype_options():
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="dtype='fp8'"):
        resolve_dtype("fp8", resolve_device("cpu"))


def test_embedded_teacher_tokenizer_isolates_digits():
    """The embedded teacher's GGUF names pre-tokenizer `smollm` (digits split one by one before GPT-2's split); the
    tokenizer must split text the same way, so that its ids are llama.cpp's (`llama-tokenize` on the GGUF gives
    these tokens) and the ones the teacher was trained on."""
    from taylor_calibrate.teacher import DEFAULT_TEACHER, gguf_pre_tokenizer, load_tokenizer, _locate

    where, kw = _locate(DEFAULT_TEACHER)
    assert gguf_pre_tokenizer(f"{where}/{kw['gguf_file']}") == "smollm"
    tok = load_tokenizer()
    pieces = {"\n    0x1f": ["ĊĠĠĠĠ", "0", "x", "1", "f"], "x = 12345": ["x", "Ġ=", "Ġ", "1", "2", "3", "4", "5"]}
    for text, want in pieces.items():
        assert tok.convert_ids_to_tokens(tok(text)["input_ids"]) == want, text


def test_gguf_split_left_alone_for_other_pre_tokenizers(monkeypatch):
    """Only the pre-tokenizers that isolate digits change the split; any other name keeps transformers' build."""
    import taylor_calibrate.teacher as teacher_mod

    monkeypatch.setenv("TAYLOR_CALIBRATE_TEACHER_CACHE", "off")  # the GGUF's own pre-tokenizer name is what changes

    monkeypatch.setattr(teacher_mod, "gguf_pre_tokenizer", lambda path: "llama-bpe")
    tok = teacher_mod.load_tokenizer()
    assert tok.convert_ids_to_tokens(tok("\n    0x1f")["input_ids"])[:2] == ["ĊĠĠĠ", "Ġ"]


@pytest.mark.parametrize("pre,whole", [("llama-bpe", True), ("qwen2", False)])
def test_gguf_tokenizer_takes_vocabulary_words_whole_where_llama_cpp_does(monkeypatch, pre, whole):
    """llama.cpp's Llama 3 pre-tokenizers (IGNORE_MERGES_PRE) take a pre-token that is a vocabulary entry whole
    (ignore_merges), which transformers' GGUF tokenizer does not: set where the GGUF's pre-tokenizer says so (on the
    real Llama 3 vocabulary against the original tokenizer and llama.cpp: tests/test_export_gguf.py)."""
    import json

    import taylor_calibrate.teacher as teacher_mod

    monkeypatch.setenv("TAYLOR_CALIBRATE_TEACHER_CACHE", "off")
    monkeypatch.setattr(teacher_mod, "gguf_pre_tokenizer", lambda path: pre)
    tok = teacher_mod.load_tokenizer()
    assert json.loads(tok.backend_tokenizer.to_str())["model"]["ignore_merges"] is whole


def test_a_gguf_teacher_is_parsed_once_and_loads_as_before(monkeypatch):
    """transformers reads a GGUF three times (config, weights, tokenizer); inside load_teacher they share one reader,
    and the teacher is the same: equal weights and token ids to a load without sharing, which parses three times."""
    import contextlib

    import gguf
    import torch

    import taylor_calibrate.teacher as teacher_mod

    monkeypatch.setenv("TAYLOR_CALIBRATE_TEACHER_CACHE", "off")  # the cache's own test is below
    real, made = gguf.GGUFReader, []

    def counting(path, *args, **kwargs):
        made.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    shared = load_teacher()
    assert len(made) == 1 and gguf.GGUFReader is counting  # one parse; the library's reader back afterwards
    monkeypatch.setattr(teacher_mod, "shared_gguf_readers", contextlib.nullcontext)
    made.clear()
    plain = load_teacher()
    assert len(made) == 3
    want = plain.model.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in shared.model.state_dict().items())
    text = "def f(x):\n    return x * 12345  # héllo"
    assert shared.tokenizer(text)["input_ids"] == plain.tokenizer(text)["input_ids"]


@pytest.fixture
def own_cache(tmp_path):
    """A teacher cache of the test's own, removed when the test ends (entries are hundreds of MB, and pytest keeps the
    temporary folders of its last runs)."""
    import shutil

    root = tmp_path / "cache"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _same_teacher(a, b) -> bool:
    import torch

    want = a.model.state_dict()
    text = "def f(x):\n    return x * 12345  # héllo"
    return (want.keys() == b.model.state_dict().keys()
            and all(torch.equal(t, want[k]) for k, t in b.model.state_dict().items())
            and a.tokenizer(text)["input_ids"] == b.tokenizer(text)["input_ids"])


def test_a_gguf_teacher_loads_from_the_teacher_cache_after_its_first_load(monkeypatch, own_cache):
    """The first load of a GGUF teacher writes it, dequantised, into the teacher cache; later loads read that entry
    without parsing the GGUF, and give the same weights, token ids and tokenizer.ggml.* values. Each dtype has its
    own weights; the cache off writes nothing."""
    import gguf
    import torch

    import taylor_calibrate.teacher as teacher_mod

    monkeypatch.setenv("TAYLOR_CALIBRATE_TEACHER_CACHE", "off")
    plain = load_teacher()
    assert teacher_mod.teacher_cache_entry(teacher_mod.DEFAULT_TEACHER) is None  # off: no entry to read or write
    monkeypatch.setenv("TAYLOR_CALIBRATE_TEACHER_CACHE", str(own_cache))
    first = load_teacher()
    entry = teacher_mod.teacher_cache_entry(teacher_mod.DEFAULT_TEACHER)
    assert entry.parent == own_cache and (entry / "float32" / "model.safetensors").is_file()
    real, made = gguf.GGUFReader, []
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: made.append(a) or real(*a, **k))
    again = load_teacher()
    assert made == [] and _same_teacher(plain, first) and _same_teacher(plain, again)
    assert teacher_mod.load_tokenizer()("x = 12345")["input_ids"] == plain.tokenizer("x = 12345")["input_ids"]
    meta = teacher_mod.teacher_gguf_tokenizer(teacher_mod.DEFAULT_TEACHER)
    assert made == [] and meta["tokenizer.ggml.pre"] == "smollm"
    monkeypatch.setattr(gguf, "GGUFReader", real)
    assert meta == teacher_mod.gguf_tokenizer_metadata(teacher_mod.teacher_gguf_path(teacher_mod.DEFAULT_TEACHER))
    half = load_teacher(dtype=torch.bfloat16)
    assert (entry / "bfloat16" / "model.safetensors").is_file() and half.model.dtype == torch.bfloat16
    assert all(torch.equal(t, plain.model.state_dict()[k].bfloat16()) for k, t in half.model.state_dict().items())


def test_the_teacher_cache_entry_is_named_by_content_and_library(monkeypatch, tmp_path):
    """Another GGUF (other bytes) or another transformers gives another entry, so a stale one is never read."""
    import importlib.metadata

    import taylor_calibrate.teacher as teacher_mod

    monkeypatch.setenv("TAYLOR_CALIBRATE_TEACHER_CACHE", str(tmp_path))
    spec = teacher_mod.DEFAULT_TEACHER
    entry = teacher_mod.teacher_cache_entry(spec)
    monkeypatch.setattr(teacher_mod, "teacher_hash", lambda s: "sha256:other")
    assert teacher_mod.teacher_cache_entry(spec) != entry
    monkeypatch.undo()
    monkeypatch.setenv("TAYLOR_CALIBRATE_TEACHER_CACHE", str(tmp_path))
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0" if name == "transformers" else version(name))
    assert teacher_mod.teacher_cache_entry(spec) not in (entry, None)
    assert teacher_mod.teacher_cache_entry("some-org/some-model") is None  # a hub id or directory: nothing to cache


def test_a_damaged_teacher_cache_entry_is_written_again(monkeypatch, own_cache, caplog):
    """A truncated weights file in an entry is named in the log, and the teacher loads from its GGUF and is cached
    again: never a failed command or a wrong teacher."""
    import taylor_calibrate.teacher as teacher_mod

    monkeypatch.setenv("TAYLOR_CALIBRATE_TEACHER_CACHE", str(own_cache))
    first = load_teacher()
    weights = teacher_mod.teacher_cache_entry(teacher_mod.DEFAULT_TEACHER) / "float32" / "model.safetensors"
    damaged = weights.read_bytes()[:1000]
    weights.unlink()  # a new file: `first` still reads the old one (memory-mapped)
    weights.write_bytes(damaged)
    with caplog.at_level("WARNING", logger="taylor_calibrate"):
        again = load_teacher()
    assert "could not be read" in caplog.text and _same_teacher(first, again)
    assert weights.stat().st_size > 1000


def test_a_teacher_cache_that_cannot_be_written_leaves_the_load_as_it_was(monkeypatch, tmp_path, caplog):
    """A cache path that is not a directory (a file in its way) costs a line in the log, not the command."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TAYLOR_CALIBRATE_TEACHER_CACHE", str(tmp_path / "file" / "cache"))
    with caplog.at_level("WARNING", logger="taylor_calibrate"):
        loaded = load_teacher()
    assert "cannot be used" in caplog.text and loaded.model.config.model_type == "llama"


def test_a_gguf_teacher_is_always_dequantised(monkeypatch):
    """transformers can keep a GGUF's weights packed behind its own linear layers (with the `kernels` package); a
    teacher's weights are read as tensors, so load_teacher asks for plain ones."""
    import transformers

    import taylor_calibrate.teacher as teacher_mod

    if not hasattr(transformers, "GgufConfig"):
        pytest.skip("this transformers always dequantises")
    opts = teacher_mod._dense({"gguf_file": "x.gguf"})
    assert opts["quantization_config"].dequantize is True and teacher_mod._dense({}) == {}
    monkeypatch.setenv("TAYLOR_CALIBRATE_TEACHER_CACHE", "off")
    model = load_teacher().model
    assert type(model.model.layers[0].self_attn.q_proj) is torch_linear()


def torch_linear():
    import torch

    return torch.nn.Linear


def test_a_truncated_gemma3_gguf_is_named_truncated(tmp_path, monkeypatch):
    """A GGUF says `gemma3` where transformers' model type is `gemma3_text`: a cut-off Gemma 3 file was refused as
    an unsupported architecture instead of as truncated."""
    import taylor_calibrate.teacher as teacher_mod
    from taylor_calibrate.teacher import DEFAULT_TEACHER, _locate

    where, kw = _locate(DEFAULT_TEACHER)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((Path(where) / kw["gguf_file"]).read_bytes()[:4_000_000])
    monkeypatch.setattr(teacher_mod, "gguf_architecture", lambda path: ("gemma3", None))
    with pytest.raises(ValueError, match="is truncated or not a GGUF model"):
        load_teacher(str(cut), torch.device("cpu"), torch.float32)
    monkeypatch.setattr(teacher_mod, "gguf_architecture", lambda path: ("rwkv7", None))
    with pytest.raises(ValueError, match="holds a 'rwkv7' model, which transformers cannot load"):
        load_teacher(str(cut), torch.device("cpu"), torch.float32)


def test_a_device_this_package_does_not_run_on_is_refused():
    for device in ("gpu", "mps", "meta", "cuda:x"):
        with pytest.raises(ValueError, match="use auto, cpu, cuda or cuda:N"):
            resolve_device(device)


def test_gguf_tokenizer_gets_no_token_past_its_vocabulary():
    """transformers reads a GGUF's byte-level vocabulary into a GPT-2 tokenizer, whose default `<|endoftext|>` is added
    when the vocabulary lacks it (Llama 3's), one id past the teacher's embedding: `without_foreign_tokens` drops it and
    leaves every id of the vocabulary's own tokens as it was; a vocabulary that holds the token keeps it."""
    from transformers import GPT2Tokenizer

    from taylor_calibrate.teacher import without_foreign_tokens

    alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "<|begin|>"]
    merges = [("h", "e"), ("l", "l"), ("he", "ll")]
    vocab = {t: i for i, t in enumerate(alphabet + ["he", "ll", "hell"])}
    tok = GPT2Tokenizer(vocab=dict(vocab), merges=list(merges))  # as transformers' GGUF reader builds it
    assert len(tok) == len(vocab) + 1 and tok.convert_tokens_to_ids("<|endoftext|>") == len(vocab)
    before = tok("hello world", add_special_tokens=False).input_ids
    tok = without_foreign_tokens(tok)
    assert len(tok) == len(vocab) and max(tok("hello <|endoftext|> world").input_ids) < len(vocab)
    assert tok("hello world", add_special_tokens=False).input_ids == before
    held = GPT2Tokenizer(vocab={**vocab, "<|endoftext|>": len(vocab)}, merges=list(merges))
    assert len(without_foreign_tokens(held)) == len(vocab) + 1


def test_real_llama3_gguf_vocabulary_is_its_size():
    """Llama 3's vocabulary as llama.cpp ships it ($LLAMA_CPP_VOCABS): the tokenizer a GGUF teacher gets has exactly
    the file's 128256 tokens, the rows of the model's embedding."""
    import os

    import gguf

    from taylor_calibrate.teacher import load_tokenizer

    folder = os.environ.get("LLAMA_CPP_VOCABS")
    if not folder:
        pytest.skip("$LLAMA_CPP_VOCABS (llama.cpp's models/ folder, with ggml-vocab-*.gguf) is not set")
    vocab = Path(folder) / "ggml-vocab-llama-bpe.gguf"
    n = len(gguf.GGUFReader(str(vocab)).fields["tokenizer.ggml.tokens"].data)
    assert n == 128256 and len(load_tokenizer(str(vocab))) == n
