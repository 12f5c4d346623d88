"""Export a hybrid to a GGUF file for llama.cpp's `qwen35` architecture, written with the `gguf` package.

The weights are the Qwen3.5 form (export/qwen3_5.py) renamed with gguf's own tensor-name map for QWEN35, with the three
changes llama.cpp's loader expects: RMSNorm weights stored as the multiplier w (Qwen3.5 safetensors store w - 1; the
GDN's gated norm is already w), `A_log` stored as A = -exp(A_log) (`ssm_a`), `dt_bias` as `ssm_dt.bias`, and the
depthwise conv kernel as (channels, K). The layer pattern goes in `qwen35.attention.recurrent_layers` (any pattern;
llama.cpp builds that read it) and, when periodic, also `qwen35.full_attention_interval` (older builds read only
that). The tokenizer goes in as a byte-level BPE ("gpt2") vocabulary from tokenizer.json with the pre-tokenizer
llama.cpp needs to split text as the model's tokenizer does (recorded from a GGUF teacher, or named from tokenizer.json).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from taylor_calibrate.config import GGUF_TYPES
from taylor_calibrate.export.qwen3_5 import _load_hybrid_files, qwen3_5_config, qwen3_5_state_dict
from taylor_calibrate.model.hybrid_config import MIXER_TYPE
from taylor_calibrate.teacher import GGUF_TOKENIZER_KEY, IGNORE_MERGES_PRE

log = logging.getLogger("taylor_calibrate")

ARCH = "qwen35"
GGUF_NAME = "model.gguf"
FTYPES = dict(zip(GGUF_TYPES, (np.float32, np.float16)))


CONV_CHANNEL_MULTIPLE = 128
"""llama.cpp's CUDA `ssm_conv` takes a channel count that is a multiple of this; any other (SmolLM2's 9 heads x 3 x
64 = 1728) runs the GDN conv on the CPU: a GPU -> CPU -> GPU round trip in every GDN layer at every step."""


def pad_linear_heads(config: dict, weights: dict[str, torch.Tensor], multiple: int = CONV_CHANNEL_MULTIPLE) -> int:
    """Append all-zero GDN heads to every linear-attention layer until its conv channels (2 Hk dk + Hv dv) are a
    multiple of `multiple`, so llama.cpp's CUDA backend runs the whole layer. A zero head is exact: its q, k, v and
    gate rows, conv taps and out_proj columns are 0, so its state stays 0 and it adds nothing to the output (the
    l2-norms and the gated RMSNorm of a zero vector are 0). Edits `config` and `weights` in place; returns the heads
    added per layer (0: none needed, or none possible with Hv != Hk, which is logged)."""
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    if (2 * hk * dk + hv * dv) % multiple == 0:
        return 0
    pad = next((p for p in range(1, hk + 1) if (2 * dk + dv) * (hk + p) % multiple == 0), None) if hk == hv else None
    if pad is None:
        log.warning("gguf export: GDN conv channels %d are not a multiple of %d: llama.cpp's CUDA backend runs that "
                    "conv on the CPU", 2 * hk * dk + hv * dv, multiple)
        return 0

    def grow(w, sizes, dim=0):  # each block of `sizes` along `dim` gets its zero heads after it
        parts = torch.split(w, [n * d for n, d in sizes], dim=dim)
        zeros = [w.new_zeros(*(pad * d if i == dim else n for i, n in enumerate(w.shape))) for _, d in sizes]
        return torch.cat([t for pair in zip(parts, zeros) for t in pair], dim=dim)

    for name in [n for n in weights if n.endswith("linear_attn.in_proj_qkv.weight")]:
        p = name.removesuffix("in_proj_qkv.weight")
        blocks = [(hk, dk), (hk, dk), (hv, dv)]
        weights[p + "in_proj_qkv.weight"] = grow(weights[p + "in_proj_qkv.weight"], blocks)
        weights[p + "conv1d.weight"] = grow(weights[p + "conv1d.weight"], blocks)
        weights[p + "in_proj_z.weight"] = grow(weights[p + "in_proj_z.weight"], [(hv, dv)])
        for key in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
            weights[p + key] = grow(weights[p + key], [(hv, 1)])
        weights[p + "out_proj.weight"] = grow(weights[p + "out_proj.weight"], [(hv, dv)], dim=1)
    config["linear_num_key_heads"], config["linear_num_value_heads"] = hk + pad, hv + pad
    log.info("gguf export: %d zero GDN head(s) added per layer (%d -> %d) so that llama.cpp's CUDA conv runs them "
             "(channels %d -> %d)", pad, hk, hk + pad, 2 * hk * dk + hv * dv, (2 * dk + dv) * (hk + pad))
    return pad


def _gguf_tensor(name: str, w: torch.Tensor, tensor_map) -> tuple[str, np.ndarray]:
    """One Qwen3.5 tensor -> (GGUF name, fp32 array) in llama.cpp's layout."""
    w = w.detach().float()
    base, _, suffix = name.rpartition(".")
    if name.endswith(".A_log"):
        return tensor_map.get_name(name), (-w.exp()).numpy()
    if name.endswith(".dt_bias"):
        return tensor_map.get_name(name.replace(".dt_bias", ".dt_proj")) + ".bias", w.numpy()
    if name.endswith("conv1d.weight"):
        w = w.squeeze(1)
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w + 1  # Qwen3.5 stores (1 + w) norms as w; llama.cpp multiplies by the weight itself
    mapped = tensor_map.get_name(base)
    if mapped is None:
        raise ValueError(f"gguf export: no {ARCH} tensor name for {name}")
    return f"{mapped}.{suffix}", w.numpy()


