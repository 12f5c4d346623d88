"""Teachers of the sizes people deploy (the public checkpoints' configs, vocabulary and tokenizer included) with
random weights, for serving benchmarks: their hybrids come from the real `convert --target qwen3_5` path and the
real exports; what travels to a GPU is the same files with every weight zero (an engine's speed does not depend on
weight values), stored sparse so that a model of any size packs into its metadata.

  teacher: the shape's HF directory, random weights in bf16, the family's real tokenizer read from a vocabulary GGUF
      (llama.cpp ships them for its tokenizer tests: models/ggml-vocab-qwen2.gguf, ggml-vocab-llama-bpe.gguf).
  zero: a copy of an HF directory or a GGUF file with the weight bytes zero: each safetensors / GGUF file keeps its
      header and is extended to its full size as a hole, so `tar -S` packs it in kilobytes.
  bytes: what one decode step must read, per model (weights, KV cache at the context, GDN state) at CONTEXTxBATCH
      cells, and the roofline tokens/s over a copy bandwidth (serve_vllm.py measures it on the GPU).

  python benchmarks/deployed_shapes.py teacher --shape qwen2.5-1.5b --vocab ggml-vocab-qwen2.gguf --out runs/q15
  taylor-calibrate convert --teacher runs/q15 --target qwen3_5 --kv_budget 0.25 --context 32768 --init copy \\
      --align false --policy uniform --device cpu --data.calib_seqs 4 --data.eval_seqs 2 --out runs/q15_hybrid
  taylor-calibrate export --model runs/q15_hybrid --format qwen3_5 --out runs/q15_qwen3_5
  python benchmarks/deployed_shapes.py zero --src runs/q15 --out carry/teacher
  python benchmarks/deployed_shapes.py bytes --teacher runs/q15 --hybrid runs/q15_qwen3_5 --cells 32768x32
"""
from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

def _llama3(factor: float, **size) -> dict:
    """A Llama 3 config: the family's fields (vocabulary, GQA of 32 / 8 heads, llama3 RoPE scaling, token ids) and
    the size's."""
    return dict(num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=factor, high_freq_factor=4.0,
                                                       low_freq_factor=1.0, original_max_position_embeddings=8192),
                rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, **size)


# The public checkpoints' config.json fields that set a model's cost (weights are random): Qwen2.5-1.5B,
# Llama-3.2-1B, Llama-3.1-8B. Token ids are the checkpoints' own.
DEPLOYED = {
    "qwen2.5-1.5b": ("qwen2", "qwen2", dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=131072, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
        max_window_layers=21, bos_token_id=151643, eos_token_id=151643)),
    "llama-3.2-1b": ("llama", "llama-bpe", _llama3(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64, factor=32.0,
        tie_word_embeddings=True)),
    "llama-3.1-8b": ("llama", "llama-bpe", _llama3(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128, factor=8.0,
        tie_word_embeddings=False)),
}


# ---------------------------------------------------------------------------------------------------- teacher

def build_teacher(shape: str, vocab: str, out: Path, seed: int = 0, plain_rope: bool = False) -> Path:
    """The shape's HF directory: config, random weights (the architecture's own init, bf16), the tokenizer read from
    `vocab` (with its GGUF tokenizer metadata recorded, so a GGUF export writes the family's pre-tokenizer).
    `plain_rope` drops a llama3 rope_scaling (the frequencies change, the cost does not)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from taylor_calibrate.teacher import GGUF_TOKENIZER_KEY, gguf_pre_tokenizer, gguf_tokenizer_metadata, \
        load_tokenizer

    arch, family, fields = DEPLOYED[shape]
    fields = dict(fields)
    if plain_rope:
        fields.pop("rope_scaling", None)
    if out.exists():
        raise SystemExit(f"deployed_shapes: {out} exists; remove it or give another --out")
    if gguf_pre_tokenizer(vocab) != family:
        raise SystemExit(f"deployed_shapes: {vocab} holds the {gguf_pre_tokenizer(vocab)!r} vocabulary; {shape} "
                         f"needs llama.cpp's ggml-vocab-{family}.gguf")
    tok = load_tokenizer(str(vocab))
    tok.init_kwargs[GGUF_TOKENIZER_KEY] = gguf_tokenizer_metadata(vocab)
    config = AutoConfig.for_model(arch, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    part = out.with_name(out.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    model.save_pretrained(part)
    tok.save_pretrained(part)
    part.rename(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: {shape} ({arch}), {n / 1e9:.2f}B parameters, random weights; tokenizer {len(tok)} entries")
    return out


# ------------------------------------------------------------------------------------------------------- zero

def _header_end(path: Path) -> int:
    """Bytes of a weight file before its tensor data: a safetensors file's length prefix and JSON header, or a GGUF
    file's metadata and tensor infos up to its aligned data offset."""
    if path.suffix == ".safetensors":
        with open(path, "rb") as f:
            return 8 + struct.unpack("<Q", f.read(8))[0]
    import gguf

    return gguf.GGUFReader(str(path)).data_offset


def zero_copy(src: Path, dst: Path) -> list[str]:
    """`src` (an HF directory, or one .gguf file) copied to `dst` with every weight byte zero: each weight file's
    header copied, the rest a hole of the file's size (sparse on disk; reads as zeros). Returns the zeroed files."""
    if dst.exists():
        raise SystemExit(f"deployed_shapes: {dst} exists; remove it or give another --out")
    files = [src] if src.is_file() else sorted(p for p in src.iterdir() if p.is_file())
    dst_dir = dst.parent if src.is_file() else dst
    dst_dir.mkdir(parents=True, exist_ok=True)
    zeroed = []
    for p in files:
        target = dst if src.is_file() else dst / p.name
        if p.suffix in (".safetensors", ".gguf"):
            end = _header_end(p)
            with open(p, "rb") as f, open(target, "wb") as g:
                g.write(f.read(end))
                g.truncate(p.stat().st_size)
            zeroed.append(p.name)
        else:
            shutil.copy2(p, target)
    return zeroed


