"""The `distill` stage: recover a converted hybrid by distillation from its teacher (docs/method.md,
"Recovery distillation").

    loss = kl_weight * T^2 * KL(teacher_T || student_T)      per token, forward KL on the logits (optionally weighted
                                                             per position: --train.far_weight)
         + hidden_weight * sum_l |h_l - h_l^T|^2 / |h_l^T|^2  every layer's output (optional)
         + ce_weight * CE(student, next token)                (optional)

No (tokens x vocabulary) logits exist (`--train.head fused`, the default): both models run to their final hidden
states, and `fused_kd` applies both lm heads (with any final logit soft-cap), the KL and the cross-entropy one chunk
of tokens at a time, the gradients w.r.t. the student's hidden states and head weight formed in the same pass; the
held-out evaluation goes the same way. `--train.head logits` takes the models' full logits and the KL over chunks of
them (`chunked_kl`); `forward_kl` is the plain fp32 reference both are tested against.
Training data are fixed-length windows of the token shards (`data.write_tokens`: tokenised once, memory-mapped, so
memory does not grow with the budget); the windows of a step are a function of the step alone (`data.step_windows`),
and the optimizer step uses the same global batch whatever the number of processes, so a resumed run, a 1-process
run and a `torchrun --nproc_per_node K` run follow the same loss curve. Under torchrun the student is wrapped in
DDP or FSDP2 (`fully_shard` per decoder layer); checkpoints hold full (gathered) state dicts of the trained
parameters and the optimizer in safetensors, written to a temporary directory and renamed into place, then
pointed at by `latest` (also replaced atomically): a kill at any moment leaves the previous checkpoint intact. The
last two checkpoints are kept; a damaged newest one falls back to the one before. Each records its run's identity (a
digest of the student's initial weights, the teacher, the arguments that shape training): a resume into a directory
of another run is refused with the difference named.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from taylor_calibrate.config import DistillArgs, TrainArgs, apply_profile, apply_train_profile
from taylor_calibrate.checks import (check_context, check_out, check_same_layers, check_same_vocab,
                                    check_teacher_origin, check_token_cache, writes_out)
from taylor_calibrate.data import TokenWindows, distill_data, recall_rows, repeat_spans, step_windows
from taylor_calibrate.checkpoint import REPORT, check_finite, load_model, staged_dir
from taylor_calibrate.model.hybrid import gdn_heads
from taylor_calibrate.model.hybrid_config import MIXER_TYPE
from taylor_calibrate.model.loading import NotJSON, parse_json, read_json, read_text
from taylor_calibrate.results import is_output_of, record, write_json
from taylor_calibrate.ops import loss_kernel, resolve_backend, training_backend
from taylor_calibrate.ops.kd_torch import kd_chunk
from taylor_calibrate.stats import FarMass, observing
from taylor_calibrate.teacher import load_teacher, resolve_device, resolve_dtype, teacher_hash
from taylor_calibrate.training import (Clock, autocast, hold_frozen, release_frozen, resolve_attention, restore_attention,
                                       swap_attention, warmup_cosine)

log = logging.getLogger("taylor_calibrate")

CKPT_DIR = "checkpoints"
METRICS = "metrics.jsonl"
# Peak dense bf16 tensor-core TFLOP/s by device-name fragment (vendor datasheets), for the MFU estimate.
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


# --- processes ---------------------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> tuple[Dist, torch.device]:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1): NCCL on GPUs, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before the group forms, so its collectives know their GPU
    if not dist.is_initialized():
        # the other processes wait while the first one tokenises or converts (minutes to hours for a large teacher)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(hours=3))
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank), device


def all_sum(values: list[float], ctx: Dist, device) -> list[float]:
    """`values` summed over the processes (as they are in one process)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if ctx.world > 1:
        dist.all_reduce(t)
    return t.tolist()


# --- what trains, and how it is wrapped --------------------------------------------------------------------------
def trainable_names(student, mode: str) -> list[str]:
    """"mixers": the token mixers of the converted layers (head-wise ones whole); "gdn": their GDN heads only (a
    head-wise layer's kept attention stays frozen); "all": every parameter."""
    names = [n for n, _ in student.named_parameters()]
    if mode == "all":
        return names
    headwise = set(student.config.gdn_layers) - {i for i, t in enumerate(student.config.layer_types) if t == MIXER_TYPE}
    prefixes = tuple(f"model.layers.{i}.self_attn." + ("gdn." if mode == "gdn" and i in headwise else "")
                     for i in student.config.gdn_layers)
    if not prefixes:
        raise ValueError("the student has no GDN layers to train; pass --train.train all or a converted model")
    return [n for n in names if n.startswith(prefixes)]


def wrap(student, ctx: Dist, parallel: str, device: torch.device):
    """DDP or FSDP2 under torchrun; the plain module in one process."""
    if ctx.world == 1:
        return student
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(student, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in student.model.layers:
        fully_shard(layer, **kw)
    fully_shard(student, **kw)
    return student


def compile_layers(*models) -> None:
    """torch.compile each decoder layer in place (per layer, as torchtitan does: one graph serves every layer of a
    kind, and FSDP2's per-layer wrapping stays outside the compiled code).

    A layer's graph is specialised on more than its kind: whether its input requires grad (before and after the first
    trained layer), train / eval mode, teacher or student, and under FSDP2 its own hooks. On an H200, 2-process FSDP2
    of a 4-layer hybrid already reached dynamo's default of 8 graphs per code object, past which layers silently run
    eager; two per layer bounds every combination."""
    layers = [layer for m in models for layer in m.model.layers]
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(layers))
    for layer in layers:
        layer.compile()


def uncompile_layers(*models) -> None:
    """Undo `compile_layers`: the layers run eagerly again (distill hands its models back as it got them, so a caller
    that goes on to generate with them does not recompile for every new shape)."""
    for layer in (layer for m in models for layer in m.model.layers):
        layer._compiled_call_impl = None


# --- the loss ----------------------------------------------------------------------------------------------------
def forward_kl(s_logits: torch.Tensor, t_logits: torch.Tensor, tau: float,
               weights: torch.Tensor | None = None) -> torch.Tensor:
    """tau^2 KL(softmax(t / tau) || softmax(s / tau)), mean over tokens (each token's KL times its `weights` (B, T)
    when given), in fp32 on full logits: the reference that `fused_kd` and `chunked_kl` are tested against. It holds
    several fp32 (tokens x vocab) copies of the logits at once."""
    if tau != 1.0:
        s_logits, t_logits = s_logits.float() / tau, t_logits.float() / tau
    t_logp = F.log_softmax(t_logits.float(), -1)
    s_logp = F.log_softmax(s_logits.float(), -1)
    kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="none").sum(-1)  # (B, T)
    return (kl if weights is None else kl * weights).mean() * tau ** 2


