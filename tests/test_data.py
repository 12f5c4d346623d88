"""Corpora: every source kind, the sha1 document split, token packing, and every error message."""

import functools
import json
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import PreTrainedTokenizerFast

from taylor_calibrate.data import (
    CorpusSpec,
    TokenSplits,
    load_documents,
    load_splits,
    pack_tokens,
    split_documents,
)


# ----------------------------------------------------------------------------- tiny offline tokenizers


def word_tokenizer(eos: bool = True) -> PreTrainedTokenizerFast:
    """Whitespace words "w0".."w99" -> ids 2..101, "<eos>" = 0: token ids can be written by hand."""
    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(100)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>" if eos else None)


@functools.lru_cache
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on a few strings: it encodes any text, like a real LLM tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "import os\nclass A:\n    pass\n"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def word_docs(n: int, words_per_doc: int = 10) -> list[tuple[str, str]]:
    """Doc i is the word w{i} repeated: every token tells which document it came from."""
    return [(f"doc{i:02d}.txt", " ".join([f"w{i}"] * words_per_doc)) for i in range(n)]


# ----------------------------------------------------------------------------- builtin corpus


def test_builtin_corpus_is_stdlib_source():
    docs = load_documents(CorpusSpec())
    ids = [doc_id for doc_id, _ in docs]
    assert len(ids) > 100 and ids == sorted(ids)
    assert {"os.py", "json/__init__.py", "asyncio/tasks.py"} <= set(ids)
    assert all(doc_id.endswith(".py") for doc_id in ids)
    skipped = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
    assert not any(skipped & set(doc_id.split("/")[:-1]) for doc_id in ids)
    assert "def " in dict(docs)["os.py"]


def test_builtin_load_splits_deterministic_and_disjoint():
    tok = byte_tokenizer()
    a = load_splits(CorpusSpec(), tok, seq_len=64, calib_seqs=4, heldout_seqs=2)
    b = load_splits(CorpusSpec(), tok, seq_len=64, calib_seqs=4, heldout_seqs=2)
    assert isinstance(a, TokenSplits)
    assert a.calib.shape == (4, 64) and a.heldout.shape == (2, 64) and a.calib.dtype == torch.long
    assert torch.equal(a.calib, b.calib) and torch.equal(a.heldout, b.heldout)
    calib_docs, heldout_docs = split_documents(load_documents(CorpusSpec()), 0.5)
    assert not {d for d, _ in calib_docs} & {d for d, _ in heldout_docs}


# ----------------------------------------------------------------------------- splitting


def test_split_is_disjoint_deterministic_and_stable():
    docs = word_docs(60)
    calib, heldout = split_documents(docs, 0.5)
    assert (calib, heldout) == split_documents(docs, 0.5)
    assert (calib, heldout) == split_documents(docs[::-1], 0.5)  # input order does not matter
    calib_ids, heldout_ids = {d for d, _ in calib}, {d for d, _ in heldout}
    assert not calib_ids & heldout_ids and calib_ids | heldout_ids == {d for d, _ in docs}
    # A new document takes a side; no other document moves.
    calib2, heldout2 = split_documents(docs + [("new.txt", "w0")], 0.5)
    assert {d for d, _ in calib2} - {"new.txt"} == calib_ids
    assert {d for d, _ in heldout2} - {"new.txt"} == heldout_ids
    # A smaller fraction only moves documents from held-out to calibration.
    calib3, heldout3 = split_documents(docs, 0.2)
    assert {d for d, _ in heldout3} < heldout_ids and len(heldout3) < len(calib3)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_split_rejects_fraction_outside_unit_interval(fraction):
    with pytest.raises(ValueError, match=r"heldout_fraction must be in \(0, 1\)"):
        split_documents(word_docs(10), fraction)


def test_split_with_one_side_empty_names_corpus_and_fix():
    with pytest.raises(ValueError, match=r"corpus 'mine\.txt'.* split is empty \(1 documents.*more documents"):
        split_documents(word_docs(1), 0.5, source="mine.txt")


# ----------------------------------------------------------------------------- packing


