"""Shared fixtures: tiny random teachers of every supported architecture, on the CPU."""
import atexit
import contextlib
import os
import shutil
import tempfile

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if not torch.cuda.is_available():
    # Triton kernels (ops/attention_stats_triton.py) can run on a CPU only under Triton's interpreter, which Triton
    # picks when a kernel is decorated, i.e. at import; transformers imports triton, so set it before that.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

import taylor_calibrate  # noqa: F401,E402  (registers the hybrid with the Auto* factories)

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # workers share the cores: torch's threads split them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# The session's token cache (`data.cached_tokens`), never the user's ~/.cache: set before any test module builds the
# environment of the CLI processes it starts, removed at exit.
_TOKEN_CACHE = tempfile.mkdtemp(prefix="tc-token-cache-")
os.environ["TAYLOR_CALIBRATE_TOKEN_CACHE"] = _TOKEN_CACHE
atexit.register(shutil.rmtree, _TOKEN_CACHE, True)
_TEACHER_CACHE = tempfile.mkdtemp(prefix="tc-teacher-cache-")  # likewise the dequantised GGUF teachers
os.environ["TAYLOR_CALIBRATE_TEACHER_CACHE"] = _TEACHER_CACHE
atexit.register(shutil.rmtree, _TEACHER_CACHE, True)

def triton_interpreter_shims():
    """Two bugs of Triton 3.6's interpreter (not of the compiled kernel), patched for these tests only:
    - a runtime loop bound becomes an int through a 1-element array, which numpy >= 2.4 refuses ("only
      0-dimensional arrays ..."; triton-lang/triton#9171, fixed upstream after 3.6);
    - tl.dot on bf16 multiplies the uint16 bit patterns the interpreter stores bf16 in; on a GPU a bf16 dot is exact
      products accumulated in fp32, which is what widening the bits to fp32 reproduces."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_shimmed", False):
        return
    interpreter._shimmed = True
    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype == tl.bfloat16:
            return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return x

    def patched_dot(self, a, b, d, *args):
        return create_dot(self, widen(a), widen(b), d, *args)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot


ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")


def tiny_config(arch: str, **over):
    """A few-layer model of `arch` with GQA (4 query / 2 KV heads), small enough for unit tests."""
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    if arch == "qwen2":
        kw.update(use_sliding_window=False)
    if arch == "mistral":
        kw.update(sliding_window=32)
    if arch == "gemma3_text":  # sliding local layers + a global one, q/k norm, softcaps off by default
        kw.update(sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                                 "full_attention"], query_pre_attn_scalar=16)
    kw.update(over)
    return AutoConfig.for_model(arch, **kw)


def tiny_teacher(arch: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    cfg = tiny_config(arch, **over)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    if arch == "qwen2":  # give the q/k/v biases non-zero values so that carrying them is tested
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias, layer.self_attn.v_proj.bias):
                    p.normal_(0, 0.1)
    return model.eval()


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


@contextlib.contextmanager
def one_thread():
    """Tiny ops: intra-op threads only contend (2 cores shared with other jobs), and spinning OpenMP workers can
    make a small test 100x slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture
def single_thread():
    with one_thread():
        yield


# --- a tiny *local* teacher: random llama + an offline byte-level BPE tokenizer + a small text corpus ----------
VOCAB = 300
WORDS = ("the a river stone light moves slowly over quiet hills while birds call and water runs "
         "under old bridges near small towns where people walk talk read write and rest").split()


def tiny_corpus(root, n_docs=12, words=120):
    """A directory of .txt files (enough documents that the sha1 split has both sides)."""
    g = torch.Generator().manual_seed(0)
    root.mkdir()
    for d in range(n_docs):
        idx = torch.randint(0, len(WORDS), (words,), generator=g).tolist()
        lines = [" ".join(WORDS[i] for i in idx[k:k + 12]) + "." for k in range(0, words, 12)]
        (root / f"doc{d:02d}.txt").write_text("\n".join(lines) + "\n")
    return root


def tiny_tokenizer(texts) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_local_teacher(root, **over):
    """(teacher_dir, corpus_dir) under `root`: a saved random llama with its tokenizer, and its corpus."""
    corpus = tiny_corpus(root / "corpus")
    teacher_dir = root / "teacher"
    tokenizer = tiny_tokenizer([p.read_text() for p in sorted(corpus.iterdir())])
    assert len(tokenizer) <= VOCAB
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", **{"vocab_size": VOCAB, "initializer_range": 0.1, **over})) \
        .save_pretrained(teacher_dir)
    tokenizer.save_pretrained(teacher_dir)
    return teacher_dir, corpus


def tiny_saved_hybrid(root):
    """A head-wise hybrid of `tiny_local_teacher` saved under root / "hybrid" (layer 0 softmax, layers 1-2 keep one KV
    group each, layer 3 all GDN): (hybrid_dir, teacher_dir)."""
    from transformers import AutoTokenizer

    from taylor_calibrate import GDNConfig, convert_teacher
    from taylor_calibrate.checkpoint import save_hybrid

    teacher_dir, _ = tiny_local_teacher(root)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    hybrid = convert_teacher(teacher, [1, 2, 3], GDNConfig(), kept_groups={1: [1], 2: [0]},
                             teacher_name=str(teacher_dir))
    save_hybrid(hybrid, AutoTokenizer.from_pretrained(teacher_dir), root / "hybrid")
    return root / "hybrid", teacher_dir


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded teacher's real tokenizer (loading it from the GGUF takes seconds: once per session)."""
    from transformers import AutoTokenizer

    from taylor_calibrate.teacher import embedded_teacher_path

    try:
        path = embedded_teacher_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (its directory on sys.path, as when it runs as a script)."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", root / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def decoded_logits(model, ids, prefill: int):
    """Logits of `ids` from a prefill of `prefill` tokens and then one token at a time through the cache."""
    out = model(ids[:, :prefill], use_cache=True)
    cache, logits = out.cache, [out.logits]
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, 1)