@dataclass(frozen=True)
class Head:
    """A model's output layer as the fused loss applies it: logits = cap x tanh(h @ weight.T / cap) (no cap: None)."""
    weight: torch.Tensor
    cap: float | None = None


def output_head(model) -> Head:
    """`model`'s lm_head weight and final logit soft-cap (read after its forward: under FSDP2 the root's parameters
    are whole only then). A head the fused loss cannot apply as the model does is refused."""
    m = model.module if hasattr(model, "module") else model  # DDP
    head = m.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"{type(m).__name__}'s output layer is not a bias-free linear lm_head, which the fused "
                         "distillation loss assumes; pass --train.head logits")
    return Head(head.weight, getattr(m.config, "final_logit_softcapping", None) or None)


def check_head(model, ids: torch.Tensor, who: str) -> None:
    """`model`'s own logits at the last position of `ids` against its `output_head` applied to its final hidden
    state: a model that does anything else to its logits (a scale, another cap) is refused before training, not
    distilled wrongly."""
    with torch.no_grad():
        out = model_hidden(model, ids)
        head = output_head(model)
        h, theirs = out.hidden_states[-1][:, -1], out.logits[:, -1].float()
        ours = F.linear(h.to(head.weight.dtype), head.weight).float()
        if head.cap:
            ours = torch.tanh(ours / head.cap) * head.cap
        err, size = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    if not err <= 1e-2 * size + 1e-5:
        raise ValueError(f"the {who}'s logits are not lm_head(final hidden state) with its final_logit_softcapping "
                         f"(they differ by {err:.3g} at logits of size {size:.3g}): the fused distillation loss would "
                         "be wrong for it; pass --train.head logits")


def model_hidden(model, ids: torch.Tensor, hidden: bool = False):
    """The model's forward with the logits of the last position only: .hidden_states[-1] is the final (normed) hidden
    state, the whole tuple (every layer's output) when `hidden`. The root's forward runs, so DDP and FSDP2 see it."""
    return model(input_ids=ids, use_cache=False, output_hidden_states=True if hidden else -1, logits_to_keep=1)


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _FusedKD(torch.autograd.Function):
    """fused_kd's value and gradient, `chunk` rows at a time: each chunk's logits of both heads are formed, reduced
    (`kernel`) and dropped; the gradients w.r.t. the student's hidden states and head weight are accumulated in the
    forward pass (their closed form needs the same softmaxes), and the backward only scales them."""

    @staticmethod
    def forward(ctx, s_h, s_w, t_h, t_w, y, w, tau, kl_scale, ce_scale, s_cap, t_cap, chunk, kernel):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad = need_h or need_w
        dt = _matmul_dtype(s_h)  # bf16 under the training's autocast, as the model's own lm_head would run
        s_wc = s_w.to(dt)
        t_wc = None if t_w is None else t_w.to(dt)
        gh = torch.empty_like(s_h) if need_h else None
        gw = torch.zeros(s_w.shape, dtype=torch.float32, device=s_w.device) if need_w else None
        kl, nll = (torch.zeros((), dtype=torch.float32, device=s_h.device) for _ in range(2))
        for i in range(0, s_h.shape[0], chunk):
            h = s_h[i:i + chunk].to(dt)
            zt = None if t_h is None else F.linear(t_h[i:i + chunk].to(dt), t_wc)
            k, c, g = kernel(F.linear(h, s_wc), zt, None if y is None else y[i:i + chunk],
                             None if w is None else w[i:i + chunk], tau, kl_scale, ce_scale, s_cap, t_cap, grad)
            kl = kl if k is None else kl + k
            nll = nll if c is None else nll + c
            if gh is not None:
                gh[i:i + chunk] = g @ s_wc
            if gw is not None:
                gw += (g.t() @ h).float()
        ctx.grads, ctx.w_dtype = (gh, gw), s_w.dtype
        ctx.mark_non_differentiable(kl, nll)
        return kl * kl_scale + nll * ce_scale, kl, nll

    @staticmethod
    def backward(ctx, grad_out, *_):
        (gh, gw), ctx.grads = ctx.grads, None
        gh = None if gh is None else gh.mul_(grad_out.to(gh.dtype))
        gw = None if gw is None else gw.mul_(grad_out).to(ctx.w_dtype)
        return gh, gw, *([None] * 11)


def fused_kd(s_hidden: torch.Tensor, s_head: Head, t_hidden: torch.Tensor | None, t_head: Head | None, *,
             tau: float = 1.0, kl_weight: float = 1.0, ce_weight: float = 0.0, labels: torch.Tensor | None = None,
             weights: torch.Tensor | None = None, chunk: int = 4096,
             kernel=kd_chunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits terms of the distillation loss from the final hidden states (B, T, H) and the heads, without ever
    forming (tokens x vocabulary) logits: only one chunk of `chunk` tokens' logits exists at a time, forward and
    backward. Returns (loss, sum of the tokens' weighted KL, sum of their NLL) where loss = kl_weight x tau^2 x mean
    over tokens of weights x KL(teacher_tau || student_tau) (= forward_kl) + ce_weight x mean NLL of `labels` (B, T)
    over the tokens that have one (>= 0); differentiable w.r.t. s_hidden and s_head.weight (a tied embedding too).
    t_hidden None: no KL. The matmuls run in the autocast dtype when autocast is on.

    Not fla's `fused_kl_div_loss` nor Liger's fused linear JSD: neither takes per-token weights
    (--train.far_weight) or a final logit soft-cap, fla's has no temperature or NLL term, and both are Triton only (no
    CPU path for the tests). `kernel` reduces each chunk: ops/kd_triton.py's two-pass kernel or its reference
    `kd_chunk` (ops.loss_kernel picks)."""
    n = s_hidden.shape[0] * s_hidden.shape[1]
    y = None if labels is None else labels.reshape(-1)
    ce_scale = 0.0 if y is None else ce_weight / (y >= 0).sum().clamp(min=1)  # a tensor: no host sync
    w = None if weights is None else weights.reshape(-1).float()
    t_h = None if t_hidden is None else t_hidden.reshape(n, -1)
    return _FusedKD.apply(s_hidden.reshape(n, -1), s_head.weight, t_h, None if t_head is None else t_head.weight, y,
                          w, tau, kl_weight * tau ** 2 / n, ce_scale, s_head.cap, None if t_head is None else t_head.cap,
                          chunk, kernel)


class _ChunkedKL(torch.autograd.Function):
    """forward_kl's value on full logits, `chunk` rows at a time. The gradient is computed in the forward pass chunk by
    chunk into one buffer of the logits' dtype, and the backward only scales it."""

    @staticmethod
    def forward(ctx, s_logits, t_logits, tau, chunk, kernel, weights=None):
        s, t = s_logits.reshape(-1, s_logits.shape[-1]), t_logits.reshape(-1, t_logits.shape[-1])
        w = None if weights is None else weights.reshape(-1).float()
        n = s.shape[0]
        grad = torch.empty_like(s) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float32, device=s.device)
        for i in range(0, n, chunk):
            kl, _, g = kernel(s[i:i + chunk], t[i:i + chunk], None, None if w is None else w[i:i + chunk], tau,
                              tau ** 2 / n, 0.0, None, None, grad is not None)
            total = total + kl
            if grad is not None:
                grad[i:i + chunk] = g
        ctx.grad, ctx.shape = grad, s_logits.shape
        return total * (tau ** 2 / n)

    @staticmethod
    def backward(ctx, grad_out):
        grad, ctx.grad = ctx.grad, None
        return grad.mul_(grad_out.to(grad.dtype)).view(ctx.shape), None, None, None, None, None


