"""Teacher statistics, streaming (docs/method.md, "Teacher statistics"): one teacher pass over the calibration rows
gives, for every layer and query head, the mean attention distance, the attention entropy / concentration (absolute and
min-max normalisations, with and without the attention sink), and for the layers to convert the inputs x_l and teacher
head outputs y_l that the value scale and the alignment need.

The statistics come from the teacher's *actual* attention (its RoPE, scaling, sliding windows, softcap): we register
a transformers attention function that runs SDPA for the output and, beside it, an online-softmax pass over key
blocks that keeps per query only running max m, l = sum e^(x-m), A = sum e^(x-m)(x-m) and B = sum e^(x-m)(t-s):
O(T) memory per head, never the T x T matrix. Then H = log l - A/l and E[t-s] = B/l. The per-query statistics
live in ops/ (attention_stats_torch.py: PyTorch, attention_stats_triton.py: one fused Triton pass on a GPU), picked by
`backend` ("auto": Triton for CUDA tensors when it imports, else PyTorch).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from taylor_calibrate.ops import attention_stats
from taylor_calibrate.ops.attention_stats_torch import attention_stats_naive  # noqa: F401  (public name, the reference)
from taylor_calibrate.ops.attention_stats_torch import band_probs

log = logging.getLogger("taylor_calibrate")

BAND = 16
"""Offsets j = 0..BAND-1 whose mean attention p_{t,t-j} the pass records (the longest short conv GDNConfig allows)."""

_IMPL = "taylor_stats"
_OBSERVER = "_taylor_observer"  # the attribute that points an attention module at the collector it feeds


def far_mass(band: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """(B, H, T) attention mass of each query on keys at least BAND back, key 0 (the sink) excluded, from its band
    p_{t, t-j} (BAND, B, H, T) and its sink mass p_{t, 0} (B, H, T)."""
    beyond = torch.arange(band.shape[-1], device=band.device) >= BAND  # key 0 is outside the band
    return (1 - band.sum(0) - sink * beyond).clamp(0, 1)


# --- per-layer accumulation ---------------------------------------------------------------------------------------
@dataclass
class LayerStats:
    """Per query head (H,) means over calibration positions, plus what phase 1 and 2 need of a converted layer."""

    distance: torch.Tensor  # mean_t E[t-s]
    distance_floored: torch.Tensor  # with distances floored at 0.5 (reference: s = t counts 0.5)
    entropy: torch.Tensor  # mean_t H_t (nats)
    concentration_abs: torch.Tensor  # mean_t (1 - H_t / log(n_t)), n_t = visible keys; t with n_t = 1 skipped
    distance_nosink: torch.Tensor
    entropy_nosink: torch.Tensor
    concentration_abs_nosink: torch.Tensor  # 1 - H'_t / log(n_t - 1)
    sink_mass: torch.Tensor  # mean_t p_t0
    head_rms: torch.Tensor  # RMS of the teacher head output y_h
    band: torch.Tensor | None = None  # (H, BAND): mean_t p_{t,t-j}, the local attention profile
    band_nosink: torch.Tensor | None = None  # the same with key 0's mass removed and rows renormalised
    window: int | None = None


@dataclass
class TeacherStats:
    layers: dict[int, LayerStats]
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # (N, T, hidden): attention input of layer l
    head_outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # (N, T, H*D): sum_s p_ts v_s per head
    far_mass: dict[int, torch.Tensor] = field(default_factory=dict)  # (N, T, H): p_t of keys >= BAND back, sink out
    tokens: int = 0

    def release(self, layers) -> None:
        """Drop the stored rows of `layers` (stored to score them; not converted in the end)."""
        for i in layers:
            del self.inputs[i], self.head_outputs[i]
            self.far_mass.pop(i, None)


# the per-query quantities averaged into LayerStats, in the order the collector stacks them
_MEANS = ("distance", "distance_floored", "entropy", "concentration_abs", "distance_nosink", "entropy_nosink",
          "concentration_abs_nosink", "sink_mass", "head_sq")


class _Collector:
    """Accumulates sums during the teacher pass; the attention function below feeds it.

    The pass is host-bound at short lengths (one layer's statistics are a few small tensors), so each layer costs a
    handful of tensor ops: the per-query quantities are stacked into one (9 + 2 BAND, B, H, T) tensor and summed in one go,
    position constants are cached per length, and the sums stay on the device until `finish` reads them all at once."""

    def __init__(self, store_layers, block, store_device, backend="auto", store_far=False):
        self.sums: dict[int, torch.Tensor] = {}  # (9 + 2 BAND, H) float64 per layer: `_MEANS`, band, band_nosink
        self.counts: dict[int, torch.Tensor] = {}
        self.windows: dict[int, int | None] = {}
        self.store_layers, self.block, self.store_device = set(store_layers), block, store_device
        self.backend = backend
        self.inputs: dict[int, list] = {i: [] for i in store_layers}
        self.head_outputs: dict[int, list] = {i: [] for i in store_layers}
        self.far_mass: dict[int, list] = {i: [] for i in store_layers} if store_far else {}
        self._consts: dict[tuple, torch.Tensor] = {}

    def inverse_log_keys(self, T, window, device) -> torch.Tensor:
        """(2, T): 1 / log n_t and 1 / log(n_t - 1 if the sink is visible else n_t), NaN where that count is <= 1
        (a query that sees one key has no concentration), for n_t = visible keys of query t."""
        key = (T, window, str(device))
        if key not in self._consts:
            pos = torch.arange(T, device=device, dtype=torch.float64)
            n = (pos + 1) if window is None else (pos + 1).clamp_max(window)
            sink_visible = pos < window if window is not None else torch.ones_like(pos, dtype=torch.bool)
            n0 = torch.where(sink_visible, n - 1, n)  # keys left once the sink is dropped (none past the window)
            inv = torch.stack([n, n0]).log().reciprocal()
            self._consts[key] = torch.where(torch.stack([n, n0]) > 1, inv, math.nan).float()
        return self._consts[key]

    def band_nosink_factor(self, T, device) -> torch.Tensor:
        """(BAND, 1, 1, T): 0 where offset j of query t is key 0 (dropped with the sink), NaN at t = 0, else 1."""
        key = ("band", T, str(device))
        if key not in self._consts:
            pos, j = torch.arange(T, device=device), torch.arange(BAND, device=device)[:, None]
            f = torch.where(pos == j, 0.0, 1.0)
            f[:, 0] = math.nan
            self._consts[key] = f[:, None, None, :]
        return self._consts[key]

    def observe(self, module, query, key, out, scaling, window, softcap):
        idx = module.layer_idx
        st = attention_stats(query, key, scaling, window, softcap, self.block, backend=self.backend)  # GQA: k unexpanded
        inv = self.inverse_log_keys(query.shape[2], window, query.device)
        ent, ent0, dist, dist0 = st["entropy"], st["entropy_nosink"], st["distance"], st["distance_nosink"]
        head_sq = out.float().pow(2).mean(-1).transpose(1, 2)  # (B, H, T): out is (B, T, H, D)
        # the band with and without the sink (from the non-sink log-normaliser, not p / (1 - p_t0), which is fp32
        # noise when the sink takes nearly all the mass); sink-dropped: key 0 itself -> 0, t = 0 -> NaN (skipped)
        band, band0 = band_probs(query, key, torch.stack([st["lse"], st["lse_nosink"]]), scaling, BAND, window,
                                 softcap).permute(0, 4, 1, 2, 3)  # each (BAND, B, H, T)
        f = self.band_nosink_factor(query.shape[2], query.device)
        band0 = torch.where(f == 0, 0.0, band0 * f)
        per_query = torch.cat([torch.stack([dist, torch.add(dist, st["diag"], alpha=0.5), ent, 1 - ent * inv[0], dist0,
                                            ent0, 1 - ent0 * inv[1], st["sink"], head_sq]),
                               band, band0])
        ok = ~torch.isnan(per_query)
        sums = torch.where(ok, per_query, 0.0).sum((1, 3), dtype=torch.float64)
        counts = ok.sum((1, 3), dtype=torch.float64)
        if idx in self.sums:
            self.sums[idx] += sums
            self.counts[idx] += counts
        else:
            self.sums[idx], self.counts[idx] = sums, counts
        self.windows[idx] = window
        if idx in self.store_layers:
            self.head_outputs[idx].append(out.reshape(*out.shape[:2], -1).detach().to(self.store_device))
        if idx in self.far_mass:
            self.far_mass[idx].append(far_mass(band, st["sink"]).transpose(1, 2).float().to(self.store_device))

    def finish(self) -> dict[int, LayerStats]:
        if not self.sums:
            return {}
        order = sorted(self.sums)
        means = (torch.stack([self.sums[i] for i in order]) / torch.stack([self.counts[i] for i in order]).clamp_min(1))
        means = means.float().cpu()  # one device -> host copy for every layer and quantity
        layers = {}
        n = len(_MEANS)
        for idx, m in zip(order, means):
            mean = dict(zip(_MEANS, m[:n]))
            head_rms = mean.pop("head_sq").sqrt()
            layers[idx] = LayerStats(**mean, head_rms=head_rms, band=m[n:n + BAND].T.contiguous(),
                                     band_nosink=m[n + BAND:].T.contiguous(), window=self.windows[idx])
        return layers


class FarMass:
    """During one teacher forward (`observing`), the far attention mass (`far_mass`) of the query heads `heads`
    ({layer: heads}, the ones a student converts) averaged per position: the end-to-end phase's position weights
    (`weights`, `--train.far_weight`)."""

    def __init__(self, heads: dict[int, list[int]], block: int = 256, backend: str = "auto"):
        self.heads, self.block, self.backend = heads, block, backend
        self.total, self.layers = None, 0
        self._index: dict[tuple, torch.Tensor] = {}

    def observe(self, module, query, key, out, scaling, window, softcap):
        heads = self.heads.get(module.layer_idx)
        if not heads:
            return
        st = attention_stats(query, key, scaling, window, softcap, self.block, backend=self.backend)
        band = band_probs(query, key, st["lse"][None], scaling, BAND, window, softcap)[0].permute(3, 0, 1, 2)
        key = (module.layer_idx, str(query.device))
        if key not in self._index:  # once per layer: no host-to-device copy per step
            self._index[key] = torch.tensor(heads, device=query.device)
        far = far_mass(band, st["sink"]).index_select(1, self._index[key]).mean(1)  # (B, T)
        self.total = far if self.total is None else self.total + far
        self.layers += 1

    def weights(self, far_weight: float) -> torch.Tensor:
        """(B, T): 1 + far_weight x the mean far mass, rescaled to mean 1; then the collector is empty again."""
        if self.total is None:
            raise RuntimeError("FarMass.weights: no attention was observed (is the model's attention observable?)")
        w = 1 + far_weight * self.total / self.layers
        self.total, self.layers = None, 0
        return w / w.mean()


def _stats_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                     softcap=None, **kwargs):
    """SDPA for the output (so the teacher's forward is unchanged), plus the streamed statistics."""
    scaling = module.scaling if scaling is None else scaling  # softcap: only when the model passes one
    observer = getattr(module, _OBSERVER, None)
    edit = getattr(observer, "edit_mask", None)
    if edit is not None:  # a knockout: some heads of this layer may not see some keys
        window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
        attention_mask = edit(module, attention_mask, query, key, window)
    if softcap:
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

        out, _ = eager_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, softcap=softcap, **kwargs)
    else:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
    if observer is not None:
        window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
        observer.observe(module, query, key, out, scaling, window, softcap)
    return out, None


@functools.cache
def _register() -> None:
    """Make `_stats_attention` selectable by name (`set_attn_implementation`), once, when first observed."""
    AttentionInterface.register(_IMPL, _stats_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_IMPL, sdpa_mask)


@contextlib.contextmanager
def capturing_inputs(model, inputs: dict[int, list], store_device):
    """Append what each layer's token mixer (`self_attn`, or a GDN mixer swapped in its place) receives to
    inputs[layer], one (B, T, hidden) chunk per forward, on `store_device`."""
    hooks = []
    for i in inputs:
        def grab(mod, args, kwargs, i=i):
            x = kwargs.get("hidden_states", args[0] if args else None)
            inputs[i].append(x.detach().to(store_device))

        hooks.append(model.model.layers[i].self_attn.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        yield inputs
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def observing(model, collector):
    """Run `model`'s attention through `_stats_attention` (same outputs), feeding `collector.observe`."""
    _register()
    old_impl = model.config._attn_implementation
    attns = [m for m in model.modules() if hasattr(m, "q_proj")]  # whole attention layers and head-wise parts
    model.set_attn_implementation(_IMPL)
    for m in attns:
        setattr(m, _OBSERVER, collector)
    try:
        yield collector
    finally:
        for m in attns:
            delattr(m, _OBSERVER)
        model.set_attn_implementation(old_impl)


@contextlib.contextmanager
def _collecting(model, collector):
    with observing(model, collector), capturing_inputs(model, collector.inputs, collector.store_device):
        yield


@torch.no_grad()
def collect_stats(model, tokens: torch.Tensor, *, store_layers=(), batch_size: int = 4, block: int = 256,
                  store_device: str | torch.device = "cpu", desc: str = "teacher statistics",
                  backend: str = "auto", store_far: bool = False) -> TeacherStats:
    """One teacher pass over `tokens` (N, T): statistics for every layer; inputs and head outputs for `store_layers`,
    and with `store_far` each query's far attention mass there (`far_weights`). `backend` picks the per-query
    statistics kernel (ops.STATS_BACKENDS)."""
    collector = _Collector(store_layers, block, store_device, backend, store_far)
    device = next(model.parameters()).device
    with _collecting(model, collector):
        for i in tqdm(range(0, tokens.shape[0], batch_size), desc=desc, leave=False):
            # logits of the last position only: the pass needs the layers, not a (T x vocab) logits tensor
            model(input_ids=tokens[i:i + batch_size].to(device), use_cache=False, logits_to_keep=1)
    return TeacherStats(layers=collector.finish(), inputs=_joined(collector.inputs),
                        head_outputs=_joined(collector.head_outputs), far_mass=_joined(collector.far_mass),
                        tokens=tokens.numel())


def _joined(chunks: dict[int, list]) -> dict[int, torch.Tensor]:
    """Per layer, its batches as one (N, T, ...) tensor. A layer's chunks are freed as soon as they are joined, and a
    single chunk is kept as is, so the stored data is never held twice (it is most of the pass's memory on a GPU)."""
    out = {}
    for i in list(chunks):
        parts = chunks.pop(i)
        out[i] = parts[0] if len(parts) == 1 else torch.cat(parts)
        del parts
    return out


def head_columns(config, kept: list[int] | None) -> torch.Tensor | None:
    """Columns of a layer's head outputs (H*D) that belong to its GDN heads when KV groups `kept` stay attention
    (None: no group kept, the layer is converted whole)."""
    if not kept:
        return None
    from taylor_calibrate.model.hybrid import converted_heads, head_dim_of

    D = head_dim_of(config)
    return torch.tensor([h * D + j for h in converted_heads(config, kept) for j in range(D)])


def attention_targets(teacher, stats: TeacherStats, layers, release: bool = False,
                      kept_groups: dict[int, list[int]] | None = None) -> dict[int, torch.Tensor]:
    """Teacher attention output after W_O for each layer: the phase 2 target (docs/method.md, "Phase 2: alignment");
    of a head-wise layer (`kept_groups`), the part its GDN heads carry: their columns of W_O, no bias (the kept heads
    add the rest exactly). `release` drops each layer's stored head outputs once its target exists (phase 1 was their
    last reader), so the two never coexist for more than one layer."""
    out = {}
    for i in layers:
        o_proj = teacher.model.layers[i].self_attn.o_proj
        y = stats.head_outputs.pop(i) if release else stats.head_outputs[i]
        cols = head_columns(teacher.config, (kept_groups or {}).get(i))
        if cols is None:
            out[i] = torch.nn.functional.linear(y.to(o_proj.weight), o_proj.weight, o_proj.bias).to(y.device)
        else:
            w = o_proj.weight[:, cols.to(o_proj.weight.device)]
            out[i] = torch.nn.functional.linear(y[..., cols.to(y.device)].to(w), w).to(y.device)
    return out


def far_weights(teacher, stats: TeacherStats, layers, far_weight: float,
                kept_groups: dict[int, list[int]] | None = None) -> dict[int, torch.Tensor]:
    """Phase 2's position weights (N, T) per layer (`--phase2.far_weight`): 1 + far_weight x the mean far mass of the
    layer's heads that become GDN at that position (attention on keys at least BAND back, not the sink), scaled to
    mean 1 over each layer's positions 1..T-1 (position 0 is the sink's, weighted by sink_weight). The positions
    where the teacher reaches far back are the ones a recurrent state finds hardest: this makes phase 2 spend more
    of its fit there."""
    from taylor_calibrate.model.hybrid import gdn_heads

    out = {}
    for i, heads in gdn_heads(teacher.config, layers, kept_groups).items():
        far = stats.far_mass[i]
        w = 1 + far_weight * far[..., torch.tensor(heads, device=far.device)].mean(-1)
        w = w / w[:, 1:].mean()
        w[:, 0] = 1.0
        out[i] = w
    return out


def store_device_for(model, rows: int, seq: int, layers, device: torch.device) -> torch.device:
    """Where the calibration rows' per-layer tensors live: on the GPU when inputs, head outputs and phase-2 targets
    of every stored layer take at most half of its free memory, else in host memory (phase 2 moves one batch at a
    time; phase 1 a few rows). 128 rows x 1024 tokens of a Qwen3-8B shape are ~80 GB of them."""
    if device.type != "cuda":
        return device
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    itemsize = next(model.parameters()).element_size()
    need = rows * seq * len(layers) * (2 * cfg.hidden_size + heads * head_dim) * itemsize
    free, _ = torch.cuda.mem_get_info(device)
    if need <= free / 2:
        return device
    log.info("calibration rows of %d layers need %.1f GB, more than half the GPU's free %.1f GB: stored in host "
             "memory", len(layers), need / 2 ** 30, free / 2 ** 30)
    return torch.device("cpu")


# --- retrieval heads: where the teacher looks when it copies a needle ---------------------------------------------
def row_scores(query, key, rows, scaling, window=None, softcap=None) -> torch.Tensor:
    """(B, H, r, T) fp32 attention logits of the query positions `rows` over every key, as the model computes them
    (GQA keys shared by their query heads, softcap), -inf where a key is hidden (causal mask, sliding window)."""
    q = query[:, :, rows].float()  # (B, H, r, D)
    k = key.float().repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # GQA -> (B, H, T, D)
    s = q @ k.transpose(-1, -2) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    pos = torch.arange(k.shape[2], device=s.device)
    visible = pos[None, :] <= rows[:, None]
    if window is not None:
        visible &= pos[None, :] > rows[:, None] - window
    return s.masked_fill(~visible, float("-inf"))


class _NeedleProbe:
    """Per layer and query head, the attention mass that the positions predicting a retrieval answer put on the
    needle's copy of that answer (a copy / retrieval head puts most of it there). Set `rows` and `keys` per probe."""

    def __init__(self):
        self.inputs, self.store_device = {}, "cpu"  # _collecting's interface; nothing is stored
        self.rows = self.keys = None
        self.sums: dict[int, torch.Tensor] = {}
        self.last: dict[int, torch.Tensor] = {}  # the last forward's mass per layer

    def observe(self, module, query, key, out, scaling, window, softcap):
        p = row_scores(query, key, self.rows, scaling, window, softcap).softmax(-1)
        mass = p[..., self.keys].sum(-1).mean(-1).sum(0)  # (H,)
        self.sums[module.layer_idx] = self.sums.get(module.layer_idx, 0) + mass
        self.last[module.layer_idx] = mass


@torch.no_grad()
def retrieval_heads(model, probes) -> torch.Tensor:
    """(layers, query heads): mean over `probes` (retrieval.Probe) of the attention mass from the positions that
    predict the answer onto the needle's answer tokens, in the teacher's own attention (RoPE, windows, softcap)."""
    probe = _NeedleProbe()
    device = next(model.parameters()).device
    with _collecting(model, probe):
        for p in tqdm(probes, desc="retrieval heads", leave=False):
            probe.rows = torch.tensor(p.answer, device=device) - 1
            probe.keys = torch.tensor(p.needle, device=device)
            model(input_ids=torch.tensor([p.ids], device=device), use_cache=False, logits_to_keep=1)
    n = model.config.num_hidden_layers
    return torch.stack([probe.sums[i].cpu() for i in range(n)]) / len(probes)


class _Knockout:
    """Blocks the attention of some query heads of one layer (`layer`, `heads`) from the positions predicting a
    probe's answer (`rows`) to the needle's copy of it (`keys`); everything else attends as the teacher does."""

    def __init__(self):
        self.inputs, self.store_device = {}, "cpu"  # _collecting's interface; nothing is stored
        self.layer, self.heads, self.rows, self.keys = None, [], None, None

    def observe(self, *args):
        pass

    def edit_mask(self, module, mask, query, key, window):
        if module.layer_idx != self.layer:
            return mask
        T, S = query.shape[2], key.shape[2]
        q, k = torch.arange(S - T, S, device=query.device), torch.arange(S, device=query.device)
        visible = k[None, :] <= q[:, None]
        if window is not None:
            visible &= k[None, :] > q[:, None] - window
        visible = visible.expand(query.shape[1], T, S).clone()
        rows = self.rows - (S - T)
        for h in self.heads:
            visible[h, rows[:, None], self.keys[None, :]] = False
        add = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
        return add.masked_fill(~visible, torch.finfo(query.dtype).min)[None]


@torch.no_grad()
def knockout_drops(model, probes, units: list[tuple[int, list[int]]]) -> list[float]:
    """For each unit (layer, query heads): the mean over `probes` of how much the answer's log-probability falls when
    those heads may not attend from the answer-predicting positions to the needle. Attention mass says where a head
    looks; this says whether the answer needs it to look there."""
    device = next(model.parameters()).device
    ko = _Knockout()

    def answer_logprob(p) -> float:
        ids = torch.tensor([p.ids], device=device)
        rows = torch.tensor(p.answer, device=device) - 1
        keep = len(p.ids) - int(rows.min())
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0].float()
        lp = torch.log_softmax(logits[rows - (len(p.ids) - keep)], -1)
        return float(lp.gather(-1, ids[0, rows + 1][:, None]).sum())

    drops = []
    with _collecting(model, ko):
        base = [answer_logprob(p) for p in probes]  # through the same attention function, nothing blocked
        for layer, heads in tqdm(units, desc="retrieval knockouts", leave=False):
            ko.layer, ko.heads = layer, heads
            total = 0.0
            for p, b in zip(probes, base):
                ko.rows = torch.tensor(p.answer, device=device) - 1
                ko.keys = torch.tensor(p.needle, device=device)
                total += b - answer_logprob(p)
            drops.append(total / len(probes))
    return drops


@torch.no_grad()
def needle_mass(model, probes) -> dict[int, torch.Tensor]:
    """{layer: (probes, heads)} the attention mass from the positions that predict each probe's answer onto the
    needle's answer tokens, for every attention module `model` runs (a hybrid: its kept heads only, numbered within
    the module)."""
    probe = _NeedleProbe()
    device = next(model.parameters()).device
    out: dict[int, list] = {}
    with _collecting(model, probe):
        for p in probes:
            probe.rows = torch.tensor(p.answer, device=device) - 1
            probe.keys = torch.tensor(p.needle, device=device)
            model(input_ids=torch.tensor([p.ids], device=device), use_cache=False, logits_to_keep=1)
            for i, m in probe.last.items():
                out.setdefault(i, []).append(m.cpu())
            probe.last = {}
    return {i: torch.stack(v) for i, v in sorted(out.items())}


def head_subset(st: LayerStats, heads: list[int]) -> LayerStats:
    """A layer's statistics restricted to some of its query heads (for the GDN heads of a head-wise layer)."""
    idx = torch.tensor(heads)
    kw = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
    return LayerStats(**{k: v[idx] if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
