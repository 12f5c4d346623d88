"""Evaluation: perplexity on held-out text.

Perplexity protocol: the held-out documents are packed into non-overlapping rows of `seq_len` tokens
(`data.pack_tokens`); each row is scored on its own from position 0, every token but the first predicted from
its in-row prefix (no stride, no carried context). PPL = exp(mean token NLL over all scored tokens).
The same rows score teacher and hybrid, so their figures compare directly.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, batch_size: int = 4, desc: str = "eval") -> dict:
    """Returns {"ppl", "nll", "tokens"} for `tokens` (N, T) under a causal LM."""
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"perplexity needs (num_seqs, seq_len >= 2) tokens, got shape {tuple(tokens.shape)}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in tqdm(range(0, tokens.shape[0], batch_size), desc=desc, leave=False):
        ids = tokens[i:i + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        total += nll.item()
        count += ids[:, 1:].numel()
    model.train(was_training)
    nll = total / count
    return {"ppl": math.exp(nll) if nll < 700 else float("inf"), "nll": nll, "tokens": count}