def chunked_kl(s_logits: torch.Tensor, t_logits: torch.Tensor, tau: float, weights: torch.Tensor | None = None,
               chunk: int = 4096, kernel=kd_chunk) -> torch.Tensor:
    """forward_kl (same value, same gradient, same `weights`) over the models' full logits, `chunk` tokens at a time
    (`--train.head logits`): memory beyond the bf16 logits and their gradient is one fp32 chunk."""
    return _ChunkedKL.apply(s_logits, t_logits, tau, chunk, kernel, weights)


def kd_loss(student_out, teacher_out, ids: torch.Tensor, args: TrainArgs, weights: torch.Tensor | None = None,
            heads: tuple[Head, Head] | None = None, kernel=kd_chunk) -> tuple[torch.Tensor, dict]:
    """The distillation loss of the module docstring, mean over tokens (the KL's tokens weighted by `weights` (B, T)
    when given); returns (loss, its parts as floats). `heads` (student's, teacher's): the fused path (`fused_kd`) on
    the outputs' final hidden states (`model_hidden`); None: the outputs' full logits (`chunked_kl`)."""
    parts = {}
    loss = 0.0
    if heads is not None and (args.kl_weight or args.ce_weight):
        labels = F.pad(ids[:, 1:], (0, 1), value=-100) if args.ce_weight else None
        kl_on = bool(args.kl_weight)
        with autocast(ids.device):  # the heads' matmuls in bf16 on CUDA, as the models' own lm_head would run
            fused, kl, nll = fused_kd(student_out.hidden_states[-1], heads[0],
                                      teacher_out.hidden_states[-1] if kl_on else None, heads[1] if kl_on else None,
                                      tau=args.temperature, kl_weight=args.kl_weight, ce_weight=args.ce_weight,
                                      labels=labels, weights=weights, chunk=args.kl_chunk, kernel=kernel)
        loss = loss + fused
        if kl_on:
            parts["kl"] = kl.detach() * args.temperature ** 2 / ids.numel()
        if args.ce_weight:
            parts["ce"] = nll.detach() / (ids.shape[0] * (ids.shape[1] - 1))
    elif heads is None and args.kl_weight:
        kl = chunked_kl(student_out.logits, teacher_out.logits, args.temperature, weights, args.kl_chunk, kernel)
        loss = loss + args.kl_weight * kl
        parts["kl"] = kl.detach()
    if args.hidden_weight:
        hs, ht = student_out.hidden_states[1:], teacher_out.hidden_states[1:]
        mse = sum(((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean()) for a, b in zip(hs, ht)) / len(ht)
        loss = loss + args.hidden_weight * mse
        parts["hidden_mse"] = mse.detach()
    if args.ce_weight and heads is None:
        ce = F.cross_entropy(student_out.logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        loss = loss + args.ce_weight * ce
        parts["ce"] = ce.detach()
    parts["loss"] = loss.detach()
    return loss, parts


@torch.no_grad()
def heldout_eval(model, teacher, rows: torch.Tensor, batch_size: int, ctx: Dist, device, chunk: int = 4096,
                 kernel=kd_chunk) -> dict:
    """Student next-token loss (and KL to the teacher) on held-out rows, sharded over processes and summed; through
    the fused heads (`fused_kd`), so no full logits."""
    was = model.training
    model.eval()
    mine = rows[ctx.rank::ctx.world]
    nll = kl = n = 0.0
    for i in range(0, mine.shape[0], batch_size):
        ids = mine[i:i + batch_size].to(device)
        with autocast(device):
            s = model_hidden(model, ids).hidden_states[-1][:, :-1]
            t = model_hidden(teacher, ids).hidden_states[-1][:, :-1]
            _, k, c = fused_kd(s, output_head(model), t, output_head(teacher), labels=ids[:, 1:], chunk=chunk,
                               kernel=kernel)
        nll, kl, n = nll + c.item(), kl + k.item(), n + ids[:, 1:].numel()
    nll, kl, n = all_sum([nll, kl, n], ctx, device)
    model.train(was)
    loss = nll / n
    return {"heldout_loss": loss, "heldout_ppl": math.exp(loss) if loss < 700 else float("inf"), "heldout_kl": kl / n}


# --- checkpoints -------------------------------------------------------------------------------------------------
def _state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **kw)


def _trained_and_aliases(model) -> tuple[dict, set[str]]:
    """(the trained parameters by name, the names that only alias another parameter): a tied lm_head.weight is the
    embedding's parameter under a second name, which a state dict lists and named_parameters() does not."""
    m = model.module if hasattr(model, "module") else model
    trained = {n: p for n, p in m.named_parameters() if p.requires_grad}
    aliases = {n for n, _ in m.named_parameters(remove_duplicate=False)} - {n for n, _ in m.named_parameters()}
    return trained, aliases


def save_checkpoint(out: Path, step: int, model, opt, ctx: Dist, extra: dict) -> None:
    """Gather full state dicts of the trained parameters and the optimizer; rank 0 writes them atomically and keeps
    the newest two checkpoints."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt, options=_state_options(cpu_offload=ctx.world > 1, ignore_frozen_params=True))
    trained, _ = _trained_and_aliases(model)
    msd = {k: v for k, v in msd.items() if k in trained}  # not a tied alias (ignore_frozen_params keeps those)
    if ctx.main:
        root = out / CKPT_DIR
        final = root / f"step_{step:08d}"
        with staged_dir(final) as tmp:  # complete or not at all; a failed write (a full disk) leaves nothing
            save_file({k: v.detach().contiguous().cpu() for k, v in msd.items()}, str(tmp / "model.safetensors"))
            tensors, scalars = {}, {}
            for name, st in osd["state"].items():
                for k, v in st.items():
                    if torch.is_tensor(v):
                        tensors[f"{name}::{k}"] = v.detach().contiguous().cpu()
                    else:
                        scalars[f"{name}::{k}"] = v
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            meta = {"step": step, "param_groups": osd["param_groups"], "scalars": scalars, **extra}
            (tmp / "state.json").write_text(json.dumps(meta, default=str))
        write_json(root / "latest.json", {"step": step, "dir": final.name})
        for old in sorted(root.glob("step_*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
    if ctx.world > 1:
        dist.barrier()


def run_identity(student, trained: set[str], teacher: str | None, args: TrainArgs, data: dict | None = None) -> dict:
    """What makes two runs the same run: the student's initial weights (sha256 over every tensor's name, dtype and
    shape and the bytes of the trained ones; the frozen rest is the teacher's), the teacher (where it is and, when
    local, its `teacher_hash`), the arguments that shape training (not how often it logs, saves or evaluates) and the
    data."""
    h = hashlib.sha256()
    for name, t in sorted(student.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if name in trained:
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    shaping = {k: v for k, v in asdict(args).items()
               if k not in ("eval_every", "save_every", "log_every", "compile", "loss_kernel", "attention", "parallel",
                            "peak_tflops", "micro_batch_size", "head", "kl_chunk")}  # how the loss is computed, not what

    def where(spec):  # a local path compares by where it is, however it was spelled
        return str(Path(spec).resolve()) if isinstance(spec, str) and os.path.exists(spec) else spec

    data = {k: where(v) for k, v in (data or {}).items()}
    ident = {"student_sha256": h.hexdigest(), "teacher": where(teacher), "train": shaping, "data": data}
    weights = teacher_hash(teacher) if isinstance(teacher, str) else None
    if weights:  # a teacher replaced at the same path makes another run
        ident["teacher_hash"] = weights
    return json.loads(json.dumps(ident, default=str))  # as it reads back from state.json


_ADDED_LATER = ("teacher_hash", "rows", "heldout_rows", "dtype")  # identity keys checkpoints of older versions lack: not a difference


def identity_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The settings that differ between two run identities, as "key: <then> then, <now> now"."""
    diffs = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if k in _ADDED_LATER and k not in old:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += identity_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            if k == "student_sha256":
                diffs.append("the student's initial weights (another --student, or it changed)")
            elif k == "teacher_hash":
                diffs.append(f"the teacher's weights ({a} then, {b} now: the model at that path changed)")
            else:
                why = " (the corpus changed since)" if prefix.startswith("data.rows.") else ""
                diffs.append(f"{prefix}{k}: {a!r} then, {b!r} now{why}")
    return diffs