# ------------------------------------------------------------------------------------------------------ bytes

def _config(model_dir: str | Path) -> dict:
    c = json.loads((Path(model_dir) / "config.json").read_text())
    return c.get("text_config", c)


def weight_bytes(model_dir: str | Path, dtype_bytes: int = 2) -> int:
    """Weight bytes a decode step reads at `dtype_bytes` a parameter: every matrix once; the input embedding not at
    all (a step gathers B rows of it) unless it is tied to the output head, which reads all of it."""
    from safetensors import safe_open

    c, total, embed = _config(model_dir), 0, 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
                if name.endswith("embed_tokens.weight"):
                    embed = n
    return dtype_bytes * (total - (0 if c.get("tie_word_embeddings") else embed))


def step_bytes(model_dir: str | Path, context: int, batch: int, kv_bytes: int = 2, state_bytes: int = 4,
               weight_dtype_bytes: int = 2) -> dict:
    """Bytes one decode step of `batch` sequences at `context` tokens must move: the weights once, each attention
    layer's K and V of every cached position, and each GDN layer's recurrent state read and written
    (`state_bytes` an element: 4 for an fp32 state) and its conv state read and written (`kv_bytes`)."""
    c = _config(model_dir)
    layers = c["num_hidden_layers"]
    types = c.get("layer_types") or ["full_attention"] * layers
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    attention = sum(t == "full_attention" for t in types)
    gdn = sum(t == "linear_attention" for t in types)
    kv = attention * 2 * c["num_key_value_heads"] * head_dim * kv_bytes * context * batch
    state = conv = 0
    if gdn:
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        state = 2 * gdn * hv * dk * dv * state_bytes * batch
        conv = 2 * gdn * (2 * hk * dk + hv * dv) * (c["linear_conv_kernel_dim"] - 1) * kv_bytes * batch
    w = weight_bytes(model_dir, weight_dtype_bytes)
    return {"weights": w, "kv_cache": kv, "gdn_state": state + conv, "total": w + kv + state + conv,
            "attention_layers": attention, "gdn_layers": gdn}


def roofline_tok_s(step: dict, batch: int, bandwidth: float) -> float:
    """Decode tokens/s if a step took exactly its bytes over `bandwidth` (bytes/s): `batch` tokens a step."""
    return batch * bandwidth / step["total"]


def cells(grid: str, allow_max: bool = False) -> list[tuple[int, int]]:
    """'32768x32,131072x8' -> [(32768, 32), (131072, 8)] (context tokens x sequences); with `allow_max`, 0
    sequences stands for the most an engine holds at that context."""
    try:
        out = [tuple(int(x) for x in c.split("x")) for c in grid.split(",")]
    except ValueError:
        out = []
    if not out or any(len(c) != 2 or c[0] < 1 or c[1] < (0 if allow_max else 1) for c in out):
        raise SystemExit(f"cells {grid!r}: give them as CONTEXTxSEQUENCES, comma-separated (e.g. 32768x32"
                         + (", 0 sequences: the most the engine holds)" if allow_max else ")"))
    return out


def run_bytes(a) -> None:
    rows = []
    for ctx, batch in cells(a.cells):
        row = {"context": ctx, "parallel": batch}
        for name, d, sb in (("teacher", a.teacher, 4), ("hybrid", a.hybrid, a.state_bytes)):
            s = step_bytes(d, ctx, batch, state_bytes=sb)
            row[f"{name}_step_bytes"] = s
            if a.bandwidth:
                row[f"{name}_roofline_tok_s"] = roofline_tok_s(s, batch, a.bandwidth)
        rows.append(row)
    print(json.dumps(rows, indent=1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    t = sub.add_parser("teacher", help="a random-weight teacher of a deployed shape, with its real tokenizer")
    t.add_argument("--shape", required=True, choices=sorted(DEPLOYED))
    t.add_argument("--vocab", required=True, help="llama.cpp's vocabulary GGUF of the shape's family")
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--plain_rope", action="store_true", help="drop a llama3 rope_scaling (same cost)")
    z = sub.add_parser("zero", help="an HF directory or GGUF file with every weight byte zero (sparse)")
    z.add_argument("--src", required=True)
    z.add_argument("--out", required=True)
    b = sub.add_parser("bytes", help="bytes a decode step reads, per model and cell")
    b.add_argument("--teacher", required=True)
    b.add_argument("--hybrid", required=True, help="the hybrid's Qwen3.5 export (an HF directory)")
    b.add_argument("--cells", default="32768x32")
    b.add_argument("--state_bytes", type=int, default=4, help="bytes of a GDN state element (4: fp32)")
    b.add_argument("--bandwidth", type=float, default=None, help="bytes/s (a measured copy bandwidth)")
    a = p.parse_args(argv)
    if a.step == "teacher":
        build_teacher(a.shape, a.vocab, Path(a.out), a.seed, a.plain_rope)
    elif a.step == "zero":
        print(f"{a.out}: zeroed {zero_copy(Path(a.src), Path(a.out))}")
    else:
        run_bytes(a)


if __name__ == "__main__":
    main()
