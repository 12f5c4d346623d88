"""Layer policy: which layers stay softmax attention; every other layer becomes GDN (docs/method.md,
"Layer policies").

- `uniform`: every k-th layer from 0.
- `bypass`: skip each layer's attention alone (output zeroed), rank by the perplexity increase, keep the most damaging.
- `greedy`: keep only layer i as attention (all others calibrated GDN), measure perplexity, keep the best.
- `kl`: from the all-GDN hybrid, restore layer i alone to attention, measure how much KL(teacher || hybrid) drops,
  keep the layers that help most.
- `retrieval`, `heads`: the layers / KV groups whose heads the teacher retrieves with (scored in `stats`).
- `combined`: `kl` and `retrieval` scores, each scaled to [0, 1], mixed with one weight.
- `layers=0,4,8`: an explicit list.
All keep the same number of layers, ceil(n / keep_every); or, with --kv_budget F (a memory.ByteBudget), as many
as fit in F x the teacher's cache bytes at --context, counted as the layers cache (sliding windows, GDN states).
Scores are measured on *calibration* rows, never on the held-out text that reports the result; convert keeps them in
report.json (`policy_scores`).
"""
from __future__ import annotations

import contextlib
import math

import torch
from tqdm.auto import tqdm

from taylor_calibrate.memory import ByteBudget