class CorruptCheckpoint(ValueError):
    pass


def read_checkpoint(ckpt: Path, model) -> tuple[dict, dict, dict]:
    """(meta, model state, optimizer state) of one checkpoint, checked against the run's trained parameters: every
    one present with its shape, nothing else (a strict load). Raises CorruptCheckpoint naming the file."""
    try:
        meta = read_json(ckpt / "state.json", "")
        step = meta["step"]
        if not isinstance(step, int) or isinstance(step, bool) or ckpt.name != f"step_{step:08d}":
            raise ValueError(f"its state.json records step {meta['step']!r}, not the step of {ckpt.name}")
        if not isinstance(meta["param_groups"], list) or not all(
                isinstance(g, dict) and isinstance(g.get("params"), list) and isinstance(g.get("lr"), (int, float))
                for g in meta["param_groups"]):
            raise ValueError("its state.json's param_groups are not an optimizer's (a list of objects with params "
                             "and lr)")
        msd = load_file(str(ckpt / "model.safetensors"))
        flat = load_file(str(ckpt / "optimizer.safetensors"))
        state: dict[str, dict] = {}
        for key, v in list(flat.items()) + list(meta["scalars"].items()):
            name, k = key.rsplit("::", 1)
            state.setdefault(name, {})[k] = v
        groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    except Exception as e:  # garbage JSON, missing keys, safetensors' own errors for truncated files
        raise CorruptCheckpoint(f"checkpoint {ckpt} is damaged ({type(e).__name__}: {e})") from e
    params, aliases = _trained_and_aliases(model)
    msd = {k: v for k, v in msd.items() if k not in aliases}  # checkpoints before the fix hold a tied lm_head.weight
    missing, unexpected = sorted(set(params) - set(msd)), sorted(set(msd) - set(params))
    shapes = [n for n in set(params) & set(msd) if tuple(params[n].shape) != tuple(msd[n].shape)]
    if missing or unexpected or shapes or (step > 0 and set(state) != set(params)):
        raise CorruptCheckpoint(f"checkpoint {ckpt} does not hold this run's trained parameters (missing "
                                f"{missing[:3]}, unexpected {unexpected[:3]}, other shapes {shapes[:3]})")
    return meta, msd, {"state": state, "param_groups": groups}


START_OVER = ("pass a new --out, or --resume false --overwrite true to start over there (the earlier run's output is "
              "deleted)")  # how a `distill` run that cannot be resumed is started over: named in its refusals