# tokenizer.json's pre-tokenizer (its steps, reduced to what decides the split) and its BPE's ignore_merges (a
# pre-token that is a vocabulary entry is taken whole) -> llama.cpp's name for the same tokenisation
# (`tokenizer.ggml.pre`, llama-vocab.cpp, which also decides ignore_merges: teacher.IGNORE_MERGES_PRE). A pair not
# listed is refused: llama.cpp would tokenise text differently from the model's tokenizer.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS = {
    ((("ByteLevel", True),), False): "gpt-2",
    ((("Digits", True), ("ByteLevel", True)), False): "smollm",
    ((("Split", _LLAMA3_SPLIT), ("ByteLevel", False)), True): "llama-bpe",  # Llama 3's tokenizer.json
    ((("Split", _LLAMA3_SPLIT), ("ByteLevel", False)), False): "smaug-bpe",  # Llama 3's split, every merge applied
    ((("Split", _QWEN2_SPLIT), ("ByteLevel", False)), False): "qwen2",
}


def _pre_step(step: dict) -> tuple:
    kind = step.get("type")
    if kind == "ByteLevel":
        return kind, bool(step.get("use_regex", True))
    if kind == "Digits":
        return kind, bool(step.get("individual_digits", False))
    if kind == "Split":
        pattern = step.get("pattern", {})
        return kind, pattern.get("Regex", pattern.get("String"))
    return (kind,)