def test_pack_exact_content():
    docs = [("a", "w1 w2 w3"), ("b", "w4 w5"), ("c", "w6 w7 w8 w9")]
    rows = pack_tokens(docs, word_tokenizer(), seq_len=3, num_seqs=3)
    # stream: 3 4 5 <eos> 6 7 <eos> 8 9 10 11 <eos>; the first 3 rows of 3
    assert rows.tolist() == [[3, 4, 5], [0, 6, 7], [0, 8, 9]]
    assert rows.dtype == torch.long
    no_eos = [[3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert pack_tokens(docs, word_tokenizer(), 3, 3, add_eos=False).tolist() == no_eos
    assert pack_tokens(docs, word_tokenizer(eos=False), 3, 3).tolist() == no_eos  # no eos token to add


def test_pack_stops_tokenising_once_enough_tokens():
    tok, calls = word_tokenizer(), []

    class Counting:
        eos_token_id = tok.eos_token_id

        def __call__(self, text, **kwargs):
            calls.append(text)
            return tok(text, **kwargs)

    docs = word_docs(50)  # 11 tokens per document with eos
    rows = pack_tokens(docs, Counting(), seq_len=4, num_seqs=5)  # 20 tokens: 2 documents
    assert rows.shape == (5, 4) and len(calls) == 2


def test_pack_errors_name_the_problem():
    tok = word_tokenizer()
    with pytest.raises(ValueError, match=r"corpus 'small' gives only 6 tokens, need 2\*4=8.*--data.calib_seqs"):
        pack_tokens([("a", "w1 w2"), ("b", "w3 w4")], tok, seq_len=4, num_seqs=2, source="small")
    with pytest.raises(ValueError, match=r"corpus 'none' is empty"):
        pack_tokens([], tok, 4, 2, source="none")
    with pytest.raises(ValueError, match=r"corpus 'blank' is empty: its 2 documents give no tokens"):
        pack_tokens([("a", ""), ("b", "  \n")], tok, 4, 2, source="blank")
    with pytest.raises(ValueError, match=r"seq_len and num_seqs must be >= 1"):
        pack_tokens(word_docs(3), tok, 0, 2)


# ----------------------------------------------------------------------------- source kinds


def test_text_file_is_cut_into_chunks(tmp_path):
    paragraphs = [" ".join([f"w{i % 100}"] * 100) for i in range(40)]  # ~12 KB
    text = "\n\n".join(paragraphs) + "\n"
    path = tmp_path / "book.txt"
    path.write_text(text)
    docs = load_documents(CorpusSpec(source=str(path)))
    assert len(docs) > 3 and docs[0][0] == "book.txt:1"
    assert "".join(t for _, t in docs) == text  # chunks are the file, cut at blank lines
    splits = load_splits(CorpusSpec(source=str(path)), word_tokenizer(), seq_len=16, calib_seqs=4, heldout_seqs=4)
    assert splits.calib.shape == splits.heldout.shape == (4, 16)


def test_directory_recurses_sorted_and_skips_binaries(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b.py").write_text("w1 w2")
    (tmp_path / "sub" / "a.md").write_text("w3")
    (tmp_path / "a.txt").write_text("w4")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02w5")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main")
    docs = load_documents(CorpusSpec(source=str(tmp_path)))
    assert docs == [("a.txt", "w4"), ("b.py", "w1 w2"), ("sub/a.md", "w3")]


def test_directory_split_is_disjoint_at_token_level(tmp_path):
    for doc_id, text in word_docs(40):
        (tmp_path / doc_id).write_text(text)
    spec = CorpusSpec(source=str(tmp_path), heldout_fraction=0.3)
    splits = load_splits(spec, word_tokenizer(), seq_len=8, calib_seqs=10, heldout_seqs=5)
    calib_words = set(splits.calib.unique().tolist()) - {0}
    heldout_words = set(splits.heldout.unique().tolist()) - {0}
    assert calib_words and heldout_words and not calib_words & heldout_words


def test_jsonl(tmp_path):
    path = tmp_path / "c.jsonl"
    records = [{"text": "w1 w2", "content": "w7"}, {"text": "w3", "content": None}]
    path.write_text(json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n")
    assert load_documents(CorpusSpec(source=str(path))) == [("0", "w1 w2"), ("1", "w3")]
    assert load_documents(CorpusSpec(source=str(path), text_field="content")) == [("0", "w7"), ("1", "")]


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    rows = {"text": ["w1", "w2 w3", "w4"], "id": [0, 1, 2]}
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "ds")
    expected = [("0", "w1"), ("1", "w2 w3"), ("2", "w4")]
    assert load_documents(CorpusSpec(source=str(tmp_path / "ds"))) == expected

    val = datasets.Dataset.from_dict({"text": ["w9"]})
    datasets.DatasetDict(validation=val).save_to_disk(tmp_path / "dd")
    spec = CorpusSpec(source=str(tmp_path / "dd"))
    assert load_documents(spec) == [("0", "w9")]  # no "train": the first split
    with pytest.raises(ValueError, match=r"no split 'test'; splits present: \['validation'\]"):
        load_documents(CorpusSpec(source=str(tmp_path / "dd"), split="test"))

    datasets.DatasetDict(train=datasets.Dataset.from_dict(rows), validation=val).save_to_disk(tmp_path / "dd2")
    assert load_documents(CorpusSpec(source=str(tmp_path / "dd2"))) == expected
    assert load_documents(CorpusSpec(source=str(tmp_path / "dd2"), split="validation")) == [("0", "w9")]

    with pytest.raises(ValueError, match=r"no text field 'body'; fields present: \['text', 'id'\]"):
        load_documents(CorpusSpec(source=str(tmp_path / "ds"), text_field="body"))


def test_hub_source_offline_says_so(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConnectionError, match=r"'wikitext:wikitext-2-raw-v1'.*hub is unreachable.*save_to_disk"):
        load_documents(CorpusSpec(source="hf:wikitext:wikitext-2-raw-v1"))


# ----------------------------------------------------------------------------- source errors


def test_source_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*nowhere\.txt' does not exist"):
        load_documents(CorpusSpec(source=str(tmp_path / "nowhere.txt")))

    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"corpus '.*empty\.txt' is empty"):
        load_documents(CorpusSpec(source=str(tmp_path / "empty.txt")))

    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(ValueError, match=r"corpus '.*blank\.txt' is empty"):
        load_documents(CorpusSpec(source=str(tmp_path / "blank.txt")))

    (tmp_path / "bin.dat").write_bytes(b"\x00\xff")
    with pytest.raises(ValueError, match=r"'.*bin\.dat' is binary or not UTF-8"):
        load_documents(CorpusSpec(source=str(tmp_path / "bin.dat")))

    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match=r"'.*emptydir' holds no text files"):
        load_documents(CorpusSpec(source=str(tmp_path / "emptydir")))

    (tmp_path / "bindir").mkdir()
    (tmp_path / "bindir" / "x.bin").write_bytes(b"\x00")
    with pytest.raises(ValueError, match=r"'.*bindir' holds no text files"):
        load_documents(CorpusSpec(source=str(tmp_path / "bindir")))

    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"corpus '.*empty\.jsonl' is empty"):
        load_documents(CorpusSpec(source=str(tmp_path / "empty.jsonl")))

    (tmp_path / "body.jsonl").write_text('{"body": "w1", "id": 3}\n')
    with pytest.raises(ValueError, match=r"body\.jsonl:1 has no text field 'text'; fields present: \['body', 'id'\]"):
        load_documents(CorpusSpec(source=str(tmp_path / "body.jsonl")))

    (tmp_path / "bad.jsonl").write_text('{"text": "w1"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not valid JSON"):
        load_documents(CorpusSpec(source=str(tmp_path / "bad.jsonl")))


# ----------------------------------------------------------------------------- token shards


def test_token_shards_hold_the_packed_rows(tmp_path):
    """write_tokens keeps the document split and the packing: its first windows are load_splits' rows; a second call
    reuses the directory; another tokenizer or corpus is refused."""
    from taylor_calibrate.data import TokenWindows, write_tokens

    for doc_id, text in word_docs(40):
        (tmp_path / "c").mkdir(exist_ok=True)
        (tmp_path / "c" / doc_id).write_text(text)
    spec = CorpusSpec(source=str(tmp_path / "c"), heldout_fraction=0.3)
    tok = word_tokenizer()
    out = write_tokens(spec, tok, tmp_path / "tok")
    meta = json.loads((out / "tokens.json").read_text())
    assert meta["dtype"] == "uint16" and sum(meta["documents"].values()) == 40
    assert sum(meta["tokens"].values()) == 40 * 11  # 10 words + eos per document
    splits = load_splits(spec, tok, seq_len=8, calib_seqs=10, heldout_seqs=5)
    calib, heldout = TokenWindows(out, "calib", 8), TokenWindows(out, "heldout", 8)
    assert torch.equal(calib.first(10), splits.calib) and torch.equal(heldout.first(5), splits.heldout)
    assert calib.shape == (meta["tokens"]["calib"] // 8, 8)
    assert torch.equal(calib[torch.tensor([3, 0])], calib.first(4)[[3, 0]])
    stamp = (out / "calib.bin").stat().st_mtime_ns
    assert write_tokens(spec, tok, out) == out and (out / "calib.bin").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match=r"another corpus or tokenizer \(\['tokenizer'\]"):
        write_tokens(spec, byte_tokenizer(), out)
    with pytest.raises(ValueError, match=r"fewer than the 999 asked"):
        heldout.first(999)
    with pytest.raises(ValueError, match="holds token shards"):
        load_documents(CorpusSpec(source=str(out)))


def test_step_windows_are_a_pure_function_of_step_and_rank():
    from taylor_calibrate import data
    from taylor_calibrate.data import step_windows

    num, batch = 10, 4
    order = torch.cat([step_windows(num, batch, s, seed=3) for s in range(1, 11)])  # 40 windows = 4 epochs
    for e in range(4):  # every epoch is a permutation
        assert sorted(order[e * num:(e + 1) * num].tolist()) == list(range(num))
    assert not torch.equal(order[:num], order[num:2 * num])  # a new shuffle per epoch
    data._epoch_permutation.cache_clear()  # a fresh process: the same windows for the same (step, rank)
    for s in (7, 1, 10):
        assert torch.equal(step_windows(num, batch, s, seed=3), order[(s - 1) * batch:s * batch])
        ranks = [step_windows(num, batch, s, seed=3, rank=r, world=2) for r in (0, 1)]
        assert torch.equal(torch.cat(ranks), order[(s - 1) * batch:s * batch])  # ranks split the global batch
    assert not torch.equal(step_windows(num, batch, 1, seed=4), order[:batch])
    with pytest.raises(ValueError, match="multiple of the 3 processes"):
        step_windows(num, batch, 1, seed=0, world=3)


def test_hub_source_streams_into_shards(tmp_path, monkeypatch):
    """hf: sources are read in datasets' streaming mode (here a local IterableDataset), split by record index."""
    from taylor_calibrate.data import TokenWindows, write_tokens

    texts = [" ".join([f"w{i}"] * 5) for i in range(30)]
    calls = {}

    def streaming(repo, config=None, split=None, streaming=False):
        calls.update(repo=repo, config=config, split=split, streaming=streaming)
        return datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", streaming)
    spec = CorpusSpec(source="hf:me/corpus:en")
    out = write_tokens(spec, word_tokenizer(), tmp_path / "tok")
    assert calls == {"repo": "me/corpus", "config": "en", "split": "train", "streaming": True}
    held = {f"{i}" for i in range(30) if data_unit_hash(str(i)) < 0.5}
    words = set(TokenWindows(out, "heldout", 6).first(len(held)).unique().tolist()) - {0}
    assert words == {i + 2 for i in map(int, held)}  # exactly the held-out records' words


def data_unit_hash(doc_id):
    from taylor_calibrate.data import _unit_hash
    return _unit_hash(doc_id)


def test_pysrc_corpus_is_stdlib_and_site_packages():
    docs = load_documents(CorpusSpec(source="pysrc"))
    ids = [d for d, _ in docs]
    assert len(ids) == len(set(ids))
    assert "os.py" in ids and "site/torch/__init__.py" in ids and "site/numpy/__init__.py" in ids
    assert len(ids) > 5000 and all(i.endswith((".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh"))
                                   for i in ids)
    assert any(i.startswith("site/torch/include/") and i.endswith(".h") for i in ids)  # C++ headers count too
    assert load_documents(CorpusSpec(source="pysrc"))[:50] == docs[:50]  # deterministic
    # builtin's documents keep builtin's ids: at the same fraction, builtin's held-out text is held out here too
    builtin_heldout = {d for d, _ in split_documents(load_documents(CorpusSpec()), 0.5)[1]}
    pysrc_calib = {d for d, _ in split_documents(docs, 0.5)[0]}
    assert builtin_heldout and not builtin_heldout & pysrc_calib


def test_distill_data_reads_a_token_directory_or_the_cache(tmp_path, caplog, monkeypatch):
    """distill's data: --data.source naming a token directory is read as is (checked against the model's
    tokenizer); any other source comes from the token cache. A budget beyond the corpus warns."""
    from taylor_calibrate.config import DataArgs
    from taylor_calibrate.data import distill_data, write_tokens

    monkeypatch.setenv("TAYLOR_CALIBRATE_TOKEN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "c").mkdir()
    for doc_id, text in word_docs(40):
        (tmp_path / "c" / doc_id).write_text(text)
    tok = word_tokenizer()
    train, heldout = distill_data(DataArgs(source=str(tmp_path / "c"), seq_len=8, eval_seqs=3), tok, budget=100)
    assert train.root.parent == tmp_path / "cache" and train.root.name.startswith("c-") and heldout.shape == (3, 8)
    shards = write_tokens(CorpusSpec(source=str(tmp_path / "c")), tok, tmp_path / "shards")
    with caplog.at_level("WARNING"):
        train2, heldout2 = distill_data(DataArgs(source=str(shards), seq_len=8, eval_seqs=3), tok, budget=10 ** 6)
    assert train2.root == shards and len(list((tmp_path / "cache").iterdir())) == 2  # the entry and .locks
    assert torch.equal(train2.first(5), train.first(5)) and torch.equal(heldout2, heldout)
    assert "training repeats them" in caplog.text
    with pytest.raises(ValueError, match="another tokenizer than the model's"):
        distill_data(DataArgs(source=str(shards), seq_len=8, eval_seqs=3), byte_tokenizer(), 100)


def _counting_tokenizer(monkeypatch):
    """word_tokenizer, and a list that gets one entry per write_tokens tokenisation (not per cache read)."""
    from taylor_calibrate import data

    runs, real = [], data.write_tokens

    def counted(spec, tokenizer, out, rebuild=False, shards=None):
        if shards is None and not (Path(out) / "tokens.json").exists():
            runs.append(Path(out))
        return real(spec, tokenizer, out, rebuild, shards)

    monkeypatch.setattr(data, "write_tokens", counted)
    return runs


def test_the_token_cache_tokenises_a_corpus_once_per_tokenizer(tmp_path, monkeypatch):
    """The second run on the same corpus and tokenizer reads the cache; a changed corpus file, another tokenizer or
    another split gets its own shards; a damaged entry is written again; --data.token_cache wins over the env."""
    from taylor_calibrate.config import DataArgs
    from taylor_calibrate.data import cached_tokens, distill_data

    monkeypatch.setenv("TAYLOR_CALIBRATE_TOKEN_CACHE", str(tmp_path / "cache"))
    runs = _counting_tokenizer(monkeypatch)
    corpus = tmp_path / "c"
    corpus.mkdir()
    for doc_id, text in word_docs(40):
        (corpus / doc_id).write_text(text)
    spec = DataArgs(source=str(corpus), seq_len=8, eval_seqs=3)
    first, _ = distill_data(spec, word_tokenizer(), 100)
    again, _ = distill_data(spec, word_tokenizer(), 100)
    assert again.root == first.root and len(runs) == 1
    (corpus / "doc00.txt").write_text("w1 w2 w3")  # a changed file: new shards, the old ones are not read
    changed, _ = distill_data(spec, word_tokenizer(), 100)
    assert changed.root != first.root and len(runs) == 2
    assert changed.meta["tokens"] != first.meta["tokens"]
    other = cached_tokens(spec, byte_tokenizer())
    split = cached_tokens(DataArgs(source=str(corpus), heldout_fraction=0.3), word_tokenizer())
    assert len({changed.root, other, split}) == 3 and len(runs) == 4
    (changed.root / "calib.bin").write_bytes(b"\0")  # a damaged entry: written again, not read
    assert cached_tokens(spec, word_tokenizer()) == changed.root and len(runs) == 5
    mine = cached_tokens(DataArgs(source=str(corpus), token_cache=str(tmp_path / "mine")), word_tokenizer())
    assert mine.parent == tmp_path / "mine" and len(runs) == 6


def test_builtin_sources_are_keyed_by_the_python_install(tmp_path, monkeypatch):
    """builtin / pysrc have no corpus path: their cache key is the stamp of the files they read, so a changed
    install (here a stdlib file touched) does not reuse the old shards."""
    import os

    from taylor_calibrate import data

    stdlib = tmp_path / "stdlib"
    (stdlib / "json").mkdir(parents=True)
    (stdlib / "os.py").write_text("import sys\n")
    (stdlib / "json" / "__init__.py").write_text("def dumps(x):\n    return x\n")
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib)})
    stamp = data.corpus_stamp("builtin")
    assert stamp["files"] == 2 and stamp["path"] == f"builtin of {stdlib}"
    entry = data.cache_entry(CorpusSpec(source="builtin", token_cache=str(tmp_path / "cache")), word_tokenizer())
    os.utime(stdlib / "os.py", ns=(1, 1))
    assert data.corpus_stamp("builtin")["sha1"] != stamp["sha1"]
    assert data.cache_entry(CorpusSpec(source="builtin", token_cache=str(tmp_path / "cache")),
                            word_tokenizer()) != entry