def check_fresh_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Before any work: a run that will start afresh in `out` (not `resume`, or no checkpoint there) over an earlier
    run's output needs `overwrite` (that output is deleted as the run starts: `clear_run`), unless that output is only
    the metrics of a run stopped before its first checkpoint (nothing trained to lose). A user's file or folder of a
    name the run writes is never replaced (`checks.check_out`, before this)."""
    if resume and any((out / CKPT_DIR).glob("step_*")):
        if overwrite:  # the user asked for a new run, which --resume true (the default) would not start
            raise ValueError(f"--out {out} holds a run to resume, and --resume true (the default) resumes it: "
                             "--overwrite true starts a new run there only with --resume false; pass both, or drop "
                             "--overwrite to resume")
        return  # resumed, or refused naming what differs (resume_checkpoint)
    if resume and is_output_of(out, "distill") and not (out / REPORT).exists() and not (out / "model").exists():
        log.info("%s holds only the metrics of a run stopped before its first checkpoint (nothing trained): the run "
                 "starts over there", out)  # the same command again, after a Ctrl-C in the first steps
        return
    if is_output_of(out, "distill") and not overwrite:
        why = "--resume false starts a new run there" if not resume else "it holds no checkpoint to resume from"
        raise FileExistsError(f"--out {out} holds an earlier distill run's output and {why}; pass --overwrite true "
                              "to replace it (deleted as the run starts), or another --out")


def clear_result(out: Path) -> None:
    """Delete a run's finished output from `out`: report.json first (written last, it marks model/ complete:
    `results.finished`), then model/. A resumed run does this as it resumes, so no report of an earlier stop stands
    beside its new checkpoints; its end writes both again."""
    (out / REPORT).unlink(missing_ok=True)
    shutil.rmtree(out / "model", ignore_errors=True)


def clear_run(out: Path) -> None:
    """Delete an earlier run's files from `out` (its result first: `clear_result`, then metrics.jsonl and its
    checkpoints), nothing else: a run starting afresh never sits beside another's output; a user's other files
    stay."""
    clear_result(out)
    ckpt = out / CKPT_DIR
    for f in (out / METRICS, ckpt / "latest.json"):
        f.unlink(missing_ok=True)
    for d in [*ckpt.glob("step_*"), *ckpt.glob(".step_*")]:
        shutil.rmtree(d, ignore_errors=True)


def resume_checkpoint(out: Path, model, opt, identity: dict, start_over: str = START_OVER) -> dict | None:
    """Restore the newest usable checkpoint of this run (falling back to the one before a damaged one) and return its
    meta; None when there is none. A checkpoint of another run is refused, naming what differs and `start_over` (how
    the calling command starts the run over)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    root = out / CKPT_DIR
    found = sorted(root.glob("step_*"), reverse=True) if root.is_dir() else []
    damaged = []
    for ckpt in found:
        try:
            meta, msd, osd = read_checkpoint(ckpt, model)
        except CorruptCheckpoint as e:
            damaged.append((ckpt, str(e)))
            continue
        if not isinstance(meta.get("identity", {}), dict):
            damaged.append((ckpt, f"checkpoint {ckpt} is damaged (its state.json's identity is not an object)"))
            continue
        if "identity" not in meta:
            raise ValueError(f"checkpoint {ckpt} records no run identity (an older version wrote it), so it cannot be "
                             f"told apart from another run's; {start_over}")
        diffs = identity_diff(meta["identity"], identity)
        if diffs:
            raise ValueError(f"{out} holds checkpoints of another run, which differs in: {'; '.join(diffs)}; "
                             f"{start_over}")
        try:
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd,
                           options=_state_options(strict=False))  # frozen parameters are not in it; checked above
        except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as e:  # an optimizer state of another shape
            damaged.append((ckpt, f"checkpoint {ckpt} is damaged (its optimizer state does not fit this run's "
                                  f"optimizer: {type(e).__name__}: {e})"))
            continue
        for bad, why in damaged:
            log.warning("%s; resuming from the previous checkpoint %s instead", why, ckpt.name)
            shutil.rmtree(bad, ignore_errors=True)  # later checkpoints of this run are rewritten from here
        return meta
    if damaged:
        raise ValueError(f"no usable checkpoint in {root}: {'; '.join(why for _, why in damaged)}; {start_over}")
    return None


def _records(path: Path) -> list[dict]:
    """metrics.jsonl's records; a half-written last line (a kill mid-write) is dropped, damage elsewhere is an error."""
    fix = "delete the file or pass a new --out"
    lines = read_text(path, "delete it or pass a new --out").splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = parse_json(line, f"{path}:{i + 1}", fix, object)
        except NotJSON:
            if i == len(lines) - 1:
                log.warning("%s: dropped a half-written last line", path)
                break
            raise
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or \
                not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in rec.values()):
            raise ValueError(f"{path}:{i + 1} is not a metrics record (a JSON object of numbers with a step); the "
                             "file is damaged: delete it or pass a new --out")
        records.append(rec)
    return records


class Metrics:
    """metrics.jsonl, one JSON record per line, written by rank 0; on resume, records after the checkpoint's step
    are dropped so the file reads as one uninterrupted run."""

    def __init__(self, path: Path, resume_step: int, main: bool):
        self.path, self.main = path, main
        if not main:
            return
        if resume_step > 0 and path.exists():  # a fresh run starts without one (clear_run)
            keep = [json.dumps(r) for r in _records(path) if r["step"] <= resume_step]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(k + "\n" for k in keep))
            os.replace(tmp, path)

    def write(self, record: dict) -> None:
        if self.main:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        return _records(self.path) if self.path.exists() else []


# --- the loop ----------------------------------------------------------------------------------------------------
def flops_per_token(student, teacher, trained: set[str]) -> float:
    """Matmul FLOPs per training token: teacher forward 2N_t, student forward 2N_s, backward through the student's
    activations 2N_s, weight gradients 2N_trained (embedding lookups excluded; attention/recurrence FLOPs ignored)."""
    def matmul_params(m, only=None):
        return sum(p.numel() for n, p in m.named_parameters()
                   if "embed_tokens" not in n and (only is None or n in only))
    n_s = matmul_params(student)
    lm = student.lm_head.weight.numel() if student.lm_head.weight is student.model.embed_tokens.weight else 0
    return 2 * (matmul_params(teacher) + lm) + 4 * (n_s + lm) + 2 * matmul_params(student, trained)


@dataclass(frozen=True)
class Schedule:
    """How a token budget becomes optimizer steps on `world` processes."""
    steps: int
    tokens_per_step: int
    micro: int  # rows per forward pass per process
    accum: int  # forward passes per optimizer step per process
    eval_every: int
    warmup_steps: int