def _pre_key(tok: dict) -> tuple:
    """A tokenizer.json's key in PRE_TOKENIZERS: its pre-tokenizer steps and its BPE's ignore_merges."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return tuple(_pre_step(s) for s in steps), bool(tok["model"].get("ignore_merges"))


def pre_tokenizer_name(tok: dict, path: Path) -> str:
    """llama.cpp's name (`tokenizer.ggml.pre`) for the pre-tokenizer of a byte-level BPE tokenizer.json; a clear error
    for one llama.cpp does not split the same way (a Metaspace / SentencePiece tokenizer, an unknown regex)."""
    key = _pre_key(tok)
    if key not in PRE_TOKENIZERS:
        raise ValueError(f"gguf export: the pre-tokenizer of {path} ({', '.join(str(k[0]) for k in key[0]) or 'none'}"
                         f"; ignore_merges {key[1]}) is not one llama.cpp is known here to split the same way "
                         f"(byte-level BPE as {', '.join(sorted(PRE_TOKENIZERS.values()))}); llama.cpp would tokenise "
                         "text differently from the model, so no GGUF is written")
    return PRE_TOKENIZERS[key]


def _add_tokenizer(writer, src: Path, config: dict) -> None:
    """The tokenizer as llama.cpp reads it: a byte-level BPE vocabulary (tokens, types, merges) from the hybrid's
    tokenizer.json, its pre-tokenizer, special ids, BOS/EOS flags and chat template. What `convert` recorded from a
    GGUF teacher (its own `tokenizer.ggml.*` values) wins over what is derived from the tokenizer files."""
    from transformers import AutoTokenizer

    path = src / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: GGUF needs the tokenizer; re-run `convert` (it saves one)")
    tok = json.loads(path.read_text())
    model = tok["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = "byte-fallback BPE (SentencePiece)" if model.get("type") == "BPE" else model.get("type")
        raise ValueError(f"gguf export writes byte-level BPE tokenizers; {path} is {kind}, which this exporter does "
                         "not write for llama.cpp")
    tcfg_path = src / "tokenizer_config.json"
    recorded = json.loads(tcfg_path.read_text()).get(GGUF_TOKENIZER_KEY, {}) if tcfg_path.exists() else {}
    if recorded.get("tokenizer.ggml.model", "gpt2") != "gpt2":
        raise ValueError(f"gguf export: the teacher's GGUF tokenizer is {recorded['tokenizer.ggml.model']!r}; this "
                         "exporter writes byte-level BPE ('gpt2') only")
    pre = recorded.get("tokenizer.ggml.pre") or pre_tokenizer_name(tok, path)
    steps = _pre_key(tok)[0]
    if pre in PRE_TOKENIZERS.values() and steps not in {k[0] for k, name in PRE_TOKENIZERS.items() if name == pre}:
        raise ValueError(f"gguf export: the teacher's GGUF names llama.cpp's pre-tokenizer {pre!r}, but {path} splits "
                         f"text as {', '.join(str(s[0]) for s in steps) or 'nothing'}: llama.cpp would tokenise text "
                         "differently from the model, so no GGUF is written (a hybrid converted from a GGUF teacher "
                         "before its tokenizer carried the teacher's split, e.g. smollm's single digits: run `convert` "
                         "again, whose tokenizer now splits as the teacher's GGUF does)")
    whole = pre in IGNORE_MERGES_PRE  # llama.cpp takes a word that is a vocabulary entry whole
    if whole != bool(model.get("ignore_merges")):
        raise ValueError(f"gguf export: llama.cpp's pre-tokenizer {pre!r} (recorded from the teacher's GGUF) runs BPE "
                         f"with ignore_merges {whole}, but {path} has ignore_merges {not whole}: llama.cpp would "
                         "tokenise some words differently from the model, so no GGUF is written (a hybrid converted "
                         "from a GGUF teacher before its tokenizer set this: set \"ignore_merges\" in tokenizer.json "
                         f"to {str(whole).lower()}, which is how the teacher's GGUF tokenises)")
    vocab = dict(model["vocab"])
    added = {t["content"]: bool(t.get("special")) for t in tok.get("added_tokens", [])}
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    n = max(config["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # gguf.TokenType.UNUSED for ids the tokenizer does not use (an embedding padded to a round size)
    for t, i in vocab.items():
        tokens[i] = t
        types[i] = (3 if added[t] else 4) if t in added else 1  # CONTROL / USER_DEFINED / NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    hf = AutoTokenizer.from_pretrained(src)
    ids, plain = hf("a").input_ids, hf("a", add_special_tokens=False).input_ids
    derived = {"bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id, "unknown_token_id": hf.unk_token_id,
               "padding_token_id": hf.pad_token_id,
               "add_bos_token": len(ids) > len(plain) and ids[0] == hf.bos_token_id,
               "add_eos_token": len(ids) > len(plain) and ids[-1] == hf.eos_token_id}
    for key, fallback in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("padding_token_id", "pad_token_id")):
        if derived[key] is None:
            v = config.get(fallback)
            derived[key] = v[0] if isinstance(v, list) else v
    adders = {"bos_token_id": writer.add_bos_token_id, "eos_token_id": writer.add_eos_token_id,
              "unknown_token_id": writer.add_unk_token_id, "padding_token_id": writer.add_pad_token_id,
              "add_bos_token": writer.add_add_bos_token, "add_eos_token": writer.add_add_eos_token,
              "add_space_prefix": writer.add_add_space_prefix}
    values = {k: recorded.get(f"tokenizer.ggml.{k}") for k in adders} if recorded else derived
    for key, add in adders.items():
        v = values.get(key)
        if v is not None:
            add(v if isinstance(v, bool) else int(v))
    if getattr(hf, "chat_template", None):
        writer.add_chat_template(hf.chat_template)


def export_gguf(model_dir: str | Path, out_dir: str | Path, ftype: str = "f32") -> Path:
    """Write `out_dir`/model.gguf for llama.cpp's qwen35 from the hybrid in `model_dir`. Refuses what Qwen3.5 cannot
    express (qwen3_5.check_exportable) and RoPE scaling llama.cpp's qwen35 does not read here. `ftype` "f16" stores
    the weight matrices as float16 (half the file; norms, gates, A, dt bias and the conv kernel stay fp32)."""
    if ftype not in FTYPES:
        raise ValueError(f"gguf export: ftype {ftype!r} is not one of {sorted(FTYPES)}")
    import gguf

    src, out = Path(model_dir), Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new --out (export never overwrites)")
    cfg, state = _load_hybrid_files(src)
    weights = qwen3_5_state_dict(cfg, state)
    config = qwen3_5_config(cfg, torch.float32)
    pad_linear_heads(config, weights)
    rope = config["rope_parameters"]
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"gguf export writes plain RoPE; this model's rope_type is {rope['rope_type']!r}")
    n_layers, D = config["num_hidden_layers"], config["head_dim"]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp"))
    try:
        writer = gguf.GGUFWriter(str(tmp / GGUF_NAME), ARCH)
        writer.add_name(src.name)
        if cfg.teacher_name:  # the model it derives from: a `convert --teacher` of this file names it
            writer.add_base_model_count(1)
            writer.add_base_model_name(0, cfg.teacher_name)
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(config["hidden_size"])
        writer.add_block_count(n_layers)
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(config["num_attention_heads"])
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_key_length(D)
        writer.add_value_length(D)
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_rope_freq_base(float(rope["rope_theta"]))
        writer.add_rope_dimension_count(D)  # partial_rotary_factor 1.0: llama.cpp's converter would default 0.25
        writer.add_rope_dimension_sections([*rope["mrope_section"], 0])
        writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(config["linear_key_head_dim"])
        writer.add_ssm_group_count(config["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
        writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
        writer.add_array(f"{ARCH}.attention.recurrent_layers", [t == MIXER_TYPE for t in cfg.layer_types])
        if "full_attention_interval" in config:
            writer.add_full_attention_interval(config["full_attention_interval"])
        writer.add_file_type(gguf.LlamaFileType.ALL_F32 if ftype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
        _add_tokenizer(writer, src, config)
        tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, n_layers)
        for name, w in weights.items():
            gname, arr = _gguf_tensor(name, w, tensor_map)
            half = arr.ndim == 2 and not gname.endswith("ssm_conv1d.weight")  # llama.cpp's conv op reads fp32
            writer.add_tensor(gname, np.ascontiguousarray(arr, dtype=FTYPES[ftype] if half else np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s -> %s (GGUF %s, %s)", src, out / GGUF_NAME, ARCH, ftype)
    return out / GGUF_NAME