SCORED = ("bypass", "greedy", "retrieval", "kl", "combined")
RETRIEVAL = ("retrieval", "heads", "combined")
"""Policies scored on retrieval probes: `retrieval` keeps the layers whose heads put the most attention on the needle
when the teacher answers; `heads` keeps the KV groups that do (head-wise: a layer can keep some groups); `combined`
mixes the layer sums with `kl`'s scores."""
ON_HYBRIDS = ("greedy", "kl", "combined")
"""Policies scored on hybrids built from phase-1 mixers of every layer: they choose after phase 1."""
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
            a, b = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part),) * 2
        except ValueError:
            raise ValueError(f"bad layer list entry {part!r} in {text!r}; use e.g. layers=0,4,8 or layers=0-3") from None
        if a > b:  # range() would give no layer: a typo, not a request for none
            raise ValueError(f"layer range {part!r} in {text!r} runs backwards; write it low-high, e.g. {b}-{a}")
        kept.extend(range(a, b + 1))
    dup = sorted({i for i in kept if kept.count(i) > 1})
    if dup:
        raise ValueError(f"layer list {text!r} names layer(s) {dup} more than once")
    bad = [i for i in kept if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer(s) {bad} out of range: the teacher has {num_layers} layers (0..{num_layers - 1})")
    return sorted(kept)


def kept_count(units: int, keep_every: int, kv_budget: float | None = None) -> int:
    """How many of `units` (layers, or KV groups) stay attention: at most the fraction `kv_budget` of them (at least
    one), or one in `keep_every` rounded up."""
    if kv_budget is None:
        return len(uniform_kept(units, keep_every))
    if not 0 < kv_budget < 1:
        raise ValueError(f"kv_budget={kv_budget} must be a fraction of the teacher's KV cache in (0, 1)")
    return max(1, math.floor(kv_budget * units + 1e-9))


def spread(num_layers: int, k: int) -> list[int]:
    """k layers spread evenly from layer 0."""
    return sorted({math.floor(i * num_layers / k) for i in range(k)})


def rank_order(scores, resolution: float | None = SCORE_RESOLUTION) -> list:
    """The keys of `scores` ({key: score}), best first, scores rounded to `resolution` (None: exact), ties in key
    order."""
    return sorted(scores, key=lambda i: (-(round(scores[i] / resolution) if resolution else scores[i]), i))


def ranked(scores, k: int, resolution: float | None = SCORE_RESOLUTION) -> list:
    """The k highest-scoring keys of `scores` ({key: score}), scores rounded to `resolution` (None: exact), ties in
    key order."""
    return sorted(rank_order(scores, resolution)[:k])


def _pct(budget: ByteBudget, n: float) -> str:
    return f"{n / budget.teacher:.1%}"


def check_fits(budget: ByteBudget, costs: dict) -> None:
    """A clear error when not even the cheapest hybrid (every unit in its cheaper form) fits the budget."""
    floor = sum(min(c) for c in costs.values())
    if floor > budget.limit:
        raise ValueError(f"kv_budget={budget.fraction} is below the least any hybrid of this teacher caches at "
                         f"--context {budget.context}: {_pct(budget, floor)} of the teacher's cache bytes (GDN states "
                         f"of the converted layers, windows of the sliding ones); raise --kv_budget above "
                         f"{math.ceil(floor / budget.teacher * 1000) / 1000} or count at a longer --context")


def within_budget(order: list, costs: dict, budget: ByteBudget) -> list:
    """Spend the byte budget down `order` (units, best first): a unit stays attention when what is kept so far, it,
    and every unit still undecided in its cheaper form fit `budget.limit`; else it is converted. `costs`: {unit:
    (bytes as attention, bytes as GDN)}. A unit that caches no more as attention than as GDN (a sliding window
    smaller than a GDN state) is thus always kept: converting it would save nothing. Sorted kept units."""
    check_fits(budget, costs)
    rest = sum(min(c) for c in costs.values())
    spent, kept = 0, []
    for u in order:
        attention, gdn = costs[u]
        rest -= min(attention, gdn)
        if spent + attention + rest <= budget.limit:
            kept.append(u)
            spent += attention
        else:
            spent += gdn
    if not kept:
        cheapest = min(a - g for a, g in costs.values())
        raise ValueError(f"kv_budget={budget.fraction} fits no attention at --context {budget.context}: the cheapest "
                         f"unit costs {_pct(budget, cheapest)} more of the teacher's cache bytes than its GDN state; "
                         "raise --kv_budget")
    if len(kept) == len(costs):
        raise ValueError(f"at --context {budget.context} every layer caches no more as attention than as GDN state: "
                         "converting saves nothing; count at a longer --context")
    return sorted(kept)


def spread_within(num_layers: int, budget: ByteBudget) -> list[int]:
    """`uniform` under a byte budget: the most layers, spread evenly from layer 0, that fit."""
    costs = budget.layer_costs()
    check_fits(budget, costs)
    for k in range(num_layers - 1, 0, -1):
        kept = spread(num_layers, k)
        if sum(costs[i][0] if i in kept else costs[i][1] for i in range(num_layers)) <= budget.limit:
            return kept
    raise ValueError(f"kv_budget={budget.fraction} fits no attention layer spread from layer 0 at --context "
                     f"{budget.context} (layer 0 costs {_pct(budget, costs[0][0])} of the teacher's cache bytes); "
                     "raise --kv_budget")


def kept_layers(policy: str, num_layers: int, keep_every: int = 4, scores: list[float] | None = None,
                kv_budget: float | ByteBudget | None = None) -> list[int]:
    """Resolve a policy to the list of kept attention layers (`scores` for the scored policies: higher = keep).
    `kv_budget`: a ByteBudget (bytes), a fraction of the layers, or None (one in `keep_every`)."""
    in_bytes = isinstance(kv_budget, ByteBudget)
    if policy == "uniform":
        kept = (spread_within(num_layers, kv_budget) if in_bytes else uniform_kept(num_layers, keep_every)
                if kv_budget is None else spread(num_layers, kept_count(num_layers, keep_every, kv_budget)))
    elif policy in SCORED:
        if scores is None or len(scores) != num_layers:
            raise ValueError(f"policy {policy!r} needs one score per layer ({num_layers})")
        # combined scores mix scores already rounded (combined_scores): ranked exactly, w = 0 / 1 is kl / retrieval
        order = rank_order(dict(enumerate(scores)), None if policy == "combined" else SCORE_RESOLUTION)
        kept = (within_budget(order, kv_budget.layer_costs(), kv_budget) if in_bytes
                else sorted(order[:kept_count(num_layers, keep_every, kv_budget)]))
    elif policy.startswith("layers="):
        kept = parse_layer_list(policy[len("layers="):], num_layers)
    else:
        raise ValueError(f"unknown layer policy {policy!r}; use uniform, bypass, greedy, kl, retrieval, heads, "
                         "combined or layers=0,4,8")
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


@torch.no_grad()
def kl_scores(teacher, mixers: dict, tokens: torch.Tensor, batch_size: int = 4) -> list[float]:
    """How much restoring layer i alone to attention brings the all-GDN hybrid (`mixers` in every layer) closer to the
    teacher: KL(teacher || all GDN) - KL(teacher || all GDN but layer i), nats per token (higher = keep).

    The teacher's logits are computed once per batch and kept, in its dtype, for the n + 1 hybrid passes over that
    batch (`kl_sum` takes them to fp32 in chunks): no full-vocabulary logits of all rows are ever held at once, and
    the teacher runs once in all. A hybrid with non-finite outputs counts as a KL of 1e30."""
    from taylor_calibrate.evaluate import kl_sum
    from taylor_calibrate.model.hybrid import swapped_into

    n = teacher.config.num_hidden_layers
    if sorted(mixers) != list(range(n)):
        raise ValueError(f"kl scores need a phase-1 mixer for every layer (0..{n - 1}), got layers {sorted(mixers)}")
    print(f"policy kl: {n + 1} hybrid passes (and 1 teacher pass) over {tokens.numel()} calibration tokens")
    device = next(teacher.parameters()).device
    was_training = teacher.training
    teacher.eval()
    kl, count = [0.0] * (n + 1), 0  # kl[i]: layer i restored; kl[n]: every layer GDN
    try:
        for b in tqdm(range(0, tokens.shape[0], batch_size), desc="kl scores", leave=False):
            ids = tokens[b:b + batch_size].to(device)
            p = teacher(input_ids=ids, use_cache=False).logits
            for i in range(n + 1):
                with swapped_into(teacher, {j: m for j, m in mixers.items() if j != i}):
                    kl[i] += kl_sum(p, teacher(input_ids=ids, use_cache=False).logits)[0]
            count += ids.numel()
    finally:
        teacher.train(was_training)
    kl = [k / count if math.isfinite(k) else 1e30 for k in kl]
    return [kl[n] - kl[i] for i in range(n)]


def layer_scores(policy: str, teacher, mixers: dict | None, tokens: torch.Tensor, batch_size: int = 4) -> list[float]:
    """The per-layer scores a scored layer policy ranks by: `bypass` from the teacher alone, `greedy` and `kl` (and
    `combined`'s kl half) from hybrids of the phase-1 `mixers`."""
    if policy == "bypass":
        return bypass_scores(teacher, tokens, batch_size)
    if policy == "greedy":
        return greedy_scores(teacher, mixers, tokens, batch_size)
    if policy in ("kl", "combined"):
        return kl_scores(teacher, mixers, tokens, batch_size)
    raise ValueError(f"policy {policy!r} has no layer scores")


def combined_scores(kl: list[float], retrieval: list[float], weight: float) -> list[float]:
    """(1 - weight) * kl + weight * retrieval, each of the two layer scores rounded to SCORE_RESOLUTION (as its own
    policy ranks it) and then scaled min-max to [0, 1] over the layers (all equal: all 0).

    Min-max because the two are in different units (nats per token; attention mass): scaled, each gives its best
    layer 1 and its worst 0, without assuming a distribution, and keeps its own order and ties exactly, so weight 0
    keeps `kl`'s layers and weight 1 `retrieval`'s."""
    def scaled(scores):
        q = [round(s / SCORE_RESOLUTION) for s in scores]
        lo, hi = min(q), max(q)
        return [(s - lo) / (hi - lo) if hi > lo else 0.0 for s in q]

    if len(kl) != len(retrieval):
        raise ValueError(f"combined scores need one kl and one retrieval score per layer, got {len(kl)} and "
                         f"{len(retrieval)}")
    return [(1 - weight) * a + weight * b for a, b in zip(scaled(kl), scaled(retrieval))]


def group_scores(head_scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(layers, query heads) -> (layers, KV groups): a group's score is the sum of its query heads' (a group is kept
    or converted whole: its KV is cached for all of its query heads)."""
    L, H = head_scores.shape
    return head_scores.reshape(L, num_kv_heads, H // num_kv_heads).sum(-1)


KNOCKOUT_UNITS = 8
"""At most this many KV groups get a knockout (`knockout_candidates`): enough for the few groups a teacher retrieves
through, few enough to stay cheap on a CPU."""
KNOCKOUT_SHARE = 0.1
"""A KV group is a knockout candidate when its needle attention mass is at least this share of the largest."""


def knockout_candidates(mass: torch.Tensor, limit: int = KNOCKOUT_UNITS,
                        share: float = KNOCKOUT_SHARE) -> list[tuple[int, int]]:
    """(layer, KV group) of the groups that look at the needles most: mass >= `share` x the largest, at most `limit`,
    largest first."""
    top = float(mass.max())
    flat = sorted(((float(mass[i, g]), i, g) for i in range(mass.shape[0]) for g in range(mass.shape[1])),
                  key=lambda t: (-t[0], t[1], t[2]))
    return [(i, g) for m, i, g in flat[:limit] if top > 0 and m >= share * top]


def causal_scores(mass: torch.Tensor, drops: dict[tuple[int, int], float]) -> torch.Tensor:
    """Group scores that rank first the knocked-out groups whose loss lowers the answer's log-probability (by how
    much, `drops`), then every other group by its needle attention mass: a group that looks at the needle is kept
    only before others when the answer needs it to (docs/method.md, "Retrieval")."""
    out = mass.clone().float()
    top = float(mass.max()) + 1.0
    for (i, g), d in drops.items():
        if d > SCORE_RESOLUTION:
            out[i, g] = top + d
    return out


def kept_groups_of(scores: torch.Tensor, keep_every: int,
                   kv_budget: float | ByteBudget | None = None) -> dict[int, list[int]]:
    """Head-wise policy: the highest-scoring KV groups over all layers, as many as the budget allows (a ByteBudget:
    in bytes; a fraction of the groups; None: one in `keep_every`); {layer: [kept groups]} for every layer ([] =
    converted whole, all groups = kept whole)."""
    L, G = scores.shape
    flat = {(i, g): float(scores[i, g]) for i in range(L) for g in range(G)}
    if isinstance(kv_budget, ByteBudget):
        top = within_budget(rank_order(flat), kv_budget.group_costs(), kv_budget)
    else:
        top = ranked(flat, kept_count(L * G, keep_every, kv_budget))
    return {i: [g for (j, g) in top if j == i] for i in range(L)}


def layer_groups(kept: list[int], num_layers: int, num_kv_heads: int) -> dict[int, list[int]]:
    """A layer-wise choice in head-wise form: every group of a kept layer, none of the others."""
    return {i: list(range(num_kv_heads)) if i in set(kept) else [] for i in range(num_layers)}
