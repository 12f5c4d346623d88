"""Shared fixtures: tiny random teachers of every supported architecture, on the CPU."""
import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (ops/attention_stats_triton.py) can run on a CPU only under Triton's interpreter, which Triton
    # picks when a kernel is decorated, i.e. at import; transformers imports triton, so set it before that.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import taylor_calibrate  # noqa: F401,E402  (registers the hybrid with the Auto* factories)

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