def schedule(args: TrainArgs, n_rows: int, seq: int, world: int) -> Schedule:
    if n_rows < 1:
        raise ValueError("distill: no training rows")
    if args.batch_size % world:
        raise ValueError(f"train batch_size={args.batch_size} must be a multiple of the {world} processes")
    per_rank = args.batch_size // world
    micro = min(args.micro_batch_size or per_rank, per_rank)
    if per_rank % micro:
        raise ValueError(f"train micro_batch_size={micro} must divide the per-process batch {per_rank}")
    tokens_per_step = args.batch_size * seq
    steps = max(1, math.ceil(args.tokens / tokens_per_step))
    return Schedule(steps, tokens_per_step, micro, per_rank // micro, args.eval_every or max(1, steps // 8),
                    math.ceil(args.warmup * steps))


def make_optimizer(params: list, args: TrainArgs, device: torch.device, world: int,
                   mixers: set[int] = frozenset()) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only; fused into one kernel per step on a single GPU. Each group carries its
    peak rate (`peak_lr`): --train.mixer_lr for the parameters whose ids are in `mixers` when it is set, else
    --train.lr."""
    split = args.mixer_lr is not None and args.mixer_lr != args.lr
    groups = []
    for lr, mine in ((args.lr, [p for p in params if not split or id(p) not in mixers]),
                     (args.mixer_lr, [p for p in params if split and id(p) in mixers])):
        if mine or not groups:  # the rest's two groups always exist (checkpoints from before the mixer rate)
            groups += [{"params": [p for p in mine if p.ndim >= 2], "weight_decay": args.weight_decay, "lr": lr,
                        "peak_lr": lr},
                       {"params": [p for p in mine if p.ndim < 2], "weight_decay": 0.0, "lr": lr, "peak_lr": lr}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=(device.type == "cuda" and world == 1) or None)


@dataclass
class Step:
    """What one optimizer step's forward and backward passes need (fixed for the run)."""
    model: torch.nn.Module  # the student as wrapped for DDP / FSDP2
    student: torch.nn.Module
    teacher: torch.nn.Module
    args: TrainArgs
    sched: Schedule
    device: torch.device
    fused: bool
    far: FarMass | None
    kernel: object

    def run(self, rows, mine: torch.Tensor, step: int) -> dict:
        """Forward and backward over this process's rows `mine` of `step`, in micro-batches (gradients accumulate;
        DDP syncs on the last); returns the loss parts averaged over the micro-batches."""
        a, micro, sums = self.args, self.sched.micro, {}
        hidden = a.hidden_weight > 0
        for j in range(self.sched.accum):
            windows = mine[j * micro:(j + 1) * micro]
            ids = repeat_spans(rows[windows], windows, a.repeat_spans, a.seed, step)
            ids = recall_rows(ids, windows, a.recall_rows, a.seed, step).to(self.device, non_blocking=True)
            watch = observing(self.teacher, self.far) if self.far else nullcontext()
            with torch.no_grad(), autocast(self.device), watch:
                t_out = (model_hidden(self.teacher, ids, hidden) if self.fused
                         else self.teacher(input_ids=ids, use_cache=False, output_hidden_states=hidden))
            weights = self.far.weights(a.far_weight) if self.far else None
            last = j == self.sched.accum - 1
            with nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync():
                with autocast(self.device):
                    s_out = (model_hidden(self.model, ids, hidden) if self.fused
                             else self.model(input_ids=ids, use_cache=False, output_hidden_states=hidden))
                heads = (output_head(self.student), output_head(self.teacher)) if self.fused else None
                loss, parts = kd_loss(s_out, t_out, ids, a, weights, heads, self.kernel)
                (loss / self.sched.accum).backward()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v / self.sched.accum
        return sums


@dataclass
class Models:
    """How a run drives its models (`prepare_models`)."""
    kernel: object  # the loss kernel
    fused: bool  # the fused loss: no tokens x vocabulary logits
    far: FarMass | None  # the teacher observed for the far-attention weights
    to_compile: list  # the models compiled and run with `impl`
    impl: str  # transformers' attention implementation during the run
    compiled: bool


def prepare_models(student, teacher, rows, args: TrainArgs, seq: int, device, ctx: Dist, desc: str,
                   swapped: list) -> Models:
    """Freeze the teacher, check the heads the fused loss assumes, swap in the run's attention (recorded in
    `swapped`, which the caller restores even when this raises) and compile."""
    teacher.requires_grad_(False).eval()
    compiled = args.compile if args.compile is not None else device.type == "cuda"
    kernel = loss_kernel(args.loss_kernel, device, compiled)
    fused = args.head == "fused"
    if fused:  # both heads are what the fused loss assumes (a short row, eager, before anything is wrapped)
        probe = rows[range(1)][:, :16].to(device)
        with autocast(device):
            check_head(student, probe, "student")
            check_head(teacher, probe, "teacher")
    layers = student.config.gdn_layers
    far = FarMass(gdn_heads(teacher.config, layers, {i: student.config.kept_groups(i) for i in layers})) \
        if args.far_weight else None
    # an observed teacher (far_weight) runs eagerly: its attention goes through the statistics pass
    to_compile = [student] + ([] if far else [teacher])
    impl = resolve_attention(args.attention, student.config, seq, device)
    if ctx.main:
        log.info("%s: attention %s for %d-token rows", desc, impl, seq)
    swapped.extend(swap_attention(to_compile, impl))
    if compiled:
        compile_layers(*to_compile)
    return Models(kernel, fused, far, to_compile, impl, compiled)


def start_step(out: Path, model, opt, identity: dict, start_over: str, resume: bool, ctx: Dist, desc: str,
               steps: int) -> int:
    """The step a run starts after: its newest checkpoint's (resumed into `model` and `opt`), else 0 with an earlier
    run's files cleared from `out`."""
    meta = resume_checkpoint(out, model, opt, identity, start_over) if resume else None
    start = 0
    if meta is not None:
        start = meta["step"]
        log.info("resuming %s from step %d of %d (%s)", desc, start, steps, out / CKPT_DIR)
        if ctx.main and start < steps:  # an earlier stop's report and model/ do not stand beside new checkpoints
            clear_result(out)  # (a finished run run again trains nothing: its result stays until rewritten)
    elif ctx.main:
        clear_run(out)
    if ctx.main:
        out.mkdir(parents=True, exist_ok=True)
    return start


