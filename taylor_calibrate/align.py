"""Phase 2: teacher-forced per-layer gradient alignment (docs/method.md, "Phase 2: alignment").

Every converted layer l is trained on its own to reproduce the teacher's attention output from the teacher's own
input to that layer:

    inputs[l]   (N, T, hidden)  the teacher's input to layer l's attention (after input_layernorm)
    targets[l]  (N, T, hidden)  the teacher's attention output of layer l, after o_proj
    loss_l = MSE(mixer_l(inputs[l]), targets[l])          rel-MSE_l = MSE_l / Var(targets[l])

with each row's first position weighted `sink_weight` positions in loss_l (the token later layers park attention on;
an error there costs far more than 1/T of the MSE says, AlignArgs.sink_weight).

Teacher forcing makes the layers independent, so all of them train in one loop over the same stored rows, with no
teacher forward. A step trains every layer at once: the layers' parameters are stacked (each mixer's parameter is
a view of its slice), one batched op (`torch.vmap` over the mixer's own `features`) computes every layer's recurrence
inputs, one call of the mixer's `readout` runs the recurrences of all layers stacked along the batch (sequences never
interact in it, so this is exactly L separate calls, in one kernel launch sequence instead of L), one batched op
applies every layer's gate and o_proj, and one backward of the summed per-layer losses gives every layer the
gradient of its own loss. Then per-layer gradient clipping and one AdamW step over the stacked parameters (AdamW is
elementwise: the same update as one optimizer per layer; test against the plain per-layer loop). Each layer keeps its
own clipping norm, best state and divergence guard; the only thing layers share is which rows a step uses.
`layer_group` bounds how many layers share a forward (activation memory).

Choices (the reference's are in docs/method.md, "Phase 1: calibration", "paper"):
- Parameter groups (each mixer's spec places its parameters; GDN's in model/mixers/gdn): the decay and write-gate
  parameters at `lr_dynamics` (None = `lr`, 0 = frozen at phase 1's values), the other new ones at `lr`, the copied
  q/k/v projections (weights and biases) at `lr_qkv`, o_proj at `lr_o` (trained by default, `train_o_proj`) and the
  per-head norm at `lr` when asked - the reference freezes both and trains all new parameters at one rate. Weight decay applies to
  every trained parameter, as in the reference.
- Schedule: `lr_factor` (AlignArgs.schedule; default wsd: constant, then linear to 0 over the last `decay_fraction`
  of the steps).
- Best state: every `log_every` steps and at the end, rel-MSE (unweighted) is measured on fixed evaluation rows (the
  first `eval_rows` stored rows, full length, no grad) and the parameters with the lowest value so far are kept; the
  initial state is the first candidate, so alignment never leaves a layer worse on those rows than it found it.
  The reference keeps the lowest *training-batch* loss instead, which with mini-batches rewards an easy batch rather
  than a better layer. The evaluation rows are part of the training rows (they are not held out).
- Divergence: a non-finite loss or gradient norm is recorded on the device without a host sync; at the next
  evaluation point the layer is restored to its best state and stops training (`diverged_at` in its report).
- Speed: on a GPU a small layer's step is bound by kernel launches and Python, not FLOPs, so stacking the layers
  (one batched op per projection, one recurrence call, one fused AdamW step over a few large tensors) is what makes
  phase 2 fast.
- Precision: parameters train in fp32 (a bf16/fp16 mixer is upcast for the run and cast back at the end); on CUDA
  the forward runs under bf16 autocast, the loss in fp32. `rel_mse_after` is measured after the cast back.
- Steps are counted from 1: `best_step` k is the state after k optimizer steps (0 = the state alignment started
  from), `diverged_at` k means the k-th step's loss or gradient was non-finite.
"""
from __future__ import annotations

import inspect
import logging
import math
import time

import torch
import torch.nn as nn
from torch import Tensor
from torch.func import functional_call
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from tqdm.auto import tqdm

from taylor_calibrate.config import AlignArgs
from taylor_calibrate.model.mixers import spec_of
from taylor_calibrate.training import Clock, autocast, batch_indices, wsd

log = logging.getLogger("taylor_calibrate")


TUNED_RMS = 0.1925
"""RMS of the attention projections (q, k, v, o weights; mean over layers) of the teacher phase 2's learning rates
were tuned on, SmolLM2-135M (docs/decisions.md, "Learning rates across teachers")."""


