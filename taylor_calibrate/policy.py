"""Layer policy: which layers stay softmax attention; every other layer becomes GDN (docs/method.md,
"Layer policies").

- `uniform`: every k-th layer from 0.
- `bypass`: skip each layer's attention alone (output zeroed), rank by the perplexity increase, keep the most damaging.
- `greedy`: keep only layer i as attention (all others calibrated GDN), measure perplexity, keep the best.
- `layers=0,4,8`: an explicit list.
All keep the same number of layers, ceil(n / keep_every). Scores are measured on *calibration* rows, never on the
held-out text that reports the result, and cached in a JSON file beside the output.
"""
from __future__ import annotations

import contextlib
import math

import torch
from tqdm.auto import tqdm

SCORED = ("bypass", "greedy")
SCORE_RESOLUTION = 0.01
"""Scores (log-perplexities, nats) are ranked rounded to this, equal ones in layer order: a GPU's run-to-run rounding
can move two nearly equal scores past each other between two runs, and with them the kept layers. (Two scores that
straddle a rounding boundary can still swap; far rarer.)"""


def uniform_kept(num_layers: int, keep_every: int) -> list[int]:
    if keep_every < 1:
        raise ValueError(f"keep_every={keep_every} must be >= 1 (keep one attention layer in this many)")
    return list(range(0, num_layers, keep_every))


def parse_layer_list(text: str, num_layers: int) -> list[int]:
    """'0,4,8' or '0-3,8' -> sorted unique list, with clear errors for bad entries."""
    kept: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                kept.extend(range(a, b + 1))
            else:
                kept.append(int(part))
        except ValueError:
            raise ValueError(f"bad layer list entry {part!r} in {text!r}; use e.g. layers=0,4,8 or layers=0-3") from None
    dup = sorted({i for i in kept if kept.count(i) > 1})
    if dup:
        raise ValueError(f"layer list {text!r} names layer(s) {dup} more than once")
    bad = [i for i in kept if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer(s) {bad} out of range: the teacher has {num_layers} layers (0..{num_layers - 1})")
    return sorted(kept)


def kept_layers(policy: str, num_layers: int, keep_every: int = 4, scores: list[float] | None = None) -> list[int]:
    """Resolve a policy to the list of kept attention layers (`scores` for the scored policies: higher = keep)."""
    if policy == "uniform":
        kept = uniform_kept(num_layers, keep_every)
    elif policy in SCORED:
        if scores is None or len(scores) != num_layers:
            raise ValueError(f"policy {policy!r} needs one score per layer ({num_layers})")
        k = len(uniform_kept(num_layers, keep_every))
        ranked = sorted(range(num_layers), key=lambda i: (-round(scores[i] / SCORE_RESOLUTION), i))
        kept = sorted(ranked[:k])
    elif policy.startswith("layers="):
        kept = parse_layer_list(policy[len("layers="):], num_layers)
    else:
        raise ValueError(f"unknown layer policy {policy!r}; use uniform, bypass, greedy or layers=0,4,8")
    if len(kept) == num_layers:
        raise ValueError(f"policy {policy!r} keeps all {num_layers} layers as attention: nothing would be converted")
    if not kept:
        raise ValueError(f"policy {policy!r} keeps no attention layer; a hybrid needs at least one")
    return kept


def gdn_layers(kept: list[int], num_layers: int) -> list[int]:
    return [i for i in range(num_layers) if i not in set(kept)]


def _nll(model, tokens, batch_size) -> float:
    from taylor_calibrate.evaluate import perplexity

    return perplexity(model, tokens, batch_size, desc="policy score")["nll"]


@contextlib.contextmanager
def _attention_skipped(model, i: int):
    attn = model.model.layers[i].self_attn
    hook = attn.register_forward_hook(lambda mod, args, out: (torch.zeros_like(out[0]), *out[1:]))
    try:
        yield
    finally:
        hook.remove()


def bypass_scores(teacher, tokens: torch.Tensor, batch_size: int = 4) -> list[float]:
    """Log-perplexity increase when layer i's attention output is zeroed (higher = more damaging = keep)."""
    n = teacher.config.num_hidden_layers
    print(f"policy bypass: {n + 1} teacher passes over {tokens.numel()} calibration tokens")
    base = _nll(teacher, tokens, batch_size)
    scores = []
    for i in tqdm(range(n), desc="bypass scores", leave=False):
        with _attention_skipped(teacher, i):
            scores.append(_nll(teacher, tokens, batch_size) - base)
    return scores


def greedy_scores(teacher, mixers: dict, tokens: torch.Tensor, batch_size: int = 4) -> list[float]:
    """Minus the log-perplexity of the hybrid that keeps only layer i as attention (others = `mixers`)."""
    from taylor_calibrate.model.hybrid import swapped_into

    n = teacher.config.num_hidden_layers
    print(f"policy greedy: {n} hybrid passes over {tokens.numel()} calibration tokens")
    scores = []
    for i in tqdm(range(n), desc="greedy scores", leave=False):
        with swapped_into(teacher, {j: m for j, m in mixers.items() if j != i}):
            scores.append(-_nll(teacher, tokens, batch_size))
    return [s if math.isfinite(s) else -1e30 for s in scores]