def test_two_processes_asking_at_once_tokenise_once(tmp_path, monkeypatch, caplog):
    """Two callers of one cache entry at the same time: the first tokenises under the entry's lock, the second
    waits for it and reads what it wrote."""
    import threading

    from taylor_calibrate.data import cached_tokens

    runs = _counting_tokenizer(monkeypatch)
    corpus = tmp_path / "c"
    corpus.mkdir()
    for doc_id, text in word_docs(40):
        (corpus / doc_id).write_text(text)
    spec = CorpusSpec(source=str(corpus), token_cache=str(tmp_path / "cache"))
    started, go = threading.Event(), threading.Event()

    class Held:  # word_tokenizer, holding the first caller inside its tokenisation until told to go on
        def __init__(self):
            self.tok = word_tokenizer()

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __len__(self):
            return len(self.tok)

        def __call__(self, texts, **k):
            if isinstance(texts, list):  # write_tokens' batches (the fingerprint's probe is one string)
                started.set()
                assert go.wait(60)
            return self.tok(texts, **k)

    got = {}
    first = threading.Thread(target=lambda: got.setdefault("first", cached_tokens(spec, Held())))
    second = threading.Thread(target=lambda: got.setdefault("second", cached_tokens(spec, word_tokenizer())))
    with caplog.at_level("INFO", logger="taylor_calibrate"):  # the lock's line is checkpoint's, the rest data's
        first.start()
        assert started.wait(60)
        second.start()
        for _ in range(600):  # until the second caller waits on the lock
            if "waiting for another process" in caplog.text:
                break
            threading.Event().wait(0.1)
        go.set()
        first.join(60)
        second.join(60)
    assert "waiting for another process" in caplog.text
    assert got["first"] == got["second"] and len(runs) == 1