def teacher_lr_scale(model) -> float:
    """Phase 2's learning-rate factor for teacher `model`: the RMS of its attention projections against TUNED_RMS, to
    two digits (the rates were tuned on grids far coarser). AdamW steps every weight by about its rate whatever the
    weight's size, so projections 5x smaller need 5x smaller rates for the same relative step."""
    rms = [getattr(layer.self_attn, name).weight.detach().float().pow(2).mean().sqrt()
           for layer in model.model.layers for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    return round(float(torch.stack(rms).mean()) / TUNED_RMS, 2)


def resolve_lr_scale(args: AlignArgs, model) -> AlignArgs:
    """`args` with --phase2.lr_scale None resolved from teacher `model` (logged), in place."""
    if args.lr_scale is None:
        args.lr_scale = teacher_lr_scale(model)
        log.info("phase 2 learning rates x%g: the teacher's attention projections against those they were tuned on "
                 "(--phase2.lr_scale sets it)", args.lr_scale)
    return args


def scale_of(args: AlignArgs) -> float:
    """--phase2.lr_scale, 1 where nothing resolved it (a caller without a teacher)."""
    return 1.0 if args.lr_scale is None else args.lr_scale


def lr_factor(step: int, args: AlignArgs) -> float:
    """Multiplier of the base learning rates for optimizer step `step` (1-based)."""
    if args.schedule == "constant":
        return 1.0
    return wsd(step, args.steps, args.decay_fraction)


def _group_of(mixer: nn.Module, name: str) -> str:
    """The optimizer group of parameter `name` of `mixer`, by its top-level module/parameter name (the mixer's spec)."""
    groups, top = spec_of(mixer).param_groups, name.split(".")[0]
    if top not in groups:  # a new parameter of a mixer must be placed deliberately, not frozen silently
        raise ValueError(f"align: parameter {name!r} of {type(mixer).__name__} has no optimizer group")
    return groups[top]


def trained_parameters(mixer: nn.Module, args: AlignArgs) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Trained parameters of one mixer by group ("dynamics", "new", "qkv", "o_proj", "o_norm"); frozen groups are
    left out."""
    groups: dict[str, list] = {"new": [], "qkv": []}
    if args.lr_dynamics != 0:
        groups["dynamics"] = []
    if args.train_o_proj:
        groups["o_proj"] = []
    if args.train_o_norm:
        groups["o_norm"] = []
    for name, p in mixer.named_parameters():
        group = _group_of(mixer, name)
        if group in groups:
            groups[group].append((name, p))
    return {k: v for k, v in groups.items() if v}


@torch.no_grad()
def rel_mse(mixer: nn.Module, inputs: Tensor, targets: Tensor, batch_size: int = 4) -> float:
    """MSE(mixer(inputs), targets) / Var(targets) over all rows given, `batch_size` rows per forward.

    Var is the population variance of all target entries (one scalar per layer); sums are fp64. On CUDA the
    forward runs under bf16 autocast, as in training."""
    p = next(mixer.parameters())
    sums = torch.zeros(3, device=p.device, dtype=torch.float64)  # sum (out - y)^2, sum y, sum y^2
    for i in range(0, inputs.shape[0], batch_size):
        x = inputs[i:i + batch_size].to(p.device, p.dtype if p.is_floating_point() else torch.float32)
        y = targets[i:i + batch_size].to(p.device, torch.float64)
        with autocast(p.device):
            out = mixer(x)[0]
        sums += torch.stack([(out.double() - y).pow(2).sum(), y.sum(), y.pow(2).sum()])
    mse, mean, mean_sq = (sums / targets.numel()).tolist()
    var = mean_sq - mean * mean
    return mse / var if var > 0 else float("nan")


def _check_data(mixers, inputs, targets) -> int:
    """Number of stored rows, the same for every layer (a step uses the same rows in every layer)."""
    if not mixers:
        raise ValueError("align_layers: no mixers given")
    shapes = set()
    for l, m in mixers.items():
        if l not in inputs or l not in targets:
            raise ValueError(f"align_layers: layer {l} has no stored inputs/targets")
        x, y = inputs[l], targets[l]
        hidden = m.o_proj.out_features
        if x.ndim != 3 or x.shape != y.shape or x.shape[-1] != hidden:
            raise ValueError(f"align_layers: layer {l} inputs {tuple(x.shape)} / targets {tuple(y.shape)} must both "
                             f"be (N, T, {hidden})")
        shapes.add(tuple(x.shape[:2]))
    if len({n for n, _ in shapes}) != 1:
        raise ValueError(f"align_layers: every layer needs the same number of stored rows, got {sorted(shapes)}")
    return next(iter(shapes))[0]


def align_layers(mixers: dict[int, nn.Module], inputs: dict[int, Tensor], targets: dict[int, Tensor],
                 args: AlignArgs, *, eval_rows: int | None = None, weights: dict[int, Tensor] | None = None) -> dict:
    """Train every mixer (in place) to reproduce its layer's teacher attention output; `weights`: optional (N, T)
    loss weights of each layer's positions (stats.far_weights). Returns the report

        {"layers": {l: {"rel_mse_before", "rel_mse_after", "best_step", "diverged_at", "best_eval_rel_mse",
                        "best_train_loss", "best_train_step", "trained_params"}},
         "mean_rel_mse_before", "mean_rel_mse_after", "wall_s", "train_s", "steps", "lr_scale", "layer_group",
         "tokens_per_step", "eval_rows"}

    Mixers stay where they are (device); stored rows may live elsewhere (e.g. CPU) and move a batch at a time.
    requires_grad flags, train/eval mode and parameter dtypes are restored at the end, even on error.
    """
    if args.steps is None or args.batch_size is None or args.lr_qkv is None:
        raise ValueError("align needs steps, batch_size and lr_qkv: set them, or fill them with config.apply_profile")
    t_start = time.perf_counter()
    layers = sorted(mixers)
    n_rows = _check_data(mixers, inputs, targets)
    bad = [l for l in layers if weights is not None and (l not in weights or weights[l].shape != inputs[l].shape[:2])]
    if bad:
        raise ValueError(f"align_layers: position weights must be (rows, positions) like each layer's inputs; layers "
                         f"{bad} have none or another shape")
    n_eval = min(n_rows, 4 if eval_rows is None else eval_rows)
    if n_eval < 1:
        raise ValueError(f"align_layers: eval_rows={eval_rows} must be >= 1")
    batch = min(args.batch_size, n_rows)
    if batch < args.batch_size:
        log.info("align: batch_size %d > %d stored rows; using %d", args.batch_size, n_rows, batch)
    idx = batch_indices(n_rows, batch, args.steps, args.seed)  # same rows for every layer at a given step
    crop = slice(None) if args.seq_len is None else slice(0, args.seq_len)
    seq = inputs[layers[0]][:, crop].shape[1]

    saved_flags = {l: [(p, p.requires_grad) for p in mixers[l].parameters()] for l in layers}
    saved_mode = {l: mixers[l].training for l in layers}
    saved_dtype = {l: [(p, p.dtype) for p in mixers[l].parameters()] for l in layers}
    train = None
    try:
        st = {l: _LayerState(l, mixers[l], inputs[l], targets[l], n_eval, batch, args,
                             None if weights is None else weights[l]) for l in layers}
        train = _Training(list(st.values()), args)
        before = {l: st[l].evaluate(0) for l in layers}
        bar = tqdm(range(1, args.steps + 1), desc="align", leave=False, disable=args.steps == 0)
        clock = Clock(train.device)
        clock.start()
        for step in bar:
            train.step(step, idx[step - 1], crop, lr_factor(step, args))
            if step % args.log_every == 0 or step == args.steps:
                with clock.paused():
                    for l in layers:
                        if st[l].active:
                            st[l].check(step, train.first_bad(st[l]))
                bar.set_postfix(rel_mse=f"{sum(s.current for s in st.values()) / len(layers):.4f}")
        bar.close()
        train.unstack()
        report_layers = {}
        for l in layers:
            s = st[l]
            s.restore_best()
            _restore_dtypes(saved_dtype[l])
            mixers[l].eval()
            after = rel_mse(mixers[l], inputs[l][:n_eval], targets[l][:n_eval], batch)
            report_layers[l] = dict(rel_mse_before=before[l], rel_mse_after=after, best_step=s.best_step,
                                    diverged_at=s.diverged_at, best_eval_rel_mse=s.best_eval,
                                    trained_params=s.num_trained, **train.summary(s))
    finally:
        if train is not None:
            train.unstack()
        for l in layers:
            _restore_dtypes(saved_dtype[l])
            for p, flag in saved_flags[l]:
                p.requires_grad_(flag)
            mixers[l].train(saved_mode[l])

    report = {
        "layers": report_layers,
        "mean_rel_mse_before": sum(r["rel_mse_before"] for r in report_layers.values()) / len(layers),
        "mean_rel_mse_after": sum(r["rel_mse_after"] for r in report_layers.values()) / len(layers),
        "wall_s": time.perf_counter() - t_start,
        "train_s": clock.elapsed(),
        "steps": args.steps,
        "lr_scale": scale_of(args),
        "layer_group": train.group,
        "tokens_per_step": batch * seq,
        "eval_rows": n_eval,
    }
    _print_table(report)
    return report


class _Staging:
    """Moves a step's rows to the layer's device. Rows stored in host memory for a CUDA layer (stats.store_device_for:
    too many for the GPU) are gathered into a few rotating page-locked buffers and copied asynchronously: a copy from
    pageable memory runs at a fraction of the bus speed and blocks the host (measured by benchmarks/perf_scale.py).
    A buffer is reused only after its copy finished."""

    SLOTS = 4

    def __init__(self):
        self.pool: dict[tuple, list] = {}

    def __call__(self, src: Tensor, rows: Tensor, crop: slice, device: torch.device) -> Tensor:
        view = src[:, crop]
        if src.device.type != "cpu" or device.type != "cuda":
            return view[rows].to(device, non_blocking=True)
        key = ((len(rows), *view.shape[1:]), src.dtype)
        slots = self.pool.setdefault(key, [])
        if len(slots) < self.SLOTS:
            slots.append([torch.empty(key[0], dtype=src.dtype, pin_memory=True), None])
        slot = slots.pop(0)
        if slot[1] is not None:
            slot[1].synchronize()
        torch.index_select(view, 0, rows, out=slot[0])
        out = slot[0].to(device, non_blocking=True)
        slot[1] = torch.cuda.Event()
        slot[1].record()
        slots.append(slot)
        return out


class _LayerState:
    """One layer's trained parameters, evaluation rows, best state and divergence record."""

    def __init__(self, layer: int, mixer: nn.Module, x: Tensor, y: Tensor, n_eval: int, batch: int,
                 args: AlignArgs, w: Tensor | None = None):
        self.layer, self.mixer, self.x, self.y, self.w = layer, mixer, x, y, w
        self.eval_x, self.eval_y, self.eval_batch = x[:n_eval], y[:n_eval], batch
        for p in mixer.parameters():
            p.requires_grad_(False)
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()  # fp32 master weights for AdamW; cast back at the end
        self.params = [p for g in trained_parameters(mixer, args).values() for _, p in g]
        for p in self.params:
            p.requires_grad_(True)
        self.num_trained = sum(p.numel() for p in self.params)
        self.device = self.params[0].device if self.params else next(mixer.parameters()).device
        self.active, self.diverged_at = bool(self.params) and args.steps > 0, None
        self.best_eval, self.best_step, self.best_state, self.current = float("inf"), 0, None, float("nan")

    def batch(self, rows: Tensor, crop: slice, staging: "_Staging") -> tuple[Tensor, Tensor, Tensor | None]:
        """This step's rows (`rows` on the stored data's device) as fp32 on the layer's device, and their position
        weights if the layer has them."""
        w = None if self.w is None else staging(self.w, rows, crop, self.device).float()
        return staging(self.x, rows, crop, self.device).float(), staging(self.y, rows, crop, self.device).float(), w

    @torch.no_grad()
    def evaluate(self, step: int) -> float:
        """rel-MSE on the eval rows; keeps a copy of the parameters when it is the best so far."""
        self.mixer.eval()
        r = rel_mse(self.mixer, self.eval_x, self.eval_y, self.eval_batch)
        self.current = r
        if math.isfinite(r) and r < self.best_eval:
            self.best_eval, self.best_step = r, step
            if self.best_state is None:
                self.best_state = [p.detach().clone() for p in self.params]
            else:
                for b, p in zip(self.best_state, self.params):
                    b.copy_(p)
        return r

    def check(self, step: int, bad: int) -> None:
        """Evaluation point: stop on divergence (`bad`: the first step with a non-finite loss or gradient norm, -1 if
        none; the best state is restored), else evaluate and keep the best."""
        if bad < 0:
            r = self.evaluate(step)
            if math.isfinite(r):
                return
            bad = step  # finite loss and gradients but a non-finite output on the eval rows
        self.diverged_at, self.active = bad, False  # put back after every step from now on (_Training.step)
        if self.best_state is None:  # the initial state was already non-finite: keep the layer as it is now
            self.best_state = [p.detach().clone() for p in self.params]
        self.restore_best()
        self.current = self.best_eval
        log.warning("align: layer %d diverged (non-finite loss or gradient) at step %d; restored its state from "
                    "step %d and stopped training it", self.layer, bad, self.best_step)

    @torch.no_grad()
    def restore_best(self) -> None:
        if self.best_state is None:  # never evaluated finite and never diverged: nothing to go back to
            return
        for p, b in zip(self.params, self.best_state):
            p.copy_(b)


class _Method(nn.Module):
    """Calls one method of a mixer as `forward`, so `torch.func.functional_call` can run it with other parameters."""

    def __init__(self, mixer: nn.Module, method: str):
        super().__init__()
        self.mixer, self.method = mixer, method

    def forward(self, *args):
        return getattr(self.mixer, self.method)(*args)


class _Stack:
    """A chunk of layers trained together, their parameters stacked: each parameter name is one (L, ...) tensor, and
    each mixer's parameter is a view of its slice, so evaluation, best states and restores act on the mixers as they
    are. A step runs every layer's projections, convs and gates as one batched (`torch.vmap`) op over the stack and
    the recurrences as one stacked call: the same arithmetic as L separate layers (test), in a few dozen kernel
    launches instead of L times as many (a small layer's step is launch- and Python-bound on a GPU)."""

    def __init__(self, states: list[_LayerState]):
        m0 = states[0].mixer
        shapes = {n: p.shape for n, p in m0.named_parameters()}
        for s in states:
            m = s.mixer
            if ((m.num_heads, m.head_dim, m.backend) != (m0.num_heads, m0.head_dim, m0.backend)
                    or {n: p.shape for n, p in m.named_parameters()} != shapes or s.device != states[0].device):
                raise ValueError("align: layers trained together need the same heads, head_dim, parameter shapes, "
                                 "backend and device (set --phase2.layer_group 1 to train them one by one)")
        self.states, self.mixer = states, m0
        self.leaves: dict[str, torch.Tensor] = {}
        for name in shapes:
            params = [s.mixer.get_parameter(name) for s in states]
            leaf = torch.stack([p.detach() for p in params]).requires_grad_(params[0].requires_grad)
            for i, p in enumerate(params):
                p.data = leaf.detach()[i]  # the mixer now reads and writes its slice of the stack
            self.leaves[name] = leaf
        self.features, self.output = _Method(m0, "features"), _Method(m0, "output")

    def trained(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self.leaves.items() if t.requires_grad}

    def losses(self, xs: Tensor, ys: Tensor, sink_weight: float = 1.0, ws: Tensor | None = None) -> Tensor:
        """Per-layer MSE (L,) of the stacked layers on inputs / targets (L, B, T, hidden); position 0 weighs
        `sink_weight` positions (AlignArgs.sink_weight); `ws` (L, B, T): each position's weight (far_weights)."""
        params = {f"mixer.{n}": t for n, t in self.leaves.items()}
        L, B = xs.shape[:2]
        self.mixer.train()
        feats = torch.vmap(lambda p, x: functional_call(self.features, p, (x,)))(params, xs)
        o = self.mixer.readout(*(t.flatten(0, 1) for t in feats))  # the recurrence, layers along the batch
        outs = torch.vmap(lambda p, x, o: functional_call(self.output, p, (x, o)))(params, xs, o.unflatten(0, (L, B)))
        err = (outs.float() - ys).pow(2).mean(3)  # (L, B, T)
        per_pos = (err if ws is None else err * ws).mean(1)  # (L, T)
        return (per_pos.sum(1) + (sink_weight - 1.0) * per_pos[:, 0]) / (per_pos.shape[1] + sink_weight - 1.0)

    @torch.no_grad()
    def clip_(self, max_norm: float) -> Tensor:
        """Clip each layer's gradient to `max_norm` on its own (torch's clip_grad_norm_ per layer); the norms (L,)."""
        grads = [t.grad for t in self.trained().values() if t.grad is not None]
        norms = torch.stack([g.pow(2).flatten(1).sum(1) for g in grads]).sum(0).sqrt()
        if math.isfinite(max_norm):
            coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef.view(-1, *(1,) * (g.ndim - 1)))
        return norms

    @torch.no_grad()
    def unstack(self) -> None:
        """Give every mixer its own parameters again (the stack's memory is freed with it)."""
        leaves, self.leaves = self.leaves, {}
        for name in leaves:
            for s in self.states:
                p = s.mixer.get_parameter(name)
                p.data = p.data.clone()