def distill(student, teacher, rows: TokenWindows | torch.Tensor, heldout: torch.Tensor, args: TrainArgs,
            out: str | Path, *, resume: bool = True, eval_batch_size: int = 4, ctx: Dist | None = None,
            desc: str = "distill", on_step=None, deadline: float | None = None,
            teacher_spec: str | None = None, data: dict | None = None, start_over: str = START_OVER) -> dict:
    """Train `student` toward `teacher` for `args.tokens` tokens of `rows` (N windows of T tokens: token shards, or
    an (N, T) tensor); returns the run's report.

    `on_step(step, student)` runs (untimed) at step 0 and after every optimizer step on every process, with the
    unwrapped student (`recovery` scores NIAH there).
    Past `deadline` (time.monotonic()) the run checkpoints and returns early, its report marked "stopped_at": the
    same call later resumes it, so a long run fits in a series of time-limited jobs. `teacher_spec` and `data` (what
    the rows were made from) go into the checkpoints' run identity; `start_over` is how the calling command starts
    the run over, named when its checkpoints cannot be resumed (another run's, damaged).

    `student` holds fp32 master weights; on CUDA the forward runs under bf16 autocast, with the parameters that do not
    train held in bf16 meanwhile (`training.hold_frozen`; fp32 again on return). Evaluations at step 0,
    every `eval_every` steps and at the end go to metrics.jsonl with the tokens seen so far."""
    ctx = ctx or Dist()
    out = Path(out)
    device = next(student.parameters()).device
    n_rows, seq = rows.shape
    sched = schedule(args, n_rows, seq, ctx.world)
    steps, tokens_per_step = sched.steps, sched.tokens_per_step
    heldout = heldout[: heldout.shape[0] - heldout.shape[0] % ctx.world] if ctx.world > 1 else heldout

    trained = set(trainable_names(student, args.train))
    shards = getattr(rows, "meta", None)  # the token counts tell a corpus changed at the same path since
    rows_of = {"rows": {k: shards[k] for k in ("tokens", "documents")}} if shards else {}
    identity = run_identity(student, trained, teacher_spec, args, {**(data or {}), **rows_of, "seq_len": seq,
                                                                    "heldout_rows": int(heldout.shape[0])})
    for n, p in student.named_parameters():
        p.requires_grad_(n in trained)
    # FSDP2 casts every parameter to bf16 itself (its mixed-precision policy) and wants one dtype per unit
    held = hold_frozen(student, device) if ctx.world == 1 or args.parallel == "ddp" else []
    swapped = []  # (model, its own attention implementation) while the run uses another
    try:
        models = prepare_models(student, teacher, rows, args, seq, device, ctx, desc, swapped)
        model = wrap(student, ctx, args.parallel, device)
        params = [p for p in model.parameters() if p.requires_grad]
        mixer_names = set(trainable_names(student, "mixers")) if args.mixer_lr is not None else set()
        opt = make_optimizer(params, args, device, ctx.world,
                             {id(p) for n, p in student.named_parameters() if n in mixer_names})
        train_step = Step(model, student, teacher, args, sched, device, models.fused, models.far,
                          models.kernel)

        start = start_step(out, model, opt, identity, start_over, resume, ctx, desc, steps)
        metrics = Metrics(out / METRICS, start, ctx.main)
        extra = {"steps": steps, "tokens_per_step": tokens_per_step, "identity": identity}

        seconds = {"eval_s": 0.0, "first_step_s": None}  # where the wall time goes besides the timed steps

        def evaluate(step):
            t = time.perf_counter()
            res = heldout_eval(model, teacher, heldout, eval_batch_size, ctx, device, args.kl_chunk, models.kernel)
            seconds["eval_s"] += time.perf_counter() - t
            rec = {"step": step, "tokens": step * tokens_per_step, **res}
            if not math.isfinite(rec["heldout_loss"]):
                raise RuntimeError(f"{desc}: the held-out loss is {rec['heldout_loss']} at step {step}: the student's "
                                   "outputs are not finite; lower --train.lr (checkpoints before this step are kept)")
            metrics.write(rec)
            return rec

        def after_step(step):  # the caller's hook (recovery's NIAH: generate) sees the student's own attention,
            restore_attention(swapped)  # and runs eagerly: generate's shapes and that attention would recompile layers
            with torch.compiler.set_stance("force_eager"):
                on_step(step, student)
            swap_attention(models.to_compile, models.impl)

        if start == 0:
            start_kl = evaluate(0)["heldout_kl"]
            if on_step is not None:
                after_step(0)
        else:
            start_kl = next((r["heldout_kl"] for r in (metrics.read() if ctx.main else []) if r["step"] == 0
                             and "heldout_kl" in r), None)
        model.train()
        bar = tqdm(range(start + 1, steps + 1), desc=desc, disable=not ctx.main, unit="step", leave=False)
        clock = Clock(device)
        stop = False
        t_first = time.perf_counter()
        for step in bar:
            factor = warmup_cosine(step, steps, sched.warmup_steps)
            for g in opt.param_groups:
                g["lr"] = g.get("peak_lr", args.lr) * factor
            mine = step_windows(n_rows, args.batch_size, step, args.seed, ctx.rank, ctx.world)  # (per_rank,)
            sums = train_step.run(rows, mine, step)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == start + 1:  # the first step after a (re)start pays compilation and warm-up: not timed
                clock.start()
                seconds["first_step_s"] = clock.t0 - t_first
            if step % args.log_every == 0 or step == steps:
                keys = sorted(sums)
                last = {k: v / ctx.world for k, v in zip(keys, all_sum([float(sums[k]) for k in keys], ctx, device))}
                rec = {"step": step, "tokens": step * tokens_per_step, "lr": args.lr * factor,
                       "grad_norm": float(grad_norm), **last}
                tps = clock.rate((step - start - 1) * tokens_per_step)
                if tps:
                    rec["tokens_per_s"] = tps
                metrics.write(rec)
                bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{tps or 0:,.0f}")
                if not math.isfinite(last["loss"]):
                    raise RuntimeError(f"{desc}: the loss is {last['loss']} at step {step}; lower --train.lr "
                                       "(checkpoints before this step are kept)")
            if step % sched.eval_every == 0 or step == steps:
                with clock.paused():
                    kl = evaluate(step)["heldout_kl"]
                if ctx.main and start_kl is not None and kl > start_kl:  # moving away from the teacher: lr too high
                    log.warning("%s: held-out KL to the teacher %.4f at step %d, above the %.4f the student started "
                                "from: --train.lr %g may be too high for this model; lower it if this persists", desc,
                                kl, step, start_kl, args.lr)
            if on_step is not None:
                with clock.paused():
                    after_step(step)
            late = deadline is not None and time.monotonic() > deadline
            stop = deadline is not None and step < steps and (  # every process stops at the same step
                late if ctx.world == 1 else all_sum([late], ctx, device)[0])
            if step % args.save_every == 0 or step == steps or stop:
                with clock.paused():
                    save_checkpoint(out, step, model, opt, ctx, extra)
            if stop:
                log.info("%s: past the deadline at step %d of %d: checkpointed; run again to continue", desc, step,
                         steps)
                break

        if models.compiled:
            uncompile_layers(*models.to_compile)
    finally:  # a run that raises hands its student back in fp32 (and its own attention) too
        release_frozen(held)
        restore_attention(swapped)
    done = step if stop else steps
    report = run_report(student, teacher, trained, args, sched, seq, ctx, device, metrics, start,
                        clock.rate((done - start - 1) * tokens_per_step))
    report.update(seconds)
    if stop:
        report["stopped_at"] = step
    return report