def test_repeat_spans_copy_earlier_text_later_deterministically():
    from taylor_calibrate.data import repeat_spans

    ids = torch.arange(4 * 1024).reshape(4, 1024)  # every token distinct: a copy is visible as a repeat
    windows = torch.tensor([7, 3, 11, 5])
    out = repeat_spans(ids, windows, 1.0, seed=0, step=1)
    assert out.shape == ids.shape and torch.equal(ids, torch.arange(4 * 1024).reshape(4, 1024))  # input untouched
    for r in range(4):
        changed = (out[r] != ids[r]).nonzero().flatten()
        assert changed.numel() >= 8 and changed.min() >= 512  # written in the second half, >= T/128 tokens
        n = changed.max() - changed.min() + 1
        span = out[r, changed.min():changed.max() + 1]
        assert torch.equal(span, torch.arange(span[0], span[0] + n))  # a contiguous piece of the row's own text
        assert r * 1024 <= span[0] and span[-1] < r * 1024 + 512  # ... from its first half
    assert torch.equal(out, repeat_spans(ids, windows, 1.0, seed=0, step=1))  # a pure function of its arguments
    assert not torch.equal(out, repeat_spans(ids, windows, 1.0, seed=0, step=2))  # another step, other spans
    # each row's span depends on its window, not on its place in the batch (processes / micro-batches agree)
    assert torch.equal(repeat_spans(ids[[1]], windows[[1]], 1.0, seed=0, step=1)[0] - 1024, out[1] - 1024)
    assert torch.equal(repeat_spans(ids, windows, 0.0, seed=0, step=1), ids)
    some = [int((repeat_spans(ids, windows, 0.5, seed=0, step=s) != ids).any(1).sum()) for s in range(1, 41)]
    assert 0.3 < sum(some) / (40 * 4) < 0.7  # about the fraction asked