class _Training:
    """The optimizer of all layers and the batched step. Per-layer records (best training loss and its step, first
    non-finite step) are device tensors indexed by layer position: no host sync per step.

    A layer that diverged stays in its stack (the others' arithmetic does not depend on it) but is put back to its
    best state after every step, so it no longer changes."""

    def __init__(self, states: list[_LayerState], args: AlignArgs):
        self.states = states
        self.pos = {id(s): i for i, s in enumerate(states)}
        self.staging = _Staging()
        self.group = len(states) if args.layer_group is None else args.layer_group
        trained = [s for s in states if s.params]
        self.device = trained[0].device if trained else states[0].device
        alike: dict[tuple, list[_LayerState]] = {}  # head-wise layers differ in heads: stack equal shapes only
        for s in trained:
            m = s.mixer
            key = (m.num_heads, m.head_dim, m.backend, str(s.device), tuple(p.shape for p in m.parameters()))
            alike.setdefault(key, []).append(s)
        self.stacks = [_Stack(part[i:i + self.group]) for part in alike.values()
                       for i in range(0, len(part), self.group)]
        lrs = {"new": args.lr, "qkv": args.lr_qkv, "o_proj": args.lr_o, "o_norm": args.lr,
               "dynamics": args.lr if args.lr_dynamics is None else args.lr_dynamics}
        lrs = {g: lr * scale_of(args) for g, lr in lrs.items()}
        groups = {g: [t for st in self.stacks for n, t in st.trained().items() if _group_of(st.mixer, n) == g] for g in lrs}
        groups = {g: ps for g, ps in groups.items() if ps}
        self.base_lrs = [lrs[g] for g in groups]
        # fused: one kernel per step instead of a few per parameter (small layers are launch-bound on a GPU)
        self.opt = torch.optim.AdamW([{"params": ps, "lr": lrs[g]} for g, ps in groups.items()],
                                     weight_decay=args.weight_decay,
                                     fused=self.device.type == "cuda" or None) if groups else None
        self.max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
        self.sink_weight = args.sink_weight
        n = len(states)
        self.best_train = torch.full((n,), float("inf"), device=self.device)
        self.best_train_step = torch.zeros(n, dtype=torch.long, device=self.device)
        self.bad = torch.full((n,), -1, dtype=torch.long, device=self.device)
        self._positions = [torch.tensor([self.pos[id(s)] for s in st.states], device=self.device)
                           for st in self.stacks]
        self._active: dict[tuple, Tensor] = {}  # which layers of a stack still train, on the device (built on change)

    def step(self, step: int, rows: Tensor, crop: slice, factor: float) -> None:
        if not any(s.active for s in self.states):
            return
        for g, base in zip(self.opt.param_groups, self.base_lrs):
            g["lr"] = base * factor
        for st, idx in zip(self.stacks, self._positions):
            self._forward_backward(st, idx, step, rows, crop)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for s in self.states:
            if not s.active:
                s.restore_best()

    def _forward_backward(self, st: _Stack, idx: Tensor, step: int, rows: Tensor, crop: slice) -> None:
        """Forward and backward of one stack's layers; clip each layer's gradient; update the per-layer records."""
        rows_on = {d: rows.to(d) for d in {s.x.device for s in st.states}}
        data = [s.batch(rows_on[s.x.device], crop, self.staging) for s in st.states]
        with autocast(self.device):
            ws = None if data[0][2] is None else torch.stack([w for _, _, w in data])
            losses = st.losses(torch.stack([x for x, _, _ in data]), torch.stack([y for _, y, _ in data]),
                               self.sink_weight, ws)
        losses.sum().backward()  # layer l's parameters only see loss l
        norms = st.clip_(self.max_norm)
        losses = losses.detach()
        flags = tuple(s.active for s in st.states)
        active = self._active.get(flags)
        if active is None:
            active = self._active[flags] = torch.tensor(flags, device=self.device)
        ok = torch.isfinite(losses) & torch.isfinite(norms)
        bad = self.bad[idx]
        self.bad[idx] = torch.where(active & (bad < 0) & ~ok, step, bad)
        better = active & ok & (losses < self.best_train[idx])
        self.best_train[idx] = torch.where(better, losses, self.best_train[idx])
        self.best_train_step[idx] = torch.where(better, step, self.best_train_step[idx])

    def unstack(self) -> None:
        for st in self.stacks:
            st.unstack()

    def first_bad(self, s: _LayerState) -> int:
        return int(self.bad[self.pos[id(s)]].item())

    def summary(self, s: _LayerState) -> dict:
        i = self.pos[id(s)]
        best = float(self.best_train[i].item())
        ok = math.isfinite(best)
        return dict(best_train_loss=best if ok else None, best_train_step=int(self.best_train_step[i]) if ok else None)