def run_report(student, teacher, trained: set[str], args: TrainArgs, sched: Schedule, seq: int, ctx: Dist, device,
               metrics: Metrics, start: int, tps: float | None) -> dict:
    """The run's figures: its schedule, the held-out curve, throughput and MFU."""
    evals = [r for r in (metrics.read() if ctx.main else []) if "heldout_loss" in r]
    fpt = flops_per_token(student, teacher, trained)
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items()
                                     if device.type == "cuda" and k in torch.cuda.get_device_name(device)), None)
    return {
        "steps": sched.steps, "tokens": sched.steps * sched.tokens_per_step, "tokens_per_step": sched.tokens_per_step,
        "seq_len": seq, "processes": ctx.world, "parallel": args.parallel if ctx.world > 1 else None,
        "trained": args.train, "trained_params": sum(p.numel() for n, p in student.named_parameters() if n in trained),
        "eval_tokens": [r["tokens"] for r in evals], "heldout_loss": [r["heldout_loss"] for r in evals],
        "heldout_kl": [r["heldout_kl"] for r in evals], "tokens_per_s": tps,
        "flops_per_token": fpt, "mfu": tps * fpt / (peak * 1e12) / ctx.world if tps and peak else None,
        "resumed_from": start or None,
    }


@writes_out("distill")
def run_distill(args: DistillArgs) -> dict:
    """Distil a converted hybrid toward its teacher; resumable, torchrun-ready; writes report.json and model/."""
    t0 = time.perf_counter()
    check_fresh_out(Path(args.out).expanduser(), args.resume, args.overwrite)
    device = resolve_device(args.device)
    ctx, device = init_distributed(device)
    dtype = resolve_dtype(args.dtype, device)
    backend = training_backend(resolve_backend(args.backend), args.backend, True)
    profile = apply_profile(args, device.type)
    apply_train_profile(args.train, profile)
    step = args.train.batch_size * args.data.seq_len if args.train.batch_size and args.data.seq_len else 0
    if args.train.tokens is not None and step > args.train.tokens:  # one step of such rows could not fit in memory
        raise ValueError(f"--train.tokens {args.train.tokens} is less than one optimizer step (--train.batch_size "
                         f"{args.train.batch_size} x --data.seq_len {args.data.seq_len} = {step} tokens); raise "
                         "--train.tokens or lower the batch")
    student, tokenizer = load_model(args.student, device, torch.float32)  # fp32 master weights
    if not hasattr(student, "set_backend"):
        raise ValueError(f"{args.student} is not a converted hybrid (no GDN layers); run `convert` first")
    student.set_backend(backend)
    teacher_spec = check_teacher_origin(args.student, student.config.teacher_name, args.teacher)
    check_out(args.out, "distill", overwrite=args.overwrite, inputs={"student's teacher": teacher_spec})
    check_token_cache(args.data.token_cache, {"student's teacher": teacher_spec})
    if tokenizer is None:
        raise FileNotFoundError(f"{args.student} has no tokenizer files; save one beside the model")
    check_context(args.data.seq_len, student.config, args.data.beyond_context, "student")
    loaded = load_teacher(teacher_spec, device, dtype)
    check_same_vocab(teacher_spec, loaded.model, loaded.tokenizer, student, tokenizer,
                     student.config.teacher_name or "see its report.json", who="student")
    check_same_layers(teacher_spec, loaded.model.config, student.config, args.train.hidden_weight)
    teacher = loaded.model
    out = Path(args.out)
    train_rows, heldout = distill_data(args.data, tokenizer, args.train.tokens, main=ctx.main,
                                       barrier=dist.barrier if ctx.world > 1 else None)
    data = {k: getattr(args.data, k) for k in ("source", "text_field", "split", "heldout_fraction")}
    data["dtype"] = str(dtype).removeprefix("torch.")  # the compute dtype: a resume in another changes the weights
    report = distill(student, teacher, train_rows, heldout, args.train, args.out, resume=args.resume,
                     eval_batch_size=args.eval_batch_size, ctx=ctx, teacher_spec=teacher_spec, data=data)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    full = get_model_state_dict(student, options=_state_options(cpu_offload=ctx.world > 1))
    if ctx.main:
        check_finite(full, "the distilled model")
        with staged_dir(out / "model") as tmp:  # complete or not at all; report.json, written last, marks it so
            student.save_pretrained(tmp, state_dict=full, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        report.update(student=args.student, teacher=teacher_spec, train_rows=len(train_rows),
                      tokens_dir=str(train_rows.root),
                      profile=profile, backend=backend, device=str(device), wall_s=time.perf_counter() - t0)
        report = record(out / REPORT, report, args)
        first, final = report["heldout_loss"][0], report["heldout_loss"][-1]
        print(f"\ndistilled {args.student} toward {teacher_spec}: {report['tokens']:,} tokens in {report['steps']} "
              f"steps on {ctx.world} process(es)")
        print(f"  held-out loss {first:.4f} -> {final:.4f} (ppl {math.exp(first):,.2f} -> {math.exp(final):,.2f})")
        tps = report["tokens_per_s"]
        print(f"  throughput {tps:,.0f} tokens/s" + (f", MFU {report['mfu']:.1%}" if report["mfu"] else "")
              if tps else "  throughput: too few steps to time")
        print(f"  output {out / 'model'}, {out / REPORT}, {out / METRICS}")
    if ctx.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return report