def test_recall_rows_write_lookalike_needles_and_ask_one_again():
    from taylor_calibrate.data import recall_rows

    T = 1024
    ids = torch.arange(4 * T).reshape(4, T) + 10 ** 6  # every token distinct: written needles are visible
    windows = torch.tensor([7, 3, 11, 5])
    out = recall_rows(ids, windows, 1.0, seed=0, step=1)
    assert torch.equal(ids, torch.arange(4 * T).reshape(4, T) + 10 ** 6)  # input untouched
    for r in range(4):
        row = out[r].tolist()
        changed = (out[r] != ids[r]).nonzero().flatten().tolist()
        runs, cur = [], [changed[0]]
        for i in changed[1:]:  # contiguous written runs: the needles
            if i == cur[-1] + 1:
                cur.append(i)
            else:
                runs.append(cur)
                cur = [i]
        runs.append(cur)
        needles = [row[c[0]:c[-1] + 1] for c in runs]
        early = [n for c, n in zip(runs, needles) if c[-1] < 3 * T // 4]
        late = [n for c, n in zip(runs, needles) if c[0] >= 3 * T // 4]
        assert 2 <= len(early) <= 6 and len(late) == 1
        assert late[0] in early  # one needle asked again at the end
        frame = early[0][:3]
        assert all(n[:3] == frame for n in early)  # a shared frame ...
        assert len({tuple(n) for n in early}) == len(early)  # ... look-alike, not identical needles
        assert all(set(n) <= set(ids[r].tolist()) for n in needles)  # spans of the row's own text
    assert torch.equal(out, recall_rows(ids, windows, 1.0, seed=0, step=1))  # a pure function of its arguments
    assert not torch.equal(out, recall_rows(ids, windows, 1.0, seed=0, step=2))
    assert torch.equal(recall_rows(ids[[1]], windows[[1]], 1.0, seed=0, step=1)[0], out[1])  # batch place irrelevant
    assert torch.equal(recall_rows(ids, windows, 0.0, seed=0, step=1), ids)
    some = [int((recall_rows(ids, windows, 0.5, seed=0, step=s) != ids).any(1).sum()) for s in range(1, 41)]
    assert 0.3 < sum(some) / (40 * 4) < 0.7