def _restore_dtypes(saved: list[tuple[torch.nn.Parameter, torch.dtype]]) -> None:
    for p, dtype in saved:
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


def _print_table(report: dict) -> None:
    print(f"\nalignment: {report['steps']} steps x {report['tokens_per_step']} tokens per layer, "
          f"rel-MSE on {report['eval_rows']} eval rows, {report['wall_s']:.1f} s")
    print(f"  {'layer':>5}  {'before':>10}  {'after':>10}  {'best step':>9}  note")
    for l, r in report["layers"].items():
        note = f"diverged at step {r['diverged_at']}" if r["diverged_at"] is not None else ""
        print(f"  {l:>5}  {r['rel_mse_before']:>10.4f}  {r['rel_mse_after']:>10.4f}  {r['best_step']:>9}  {note}")
    print(f"  {'mean':>5}  {report['mean_rel_mse_before']:>10.4f}  {report['mean_rel_mse_after']:>10.4f}")


class RopedAttention(nn.Module):
    """A kept attention module called like a mixer, `(x) -> (out, None)`: RoPE for positions 0..T-1 and the causal
    mask (sliding-window when `local`) come from here, in the format the module's attention implementation takes, so
    `rel_mse` and the alignment loop treat it like a GDN layer. `layer_type`: the layer's entry in the model's
    `layer_types`, for rotary embeddings kept per layer type (Gemma 3: local and global). Build it with `roped`."""

    def __init__(self, attn: nn.Module, rotary: nn.Module, layer_type: str | None = None, local: bool = False):
        super().__init__()
        self.attn, self.rotary, self.layer_type, self.local = attn, rotary, layer_type, local

    @property
    def o_proj(self):
        return self.attn.o_proj

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)[None]
        rope = self.rotary(x, pos) if self.layer_type is None else self.rotary(x, pos, self.layer_type)
        make = create_sliding_window_causal_mask if self.local else create_causal_mask
        mask = make(config=self.attn.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
        return self.attn(x, position_embeddings=rope, attention_mask=mask)[0], None


def roped(model, layer: int, attn: nn.Module) -> RopedAttention:
    """`attn`, layer `layer`'s kept attention in `model` (a teacher, or a hybrid: its base model holds the teacher's
    rotary embedding and config), as a RopedAttention with the layer's rotary and mask: sliding-window where the
    model's layer types say so, or, without layer types, everywhere when the config has a window (Mistral)."""
    rotary, cfg = model.model.rotary_emb, model.model.config
    types = getattr(cfg, "layer_types", None)
    local = types[layer] == "sliding_attention" if types else getattr(cfg, "sliding_window", None) is not None
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    return RopedAttention(attn, rotary, types[layer] if per_type else None, local)


def qk_norm_groups(a: nn.Module, args: AlignArgs) -> list[dict]:
    """Kept attention given q/k RMSNorm (`--target qwen3_5`): q_proj and k_proj at `lr_qkv`, the norms at `lr`."""
    return [{"params": [p for mod in (a.q_proj, a.k_proj) for p in mod.parameters()], "lr": args.lr_qkv},
            {"params": [a.q_norm.weight, a.k_norm.weight], "lr": args.lr}]


def projection_groups(a: nn.Module, args: AlignArgs) -> list[dict]:
    """Kept attention re-aligned to hybrid inputs: q/k/v projections at `lr_qkv`, o_proj at `lr_o`."""
    return [{"params": [p for mod in (a.q_proj, a.k_proj, a.v_proj) for p in mod.parameters()], "lr": args.lr_qkv},
            {"params": list(a.o_proj.parameters()), "lr": args.lr_o}]


def fit_module(module: nn.Module, groups: list[dict], step_loss, evaluate, args: AlignArgs,
               what: str) -> tuple[float, int]:
    """Phase 2's loop for one module: AdamW over parameter `groups` (each with its "lr"; the module's other
    parameters stay), `args.steps` steps of `step_loss(step)` with phase 2's schedule and clipping, `evaluate()` every
    `log_every` steps and at the end; the best evaluated state is restored, so a module never ends worse than it
    started (a non-finite evaluation stops the fit). Returns (evaluation before, the best evaluation's step: 0 when
    nothing improved); the module's parameters are left frozen."""
    groups = [{**g, "lr": g["lr"] * scale_of(args), "base_lr": g["lr"] * scale_of(args)} for g in groups]
    trained = [p for g in groups for p in g["params"]]
    for p in module.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(groups, weight_decay=args.weight_decay)
    best = before = evaluate()
    best_state, best_step = [p.detach().clone() for p in trained], 0
    for step in range(1, args.steps + 1):
        loss = step_loss(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            nn.utils.clip_grad_norm_(trained, args.grad_clip)
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * lr_factor(step, args)
        opt.step()
        if step % args.log_every == 0 or step == args.steps:
            r = evaluate()
            if not math.isfinite(r):
                log.warning("%s diverged at step %d; keeping step %d", what, step, best_step)
                break
            if r < best:
                best, best_step = r, step
                best_state = [p.detach().clone() for p in trained]
    with torch.no_grad():
        for p, b in zip(trained, best_state):
            p.copy_(b)
    for p in trained:
        p.requires_grad_(False)
    return before, best_step


def align_attention(attns: dict[int, RopedAttention], inputs: dict[int, Tensor], targets: dict[int, Tensor],
                    args: AlignArgs, *, eval_rows: int = 4, param_groups=qk_norm_groups,
                    desc: str = "align attention") -> dict:
    """Phase 2 for kept attention: each layer is trained to map `inputs` to `targets` with phase 2's rows, schedule,
    sink weighting, clipping and best-state rule (a layer never ends worse than it started on the eval rows).
    `param_groups(attn, args)` says what trains at which rate; the rest stays. Used for kept layers whose form
    changed (`--target qwen3_5` adds q/k RMSNorm; teacher-forced) and by `realign_kept` (hybrid inputs)."""
    layers = sorted(attns)
    n_rows = _check_data(attns, inputs, targets)
    n_eval, batch = min(n_rows, eval_rows), min(args.batch_size, n_rows)
    idx = batch_indices(n_rows, batch, args.steps, args.seed)
    crop = slice(None) if args.seq_len is None else slice(0, args.seq_len)
    report = {}
    for l in tqdm(layers, desc=desc, leave=False):
        m, x, y = attns[l], inputs[l], targets[l]
        a = m.attn
        dtype, device = a.q_proj.weight.dtype, a.q_proj.weight.device
        a.float().eval()  # fp32 master weights; cast back at the end

        def step_loss(step):
            rows = idx[step - 1]
            xb, yb = (t[rows.to(t.device)][:, crop].to(device, torch.float32) for t in (x, y))
            with autocast(device):
                out = m(xb)[0]
            per_pos = (out.float() - yb).pow(2).mean((0, 2))  # (T,)
            return (per_pos.sum() + (args.sink_weight - 1.0) * per_pos[0]) / (per_pos.numel() + args.sink_weight - 1.0)

        before, best_step = fit_module(a, param_groups(a, args), step_loss,
                                       lambda: rel_mse(m, x[:n_eval], y[:n_eval], batch), args,
                                       f"align attention: layer {l}")
        a.to(dtype)
        report[l] = dict(rel_mse_before=before, rel_mse_after=rel_mse(m, x[:n_eval], y[:n_eval], batch),
                         best_step=best_step)
    return {"layers": report, "mean_rel_mse_before": sum(r["rel_mse_before"] for r in report.values()) / len(layers),
            "mean_rel_mse_after": sum(r["rel_mse_after"] for r in report.values()) / len(layers)}


def kept_attention(hybrid) -> dict[int, nn.Module]:
    """{layer: its kept softmax attention}: the whole mixer of an attention layer, the attention part of a head-wise
    one."""
    gdn = set(hybrid.config.gdn_layers)
    return {i: layer.self_attn.attn if i in gdn else layer.self_attn for i, layer in enumerate(hybrid.model.layers)
            if i not in gdn or hybrid.config.kept_groups(i)}


class _Caught(Exception):
    """Stops a forward once the deepest wanted mixer input is caught: the layers after it need not run."""


@torch.no_grad()
def mixer_inputs(model, rows: Tensor, layers, batch_size: int) -> dict[int, Tensor]:
    """What each of `layers`' token mixers receives when `model` reads `rows` (N, T), on the rows' device; each
    forward stops at the deepest of them."""
    from taylor_calibrate.stats import capturing_inputs

    caught = {i: [] for i in layers}
    device = next(model.parameters()).device

    def stop(*_):
        raise _Caught

    with capturing_inputs(model, caught, rows.device):  # its hooks run before `stop`, registered after them
        hook = model.model.layers[max(layers)].self_attn.register_forward_pre_hook(stop)
        try:
            for i in range(0, rows.shape[0], batch_size):
                try:
                    model(input_ids=rows[i:i + batch_size].to(device), use_cache=False, logits_to_keep=1)
                except _Caught:
                    pass
        finally:
            hook.remove()
    return {i: torch.cat(c) for i, c in caught.items()}


def realign_kept(hybrid, teacher, rows: Tensor, args: AlignArgs, batch_size: int = 4) -> dict:
    """Re-align the hybrid's kept attention to the inputs the hybrid gives it (`--phase2.kept_attention`).

    Teacher forcing trains each GDN layer on the teacher's inputs; in the hybrid, every kept attention head after the
    first GDN layer reads a residual stream that the GDN layers before it have moved. Each kept attention module is
    trained (`align_attention`, q/k/v at `lr_qkv`, o_proj at `lr_o`) to produce from the hybrid's inputs what it
    produced from the teacher's. Both models' inputs to the kept modules are read in one pass each before any module
    moves, on rows cropped to `args.seq_len` (causal models give the positions kept the inputs the whole rows would)."""
    rows = rows if args.seq_len is None else rows[:, :args.seq_len]
    attns = kept_attention(hybrid)
    layers = sorted(attns)
    x_teacher = mixer_inputs(teacher, rows, layers, batch_size)
    x_hybrid = mixer_inputs(hybrid, rows, layers, batch_size)
    modules = {i: roped(hybrid, i, m) for i, m in attns.items()}
    targets = {}
    with torch.no_grad():
        for i, m in modules.items():
            p = next(m.parameters())
            targets[i] = torch.cat([m(x.to(p.device))[0].to(rows.device)
                                    for x in x_teacher.pop(i).split(batch_size)])
    return align_attention(modules, x_hybrid, targets, args, param_groups=projection_groups,
                           desc="realign kept attention")
