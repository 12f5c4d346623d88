"""Layer policy: which layers stay softmax attention; every other layer becomes GDN.

`uniform` keeps every k-th layer starting at 0 (METHOD.md section 3a's "uniform [0, 4, ..., 24]"); `layers=...`
is an explicit list of kept layers.
"""
from __future__ import annotations


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


def kept_layers(policy: str, num_layers: int, keep_every: int = 4) -> list[int]:
    """Resolve a policy name to the list of kept attention layers."""
    if policy == "uniform":
        kept = uniform_kept(num_layers, keep_every)
    elif policy.startswith("layers="):
        kept = parse_layer_list(policy[len("layers="):], num_layers)
    else:
        raise ValueError(f"unknown layer policy {policy!r}; use 'uniform' or 'layers=0,4,8'")
    if len(kept) == num_layers:
        raise ValueError(f"policy {policy!r} keeps all {num_layers} layers as attention: nothing would be converted")
    if not kept:
        raise ValueError(f"policy {policy!r} keeps no attention layer; a hybrid needs at least one")
    return kept


def gdn_layers(kept: list[int], num_layers: int) -> list[int]:
    return [i for i in range(num_layers) if i not in set(kept)]
