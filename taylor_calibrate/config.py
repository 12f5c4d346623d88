"""The CLI's argument dataclasses (the mixers' options live with each mixer, the hybrid's HF config with the model).

Everything a user can set is a field of a dataclass here; the CLI (jsonargparse) and YAML files both fill
them, and the field docstrings become `--help`.
"""
from __future__ import annotations

import copy
import logging
import math
import dataclasses
from dataclasses import dataclass, field, fields, is_dataclass
from typing import ClassVar
import os
import shlex
from pathlib import Path

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser

from taylor_calibrate.model.mixers.gdn.config import GDNConfig
from taylor_calibrate.ops import LOSS_BACKENDS

log = logging.getLogger("taylor_calibrate")

NIAH_TASKS = ("single", "multikey", "passkey")
"""Needle-in-a-haystack tasks (retrieval.py builds them)."""
NIAH_LENGTHS = (1024, 2048, 4096, 8192)
NIAH_NEW_TOKENS = 64
"""Tokens generated per NIAH prompt. RULER allows up to 128 for these tasks; a model that restates the question
before it answers needs more than a handful (docs/decisions.md, "NIAH reply budget")."""

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")

SCHEDULES = ("wsd", "constant")


@dataclass
class CalibArgs:
    """Phase 1 options. `taylor` drops the attention sink's mass from d_h and c_h and normalises c_h absolutely; `paper`
    keeps the reference's choices (sink counted, c_h min-max over the layer's heads)."""
    RANGES: ClassVar[dict[str, str]] = {  # each numeric option's valid values (`check_options`)
        "gate_alpha": "[0, inf)", "sigma_rows": "[1, inf)", "fit_rows": "[1, inf)", "beta_min": "(0, 1)",
        "beta_span": "[0, 1)"}

    decay: bool = True
    """Set the decay from the mean attention distance d_h (half-life d_h tokens)."""
    write_gate: bool = True
    """Set the write gate from the attention concentration c_h: beta*_h = beta_min + beta_span * c_h."""
    value_scale: bool = True
    """Least-squares per-head amplitude sigma_h of the student head output against the teacher's."""
    output_gate: bool = True
    """Initialise the output gate (paper: alpha * v_proj; taylor: perturbation around the head amplitude, which it
    carries; off: g_proj keeps its library init and the amplitude goes into o_proj)."""
    local_profile: bool = True
    """With short convs (--gdn.short_conv identity|random): taylor sets each head's v conv kernel to the teacher's
    mean attention over the conv's K nearest offsets, p_{t,t-j} for j < K (renormalised), and the q / k convs to
    identity: the local part of the attention pattern at step 0, which the RoPE-free recurrence cannot express."""
    v_prescale: bool = True
    """With SiLU on v and the per-head output norm (Qwen3.5's layer, `--target qwen3_5`): taylor scales each head's
    v_proj rows so that SiLU works where it is nearly linear and the layer computes what it would with linear v; the
    norm makes the scale of v otherwise invisible (docs/method.md, "taylor", "v pre-scale")."""
    beta_min: float = 0.3
    beta_span: float = 0.4
    gate_alpha: float = 0.01
    """Relative size of the output gate's perturbation (reference: 0.01)."""
    sigma_rows: int = 4
    """Calibration rows used to fit sigma_h (a student forward per converted layer)."""
    fit_rows: int = 16
    """Calibration rows phase 1 reads at most (the write gate's and output gate's input direction)."""

    def __post_init__(self):
        if self.gate_alpha < 0:  # a negative one flips the gate's input: another model, not a smaller perturbation
            raise ValueError(f"--calib.gate_alpha={self.gate_alpha} must be >= 0 (the perturbation's relative size)")
        if self.sigma_rows < 1 or self.fit_rows < 1:
            raise ValueError(f"--calib.sigma_rows={self.sigma_rows} and --calib.fit_rows={self.fit_rows} must be >= 1")
        if not (0 < self.beta_min and self.beta_min + self.beta_span < 1 and self.beta_span >= 0):
            raise ValueError(f"--calib.beta_min={self.beta_min} and --calib.beta_span={self.beta_span} must give "
                             "0 < beta_min, 0 <= beta_span and beta_min + beta_span < 1")


@dataclass
class AlignArgs:
    """Phase 2 (docs/method.md, "Phase 2: alignment"): per-layer alignment of each GDN mixer to the teacher's attention
    output."""
    RANGES: ClassVar[dict[str, str]] = {  # each numeric option's valid values (`check_options`)
        "steps": "[0, inf)", "batch_size": "[1, inf)", "seq_len": "[2, inf)", "lr": "[0, inf)", "lr_qkv": "[0, inf)",
        "lr_o": "[0, inf)", "lr_dynamics": "[0, inf)", "lr_scale": "(0, inf)", "weight_decay": "[0, inf)",
        "decay_fraction": "[0, 1]", "sink_weight": "[0, inf)", "far_weight": "[0, inf)", "layer_group": "[1, inf)",
        "log_every": "[1, inf)"}

    steps: int | None = None
    """Optimizer steps per layer (None: from --profile). More steps lower the perplexity further but shrink phase 1's
    lead over a copy-only start (docs/decisions.md, "phase 2 budget")."""
    batch_size: int | None = None
    """Sequences per step (None: from --profile), cycled deterministically through the stored rows
    (a seeded permutation per epoch)."""
    seq_len: int | None = None
    """Crop training rows to their first seq_len tokens (cheaper steps on CPU); None = full rows (the quick
    profile crops to 256). Evaluation always uses full rows."""
    lr: float = 6e-3
    """Learning rate of the new parameters other than the decay and write gate (those take `lr_dynamics`): g_proj,
    short convs, and o_norm when it trains (the reference: 1e-3 for all new parameters). The learning rates keep the
    ratios tuned one at a time, scaled together for the wsd schedule (docs/decisions.md, "phase 2 learning rates",
    "phase 2 schedule and scale")."""
    lr_qkv: float | None = None
    """Learning rate of the copied projections q_proj, k_proj, v_proj (the reference: 1e-4). None: from --profile:
    the best rate depends on the step budget (phase 1 gets the scales right; alignment has to turn the copied
    directions; docs/decisions.md, "copied projections' learning rate")."""
    lr_o: float = 3e-3
    """Learning rate of o_proj (when it trains)."""
    lr_dynamics: float | None = 3e-2
    """Learning rate of the decay and write-gate parameters (A_log, dt_bias, a_proj, b_proj), which phase 1 sets
    from the teacher's attention statistics: None = `lr`; 0 = frozen, so alignment keeps phase 1's dynamics."""
    lr_scale: float | None = None
    """Factor on every learning rate above. None: from the teacher, the RMS of its attention projections against
    that of the teacher the rates were tuned on (`align.teacher_lr_scale`): AdamW steps each weight by about its
    rate whatever the weight's size, so a teacher with smaller weights needs smaller rates."""
    weight_decay: float = 0.01
    """AdamW weight decay, on every trained parameter (as the reference)."""
    grad_clip: float = 1.0
    """Max gradient norm, per layer (<= 0: no clipping)."""
    train_o_proj: bool = True
    """Also train o_proj (the reference freezes it; docs/decisions.md, "o_proj in phase 2")."""
    train_o_norm: bool = False
    """Also train o_norm's weight (the reference freezes it)."""
    schedule: str = "wsd"
    """Learning rate over the steps: "wsd" (constant, then straight to 0 over the last `decay_fraction` of the steps;
    docs/decisions.md, "phase 2 schedule and scale") or "constant" (the reference)."""
    decay_fraction: float = 0.2
    """The "wsd" schedule's decay: the last this fraction of the steps."""
    sink_weight: float = 64.0
    """Weight of each row's first position in the loss, in positions (1 = a plain mean over positions). The first
    token is where later layers' heads park their attention (the sink): an error there moves every later token
    (docs/decisions.md, "first position in the loss")."""
    far_weight: float = 16.0
    """Weight each position's loss by 1 + far_weight x the teacher's attention mass there on keys 16 or more tokens
    back (sink excluded), averaged over the heads that become GDN, rescaled to mean 1 (`stats.far_weights`): the fit
    leans toward where the teacher reaches far back, which is what retrieval needs. 0: off (docs/decisions.md,
    "far-reaching positions in the loss")."""
    layer_group: int | None = None
    """Layers trained together in one stacked forward/backward (None: all; fewer bounds activation memory). The
    result does not depend on it."""
    kept_attention: bool = False
    """Then re-align the kept softmax attention (whole attention layers and the kept heads of head-wise ones) to the
    inputs the hybrid gives it: trained so that from the hybrid's inputs it reproduces what it computed from the
    teacher's. Off by default: it lowers perplexity but costs retrieval at long context (docs/decisions.md, "kept
    attention on hybrid inputs")."""
    seed: int = 0
    """Seed of the row order."""
    log_every: int = 50
    """Evaluate (and keep the best state) every this many steps, and at the end."""

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--phase2.schedule={self.schedule!r} is not one of {SCHEDULES}")
        for name in ("batch_size", "log_every", "layer_group"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--phase2.{name}={getattr(self, name)} must be >= 1")
        if self.steps is not None and self.steps < 0:
            raise ValueError(f"--phase2.steps={self.steps} must be >= 0")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"--phase2.seq_len={self.seq_len} must be >= 1 or None")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"--phase2.decay_fraction={self.decay_fraction} must be in (0, 1]")
        if self.sink_weight < 0:
            raise ValueError(f"--phase2.sink_weight={self.sink_weight} must be >= 0")
        if self.far_weight < 0:
            raise ValueError(f"--phase2.far_weight={self.far_weight} must be >= 0 (0 turns it off)")
        if self.lr_qkv is not None and self.lr_qkv < 0:
            raise ValueError(f"--phase2.lr_qkv={self.lr_qkv} must be >= 0 or None (from --profile)")
        if self.lr_dynamics is not None and self.lr_dynamics < 0:
            raise ValueError(f"--phase2.lr_dynamics={self.lr_dynamics} must be >= 0 or None")
        if self.lr_scale is not None and not self.lr_scale > 0:
            raise ValueError(f"--phase2.lr_scale={self.lr_scale} must be > 0, or None (from the teacher)")


@dataclass
class CorpusSpec:
    """Where the text comes from and how much of it is held out."""
    RANGES: ClassVar[dict[str, str]] = {  # each numeric option's valid values (`check_options`)
        "heldout_fraction": "(0, 1)"}

    source: str = "builtin"
    """"builtin" (Python stdlib source), "pysrc" (the stdlib and the source files every installed package ships:
    hundreds of MB of code, for long distillation runs offline), a directory of token shards (`taylor-calibrate
    tokenize`), a text file, a directory of text files, a .jsonl file,
    a directory written by `datasets.Dataset.save_to_disk`, or "hf:<name>[:<config>]" (needs network)."""
    text_field: str = "text"
    """Field holding the text in .jsonl records and `datasets` rows."""
    split: str = "train"
    """Split of a saved DatasetDict; the default "train" falls back to the first split if absent."""
    heldout_fraction: float = 0.5
    """Expected fraction of documents held out for perplexity, in (0, 1)."""
    token_cache: str | None = None
    """Directory of the token cache that `distill`, `recovery` and `tokenize` share: a corpus is tokenised once per
    tokenizer and reused until it changes (None: $TAYLOR_CALIBRATE_TOKEN_CACHE, else $XDG_CACHE_HOME/taylor_calibrate/
    tokens, else ~/.cache/taylor_calibrate/tokens). Safe to delete when no run is reading it."""

    def __post_init__(self):
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"--data.heldout_fraction={self.heldout_fraction} must be in (0, 1)")
        if not str(self.source).strip():  # an empty path would read the current directory as the corpus
            raise ValueError("--data.source is empty; name a corpus (builtin, pysrc, a file, a directory, a dataset)")


@dataclass
class DataArgs(CorpusSpec):
    """Which text to calibrate on and which to evaluate on (never overlapping documents)."""
    RANGES: ClassVar[dict[str, str]] = {  # each numeric option's valid values (`check_options`)
        "seq_len": "[2, inf)", "calib_seqs": "[1, inf)", "eval_seqs": "[1, inf)"}

    seq_len: int | None = None
    """Tokens per sequence, for calibration and evaluation (None: from --profile)."""
    calib_seqs: int | None = None
    """Number of calibration sequences (None: from --profile). Phase 2 cycles through them and overfits a small set
    (docs/decisions.md, "calibration rows")."""
    eval_seqs: int | None = None
    """Number of held-out sequences for perplexity (None: from --profile)."""
    beyond_context: bool = False
    """Allow seq_len beyond the model's max_position_embeddings (positions it was never trained on)."""

    def __post_init__(self):
        super().__post_init__()
        for name in ("seq_len", "calib_seqs", "eval_seqs"):
            least = 2 if name == "seq_len" else 1  # a row predicts its tokens from the ones before
            if getattr(self, name) is not None and getattr(self, name) < least:
                raise ValueError(f"--data.{name}={getattr(self, name)} is out of range (must be >= {least})")


INITS = ("copy", "zero_gate", "paper", "taylor")
TARGETS = ("hybrid", "qwen3_5")

PROFILE_DIR = Path(__file__).parent / "profiles"
PROFILES = ("full", "quick")
"""Sizes that `--profile` fills in where an option is left unset (None): profiles/<name>.yaml, a dump of the arguments
it sets. "full" is the GPU setting, "quick" the CPU one; "auto" picks full on CUDA, else quick."""


def check_profile(profile: str) -> None:
    if profile not in ("auto", *PROFILES):
        raise ValueError(f"profile={profile!r} is not one of {('auto', *PROFILES)}")


def load_profile(name: str) -> dict:
    """The arguments profile `name` sets: {"data": {...}, "phase2": {...}, "train": {...}}."""
    check_profile(name)
    return yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())


def _fill(args, values: dict) -> None:
    for key, value in values.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


@dataclass
class NiahArgs:
    """Needle-in-a-haystack options of the commands that score retrieval by generation (eval, recovery, tradeoff);
    their flags stay flat (--niah_tasks, ...)."""
    RANGES: ClassVar[dict[str, str]] = {  # each numeric option's valid values (`check_options`)
        "niah_samples": "[1, inf)", "niah_new_tokens": "[1, inf)"}

    niah_tasks: list[str] = field(default_factory=lambda: list(NIAH_TASKS))
    """NIAH tasks: "single" (one magic-number needle in prose), "multikey" (four, one asked), "passkey"."""
    niah_lengths: list[int] = field(default_factory=lambda: list(NIAH_LENGTHS))
    """NIAH context lengths in tokens of the model's tokenizer (prompt + generated tokens); lengths beyond the
    model's max_position_embeddings are skipped (null in the results)."""
    niah_samples: int = 20
    """NIAH prompts per task and length, needle depths spread evenly from start to end."""
    niah_seed: int = 0
    """Seed of the NIAH needles (keys, numbers); same seed, same prompts."""
    niah_new_tokens: int = NIAH_NEW_TOKENS
    """Tokens generated per prompt (greedy); a reply is right when the answer appears in them. RULER allows up to 128
    for these tasks: a model that restates the question before answering needs room to get to the answer."""

    def check_niah(self) -> None:
        bad = [t for t in self.niah_tasks if t not in NIAH_TASKS]
        if bad:
            raise ValueError(f"niah_tasks {bad} unknown; choose from {list(NIAH_TASKS)}")
        if any(n < 64 for n in self.niah_lengths) or self.niah_samples < 1 or self.niah_new_tokens < 1:
            raise ValueError(f"niah_lengths {self.niah_lengths} must all be >= 64 tokens, niah_samples "
                             f"({self.niah_samples}) and niah_new_tokens ({self.niah_new_tokens}) >= 1")


def check_not_empty(args, *names: str) -> None:
    """An experiment given an empty list of what to run (`--policies '[]'`) would load the teacher and then fail
    deep inside, or write a results file with no rows: refused at parse, naming the option."""
    for name in names:
        if not getattr(args, name):
            raise ValueError(nothing_to_run(f"--{name}", [f.default_factory() for f in fields(args)
                                                          if f.name == name][0]))


def nothing_to_run(flag: str, default) -> str:
    return f"{flag} is empty, so there is nothing to run; pass at least one (the default is {default})"


def check_batch(eval_batch_size: int) -> None:
    if eval_batch_size < 1:
        raise ValueError(f"--eval_batch_size {eval_batch_size} must be >= 1")


@dataclass
class PipelineArgs:
    """What every stage that builds hybrids shares: the teacher, the GDN layer, phase 1 and 2, data, hardware."""
    RANGES: ClassVar[dict[str, str]] = {  # each numeric option's valid values (`check_options`)
        "keep_every": "[1, inf)", "kv_budget": "(0, 1)", "context": "[2, inf)", "probe_samples": "[1, inf)",
        "policy_weight": "[0, 1]", "eval_batch_size": "[1, inf)"}

    teacher: str = "smollm2-135m"
    """HF checkpoint directory, hub id, .gguf file, or "smollm2-135m" (the embedded default teacher)."""
    keep_every: int = 4
    """Keep one attention layer in this many (all policies keep ceil(n / keep_every) layers, or KV groups for
    `heads`), whatever they cost in bytes; --kv_budget budgets bytes instead."""
    kv_budget: float | None = None
    """Fraction of the teacher's KV cache bytes per sequence at --context that the hybrid may cache, in (0, 1): the
    policy keeps the layers (or KV groups, `heads`) it ranks first while the kept attention (a sliding-window layer
    counts its window) plus the fixed GDN state of every converted part fits (taylor_calibrate/memory.py). None: one
    in --keep_every."""
    context: int | None = None
    """Context length (tokens) at which cache bytes are counted: --kv_budget's budget and the teacher / hybrid cache
    figures convert prints and records. None: the teacher's max_position_embeddings, at most 32768."""
    probe_samples: int = 8
    """Retrieval probes per task (single, multikey, passkey) and length: the `retrieval` / `heads` policies score the
    teacher's heads on calibration probes at --data.seq_len and 4x that many tokens (capped by the teacher's
    context); convert reports the teacher-forced answer log-probability of teacher and hybrid on evaluation probes
    at --data.seq_len (other needles, other haystack)."""
    policy_weight: float = 0.5
    """Policy `combined` (convert, and recovery / tradeoff through convert): the retrieval score's share in [0, 1]
    (0: the `kl` policy's layers, 1: the `retrieval` policy's)."""
    profile: str = "auto"
    """Sizes for unset data/alignment options: "full" (GPU), "quick" (CPU), "auto" (full on CUDA, else quick)."""
    gdn: GDNConfig = field(default_factory=GDNConfig)
    calib: CalibArgs = field(default_factory=CalibArgs)
    phase2: AlignArgs = field(default_factory=AlignArgs)
    data: DataArgs = field(default_factory=DataArgs)
    backend: str = "auto"
    """GDN kernels: "auto" (fla when CUDA and fla are present, else torch), "torch", or "fla"."""
    device: str = "auto"
    """"auto" (cuda if available), "cpu", or "cuda"."""
    dtype: str = "auto"
    """Compute dtype: "auto" (bf16 on cuda, fp32 on cpu), "float32", "bfloat16"."""
    eval_batch_size: int = 4
    """Sequences per forward pass during evaluation."""
    seed: int = 0
    """Seed of the random parts of the initialisation."""
    overwrite: bool = False
    """`convert`: replace an earlier convert output in --out (one holding nothing convert did not write; any other
    non-empty directory is refused whatever this says). The experiments: write among the files of a non-empty --out
    that is not an earlier output of theirs (another command's output or a file of a name they write is refused)."""

    def __post_init__(self):
        check_profile(self.profile)
        if self.kv_budget is not None and not 0 < self.kv_budget < 1:
            raise ValueError(f"kv_budget={self.kv_budget} must be a fraction of the teacher's KV cache in (0, 1)")
        if self.kv_budget is None and self.keep_every < 2:
            why = ("keeps every layer as softmax attention, so nothing would be converted" if self.keep_every == 1
                   else "is no count of layers (one attention layer kept in every N)")
            raise ValueError(f"keep_every={self.keep_every} {why}: use --keep_every 2 or more, or --kv_budget F")
        if self.context is not None and self.context < 1:
            raise ValueError(f"context={self.context} must be >= 1 (tokens at which the KV cache is counted)")
        if self.probe_samples < 1:
            raise ValueError(f"probe_samples={self.probe_samples} must be >= 1")
        if not 0 <= self.policy_weight <= 1:
            raise ValueError(f"policy_weight={self.policy_weight} must be in [0, 1]: the retrieval score's share in "
                             "--policy combined (0: kl alone, 1: retrieval alone)")
        check_batch(self.eval_batch_size)


@dataclass
class ConvertArgs(PipelineArgs):
    """`taylor-calibrate convert`: teacher -> hybrid."""

    out: str = "out/hybrid"
    """Output directory (model, tokenizer, report.json)."""
    init: str = "taylor"
    """Phase 1 (docs/method.md, "Phase 1: calibration"): "taylor" (ours), "paper" (the reference code), "copy" (weight
    copy, library-default dynamics), "zero_gate" (copy with g_proj = 0)."""
    align: bool = True
    """Phase 2 (docs/method.md, "Phase 2: alignment"): teacher-forced per-layer alignment after phase 1."""
    policy: str = "auto"
    """Which layers stay softmax attention: "uniform", "bypass", "greedy", "kl" (the layers whose restoration to
    attention most lowers the all-GDN hybrid's KL to the teacher), "retrieval" (the layers whose heads the teacher
    retrieves with), "heads" (head-wise: the KV groups the teacher retrieves with, in any layer), "combined" (kl and
    retrieval mixed by --policy_weight), "layers=0,4,8", or "auto": "heads" (whole layers, --target qwen3_5:
    "retrieval"), the policies that keep the teacher's retrieval (docs/decisions.md, "which heads stay attention");
    "uniform" when the teacher's tokenizer or context cannot build the retrieval probes. Resolved once and logged.
    report.json keeps the scores (policy_scores) and the choice (kept_layers): --policy layers=<kept_layers> repeats
    a choice without scoring again."""
    target: str = "hybrid"
    """"hybrid": our own format (the teacher's modules, GDN options as given); "qwen3_5": a hybrid that exports
    exactly to Qwen3.5 (`export --format qwen3_5`, served by transformers / vLLM / SGLang / llama.cpp): GDN layers in
    the form it expresses (SiLU q/k/v, swish gate, no biases, the teacher's norm epsilon) and, for teachers without
    q/k norm (Llama, Qwen2, Mistral), kept attention layers given q/k RMSNorm and aligned like phase 2."""

    def __post_init__(self):
        super().__post_init__()
        if self.init not in INITS:
            raise ValueError(f"init={self.init!r} is not one of {INITS}")
        if self.target not in TARGETS:
            raise ValueError(f"target={self.target!r} is not one of {TARGETS}")
        if self.target == "qwen3_5" and self.policy == "heads":
            raise ValueError("--target qwen3_5 needs whole layers (a Qwen3.5 layer is attention or GDN): use a layer "
                             "policy (uniform, bypass, greedy, kl, retrieval, combined) instead of --policy heads")


def convert_args_of(args: PipelineArgs, **changes) -> ConvertArgs:
    """The `convert` options of one conversion inside another stage (recovery, tradeoff): that stage's shared
    PipelineArgs (copied, so the conversion's in-place profile filling stays its own) with `changes`."""
    shared = {f.name: copy.deepcopy(getattr(args, f.name)) for f in fields(PipelineArgs)}
    return ConvertArgs(**{**shared, **changes})


@dataclass
class AblateArgs(PipelineArgs):
    """`taylor-calibrate ablate`: zero-shot held-out perplexity for every init x policy."""

    out: str = "out/ablate"
    """Output directory for ablation.json and ablation.md."""
    inits: list[str] = field(default_factory=lambda: ["copy", "zero_gate", "paper", "paper+align", "align", "taylor",
                                                      "taylor+align"])
    """Rows: <copy|zero_gate|paper|taylor>[+align]; "align" = copy + alignment (phase-2-only)."""
    policies: list[str] = field(default_factory=lambda: ["uniform", "bypass", "greedy"])
    """Columns: layer policies (uniform, bypass, greedy, kl, layers=0,4,8)."""
    command: str | None = None
    """The command line to record in the results (for reproducibility)."""

    def __post_init__(self):
        super().__post_init__()
        check_not_empty(self, "inits", "policies")


@dataclass
class DamageArgs(PipelineArgs):
    """`taylor-calibrate damage`: the zero-shot cost of converting each layer (or each given set of layers)."""

    out: str = "out/damage"
    """Output directory for damage.json and damage.md."""
    init: str = "taylor+align"
    """How each converted layer's mixer starts: <copy|zero_gate|paper|taylor>[+align]; "align" = copy + alignment."""
    sets: list[str] = field(default_factory=list)
    """Sets of layers converted together, one row each ("5,17", "0-3"); empty: every layer alone (none when
    --windows is given)."""
    windows: list[str] = field(default_factory=list)
    """Rows of the teacher whose named layers see only their last W positions, "LAYERS:W" ("5:1024", "5,11:512"):
    how far back each layer's retrieval reaches."""
    command: str | None = None
    """The command line to record in the results (for reproducibility)."""


def fill_align(phase2: AlignArgs, profile: str) -> AlignArgs:
    """Fill phase 2's unset (None) options from a profile, in place."""
    _fill(phase2, load_profile(profile)["phase2"])
    return phase2


def apply_profile(args, device_type: str) -> str:
    """Resolve `args.profile` ("auto": full on CUDA, else quick; logged), record the name in args.profile, and fill
    the unset (None) data and phase-2 options from it; returns the name."""
    name = args.profile
    if name == "auto":
        name = "full" if device_type == "cuda" else "quick"
        log.info("profile auto -> %s (device %s)", name, device_type)
    args.profile = name
    prof = load_profile(name)
    _fill(args.data, prof["data"])
    if getattr(args, "phase2", None) is not None:
        _fill(args.phase2, prof["phase2"])
    return name


@dataclass
class EvalArgs(NiahArgs):
    """`taylor-calibrate eval`: perplexity of a hybrid (and optionally its teacher) on held-out text; optionally
    long-context retrieval (NIAH), agreement with the teacher and lm-eval tasks."""
    RANGES: ClassVar[dict[str, str]] = {  # each numeric option's valid values (`check_options`)
        "eval_batch_size": "[1, inf)", "lm_eval_limit": "[1, inf)"}

    model: str = "out/hybrid"
    """A hybrid output directory (or any causal LM checkpoint)."""
    teacher: str | None = None
    """Also evaluate this teacher in the same run (same text, same tokenizer)."""
    out: str | None = None
    """Where to write report.json (default: <model>/eval for a hybrid of ours, <run>/eval for a distill run's
    <run>/model; needed for any other model)."""
    profile: str = "auto"
    """Sizes for unset data options: "full", "quick", or "auto" (full on CUDA, else quick)."""
    data: DataArgs = field(default_factory=DataArgs)
    backend: str = "auto"
    """GDN kernels: "auto", "torch" or "fla"."""
    device: str = "auto"
    dtype: str = "auto"
    eval_batch_size: int = 4
    """Sequences per forward pass (perplexity, agreement, lm-eval) and prompts per generate call (NIAH)."""
    niah: bool = False
    """Score long-context retrieval (RULER-style needle-in-a-haystack, generated locally) on the model, and on the
    teacher when --teacher is given (--niah_* options)."""
    agreement: bool = False
    """Mean KL(teacher || model) and top-1 agreement on the held-out rows (needs --teacher)."""
    lm_eval_tasks: list[str] | None = None
    """lm-evaluation-harness tasks to run on the model in memory, e.g. [hellaswag] (needs the `eval` extra:
    pip install "taylor-calibrate[eval]"; built-in tasks download their data, so offline use a local task file)."""
    lm_eval_include: str | None = None
    """Directory of extra lm-eval task YAML files (searched before lm-eval's built-in tasks). Trusted input only:
    lm-eval runs the Python functions that task files name (`!function`), so this runs code from DIR."""
    lm_eval_limit: int | None = None
    """Examples per lm-eval task (None: all)."""
    overwrite: bool = False
    """Write into a non-empty --out that is not an earlier `eval` output (a report.json or niah_answers.jsonl there is
    refused)."""

    def __post_init__(self):
        check_profile(self.profile)
        check_batch(self.eval_batch_size)
        if self.agreement and not self.teacher:
            raise ValueError("--agreement compares the model with its teacher: pass --teacher too")
        self.check_niah()
        if self.lm_eval_include is not None and not Path(self.lm_eval_include).is_dir():
            raise FileNotFoundError(f"lm_eval_include={self.lm_eval_include!r} is not a directory of task YAML files")
        if self.lm_eval_limit is not None and self.lm_eval_limit < 1:
            raise ValueError(f"lm_eval_limit={self.lm_eval_limit} must be >= 1 or None")


PARALLEL = ("ddp", "fsdp")
ATTENTIONS = ("auto", "sdpa", "flex_attention")
TRAIN_MODES = ("mixers", "gdn", "all")
LOSS_HEADS = ("fused", "logits")


@dataclass
class TrainArgs:
    """Recovery distillation (docs/method.md, "Recovery distillation"): the student learns the teacher's next-token
    distribution."""
    RANGES: ClassVar[dict[str, str]] = {  # each numeric option's valid values (`check_options`)
        "tokens": "[1, inf)", "batch_size": "[1, inf)", "micro_batch_size": "[1, inf)", "lr": "(0, inf)",
        "mixer_lr": "[0, inf)", "warmup": "[0, 1)", "weight_decay": "[0, inf)", "kl_weight": "[0, inf)",
        "temperature": "[0.05, 20]", "kl_chunk": "[1, inf)", "repeat_spans": "[0, 1]", "recall_rows": "[0, 1]",
        "hidden_weight": "[0, inf)", "ce_weight": "[0, inf)", "far_weight": "[0, inf)", "eval_every": "[1, inf)",
        "save_every": "[1, inf)", "log_every": "[1, inf)", "peak_tflops": "(0, inf)"}

    tokens: int | None = None
    """Training-token budget (None: from --profile)."""
    batch_size: int | None = None
    """Rows per optimizer step, over all processes (None: from --profile). The loss curve
    does not depend on how many processes share it."""
    micro_batch_size: int | None = None
    """Rows per forward pass per process (None: batch_size / processes, i.e. no gradient accumulation)."""
    train: str = "mixers"
    """Which parameters train: "mixers" (every converted layer's token mixer; in a head-wise layer both its GDN heads
    and its kept attention heads), "gdn" (the GDN heads only: kept attention stays the teacher's) or "all"."""
    lr: float = 1e-3
    """Peak learning rate (AdamW), after a linear warmup, then cosine to 10%. The default was chosen for the converted
    mixers (docs/decisions.md, "End-to-end phase"); training every parameter (`all`) wants a lower one."""
    mixer_lr: float | None = None
    """With --train.train all: the converted layers' mixers' peak learning rate, beside --train.lr for every other
    parameter (a new mixer has more to learn than the teacher's own weights; None: --train.lr for all)."""
    warmup: float = 0.05
    """Warmup length as a fraction of the steps."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Max global gradient norm (<= 0: none)."""
    kl_weight: float = 1.0
    """Weight of the forward KL(teacher || student) on the logits, per token."""
    temperature: float = 1.0
    """Softmax temperature of the KL term (scaled back by T^2)."""
    head: str = "fused"
    """How the loss reaches the vocabulary: "fused" (each model runs to its final hidden states; both lm heads, the
    KL and the cross-entropy are computed one chunk of tokens at a time, forward and backward, so no tokens x
    vocabulary logits exist) or "logits" (the models' full logits, then the KL over chunks of them; the path before
    the fused one, kept for benchmarks/distill_throughput.py's comparison). Both give the same loss."""
    kl_chunk: int = 4096
    """Tokens per chunk of the loss's logits: one chunk's fp32 softmaxes (and, fused, both heads' logits) exist at a
    time."""
    loss_kernel: str = "auto"
    """The kernel that reduces each chunk of logits to the loss and its gradient: "triton" (ops/kd_triton.py, two
    passes over the logits, CUDA), "torch" (ops/kd_torch.py, compiled under `compile`), "auto" (triton on a GPU when
    triton imports). The same loss either way."""
    attention: str = "auto"
    """transformers' attention implementation while training: "sdpa", "flex_attention", or "auto" (flex_attention on
    CUDA when a sliding window is shorter than the rows: it skips the blocks outside the window that sdpa computes
    under a dense mask; else sdpa). The same attention either way; the run's held-out evaluations use it too, and the
    trained model is handed back and saved with its own implementation."""
    repeat_spans: float = 0.0
    """Fraction of training rows given a repeated span: a piece of the row's own text copied again later in the row,
    which the teacher predicts by attending back over the gap; trains the retrieval a hybrid keeps (docs/method.md,
    "End-to-end phase"). 0: the corpus windows as they are."""
    recall_rows: float = 0.0
    """Fraction of training rows given multi-key recall needles: look-alike "frame key value" spans of the row's own
    text, one asked again at the end (`data.recall_rows`); trains telling needles apart (docs/method.md,
    "End-to-end phase"). 0: none."""
    hidden_weight: float = 0.0
    """Weight of the hidden-state MSE (every layer's output, relative to the teacher's mean square)."""
    ce_weight: float = 0.0
    """Weight of the next-token cross-entropy on the training text."""
    far_weight: float = 0.0
    """Weight each position's KL by 1 + far_weight x the teacher's attention mass there on keys 16 or more tokens back
    (sink excluded), averaged over the heads the student converts, rescaled to mean 1 per batch: phase 2's
    --phase2.far_weight for the end-to-end phase. The teacher then runs uncompiled (its attention is observed).
    0: off."""
    eval_every: int | None = None
    """Evaluate on held-out text every this many steps (None: 8 evaluations over the run); also at step 0 and
    at the end."""
    save_every: int = 100
    """Write a checkpoint every this many steps (atomically; the run resumes from the last one)."""
    log_every: int = 10
    parallel: str = "ddp"
    """Under torchrun: "ddp" (replicated model) or "fsdp" (FSDP2 `fully_shard`, per decoder layer)."""
    compile: bool | None = None
    """torch.compile every decoder layer of student and teacher and the loss's kernel over a chunk of logits (fuses the
    norms, activations, rotary and the loss's passes over the logits; fla's kernels stay as they are), which raises throughput and lowers peak
    memory (docs/decisions.md, "distillation compile"). None: on with CUDA, off on a CPU. The first step pays the
    compilation."""
    peak_tflops: float | None = None
    """Peak dense bf16 TFLOP/s of one accelerator for the MFU estimate (None: known GPUs, e.g. H100/H200 989)."""
    seed: int = 0
    """Seed of the row order."""

    def __post_init__(self):
        if self.train not in TRAIN_MODES:
            raise ValueError(f"--train.train={self.train!r} is not one of {TRAIN_MODES}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"--train.parallel={self.parallel!r} is not one of {PARALLEL}")
        if self.head not in LOSS_HEADS:
            raise ValueError(f"--train.head={self.head!r} is not one of {LOSS_HEADS}")
        if self.loss_kernel not in LOSS_BACKENDS:
            raise ValueError(f"--train.loss_kernel={self.loss_kernel!r} is not one of {LOSS_BACKENDS}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"--train.attention={self.attention!r} is not one of {ATTENTIONS}")
        if self.kl_chunk < 1:
            raise ValueError(f"--train.kl_chunk={self.kl_chunk} must be >= 1 (tokens per chunk)")
        for name in ("tokens", "batch_size", "micro_batch_size", "eval_every", "save_every", "log_every"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--train.{name}={v} must be >= 1")
        for name in ("repeat_spans", "recall_rows"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"--train.{name}={getattr(self, name)} must be a fraction of the rows in [0, 1]")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"--train.warmup={self.warmup} must be in [0, 1)")
        if self.lr <= 0 or self.temperature <= 0:
            raise ValueError(f"--train.lr={self.lr} and --train.temperature={self.temperature} must both be > 0")
        if self.mixer_lr is not None and (self.mixer_lr <= 0 or self.train != "all"):
            raise ValueError(f"--train.mixer_lr={self.mixer_lr} needs --train.train all and a rate > 0 (with "
                             f"--train.train {self.train} every trained parameter is a mixer's: set --train.lr)")
        if self.far_weight < 0:
            raise ValueError(f"--train.far_weight={self.far_weight} must be >= 0 (0 turns it off)")
        if min(self.kl_weight, self.hidden_weight, self.ce_weight) < 0 or \
                self.kl_weight + self.hidden_weight + self.ce_weight == 0:
            raise ValueError(f"the loss weights --train.kl_weight={self.kl_weight}, --train.hidden_weight="
                             f"{self.hidden_weight} and --train.ce_weight={self.ce_weight} must be >= 0 and not all 0")


def apply_train_profile(train: TrainArgs, profile: str) -> None:
    """Fill unset (None) distillation options from the profile already chosen by `apply_profile`."""
    _fill(train, load_profile(profile)["train"])


@dataclass
class DistillArgs:
    """`taylor-calibrate distill`: recover a converted hybrid by distillation from its teacher."""
    RANGES: ClassVar[dict[str, str]] = {  # each numeric option's valid values (`check_options`)
        "eval_batch_size": "[1, inf)"}

    student: str = "out/hybrid"
    """A `convert` output directory."""
    teacher: str | None = None
    """Teacher spec (None: the one recorded in the student's config at conversion)."""
    out: str = "out/distill"
    """Output directory: checkpoints, metrics.jsonl, report.json and the trained model (model/)."""
    profile: str = "auto"
    """Sizes for unset options: "full", "quick" or "auto" (full on CUDA, else quick)."""
    train: TrainArgs = field(default_factory=TrainArgs)
    data: DataArgs = field(default_factory=DataArgs)
    """Training rows come from the calibration documents, evaluation rows from the held-out ones."""
    resume: bool = True
    """Continue from the last checkpoint in --out if there is one (same data order, optimizer state)."""
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    """The teacher's weights: "auto" (bf16 on cuda, fp32 on cpu), "float32", "bfloat16". The student always keeps
    fp32 master weights; on cuda its forward runs under bf16 autocast."""
    eval_batch_size: int = 4
    overwrite: bool = False
    """Start a new run over an earlier one in --out (its output is deleted first), or write into a non-empty --out
    that is not a `distill` output (its other files stay; report.json, metrics.jsonl, model/ or another command's
    output there are refused)."""

    def __post_init__(self):
        check_profile(self.profile)
        check_batch(self.eval_batch_size)


@dataclass
class TokenizeArgs:
    """`taylor-calibrate tokenize`: write a corpus once as memory-mapped token shards for `distill` / `recovery`."""

    model: str = "smollm2-135m"
    """Whose tokenizer: a teacher spec (HF directory, hub id, .gguf, "smollm2-135m") or a hybrid directory."""
    data: CorpusSpec = field(default_factory=CorpusSpec)
    out: str = "out/tokens"
    """Output directory (calib.bin, heldout.bin, tokens.json); pass it as --data.source to distill / recovery."""


@dataclass
class RecoveryArgs(PipelineArgs, NiahArgs):
    """`taylor-calibrate recovery`: tokens-to-matched-recovery of each init on each policy (docs/method.md, "Recovery
    distillation")."""
    RANGES: ClassVar[dict[str, str]] = {  # each numeric option's valid values (`check_options`)
        "niah_samples": "[1, inf)", "niah_points": "[2, inf)", "time_limit_s": "[0, inf)"}

    out: str = "out/recovery"
    """Output directory (recovery.json, recovery.md, curves PNG, one resumable run directory per policy x init)."""
    policies: list[str] = field(default_factory=lambda: ["uniform", "bypass", "greedy"])
    """Layer policies ("uniform", "bypass", "greedy", "kl", "layers=0,4,8") and the retrieval-scored ones whose
    students `convert` builds: "heads" (head-wise), "retrieval", "combined", "auto" (as convert's --policy auto);
    --kv_budget sets their share of the KV cache."""
    inits: list[str] = field(default_factory=lambda: ["copy", "align", "taylor+align"])
    """Baseline first: "copy" (copy-only), "align" (phase-2-only), "taylor+align" (ours), "paper+align" ..."""
    extra: list[str] = field(default_factory=lambda: ["uniform:paper+align"])
    """More "<policy>:<init>" runs (the reference's init on one policy)."""
    train: TrainArgs = field(default_factory=TrainArgs)
    niah: bool = True
    """Needle-in-a-haystack retrieval along each run (`niah_points` times) and of the teacher (--niah_* options)."""
    niah_samples: int = 4
    """NIAH prompts per task and length (few: they are scored at every point of every run)."""
    niah_points: int = 2
    """Score NIAH at this many points of each run, evenly spaced in steps, start and end included (>= 2)."""
    time_limit_s: float | None = None
    """Stop cleanly after about this many seconds (the run in progress checkpoints; finished runs and the partial
    recovery.json stay); the same command continues. For time-limited jobs; None: no limit."""
    command: str | None = None
    """The command line to record in the results."""

    def __post_init__(self):
        super().__post_init__()
        self.check_niah()
        if self.niah_points < 2:
            raise ValueError(f"niah_points={self.niah_points} must be >= 2 (start and end)")
        if not self.extra:  # the --extra runs alone are an experiment; with none, a policy and an init are needed
            check_not_empty(self, "policies", "inits")


@dataclass
class TradeoffArgs(PipelineArgs, NiahArgs):
    """`taylor-calibrate tradeoff`: the retrieval / perplexity trade-off of conversions over KV budgets and policies."""
    RANGES: ClassVar[dict[str, str]] = {  # each numeric option's valid values (`check_options`)
        "seed_budget": "(0, 1)", "logprob_length": "[2, inf)", "distill_tokens": "[0, inf)"}

    out: str = "out/tradeoff"
    """Output directory (tradeoff.json, tradeoff.md, tradeoff.png, end-to-end phases' work directories)."""
    budgets: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5])
    """KV budgets (--kv_budget of each conversion)."""
    policies: list[str] = field(default_factory=lambda: ["uniform", "bypass", "retrieval", "heads"])
    """Policies at every budget (taylor init + alignment, the default conversion otherwise)."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Conversion seeds (--seed and --phase2.seed): seeds other than 0 repeat `seed_policy` at `seed_budget`."""
    seed_policy: str = "heads"
    seed_budget: float = 0.25
    logprob_length: int = 4096
    """Length of the teacher-forced answer probes (8 per task; capped by the teacher's context)."""
    distill_tokens: int = 0
    """After each zero-shot conversion, an end-to-end phase (`distill` of the whole hybrid toward the teacher) of this
    many tokens, measured as its own row (0: none)."""
    distill: list[str] = field(default_factory=lambda: [""])
    """`distill` flags of the end-to-end phase, one string per variant (each a phase from the same zero-shot hybrid),
    e.g. "--data.seq_len 4096 --data.source pysrc --data.heldout_fraction 0.5 --train.repeat_spans 0.5"."""
    command: str | None = None
    """The command line to record in the results."""

    def __post_init__(self):
        super().__post_init__()
        self.check_niah()
        check_not_empty(self, "budgets", "policies")
        if not all(0 < b < 1 for b in [*self.budgets, self.seed_budget]):
            raise ValueError(f"budgets {self.budgets} and seed_budget {self.seed_budget} must be fractions in (0, 1)")
        if self.distill_tokens < 0 or not self.distill:
            raise ValueError("distill_tokens must be >= 0 and distill a list of flag strings")
        for flags in self.distill:  # before any work, and named as what they are (not tradeoff's own options)
            parse_args_of(DistillArgs, shlex.split(flags), what=f"--distill {flags!r} (flags of `distill`)")


EXPORT_FORMATS = ("qwen3_5", "gguf")
GGUF_TYPES = ("f32", "f16")


@dataclass
class ExportArgs:
    """`taylor-calibrate export`: a converted hybrid -> a format inference engines run without our package."""

    model: str = "out/hybrid"
    """A `convert` output directory."""
    out: str = "out/qwen3_5"
    """Output directory (must not exist)."""
    format: str = "qwen3_5"
    """"qwen3_5": transformers' Qwen3_5ForCausalLM (also vLLM, SGLang); "gguf": llama.cpp's qwen35 (one .gguf file
    in --out)."""
    gguf_type: str = "f32"
    """--format gguf: the weight matrices' type, "f32" or "f16" (what llama.cpp serves; norms, gates, A, dt bias and
    the conv kernel stay fp32 either way). Quantise further with llama.cpp's llama-quantize."""

    def __post_init__(self):
        if self.format not in EXPORT_FORMATS:
            raise ValueError(f"export format={self.format!r} is not one of {EXPORT_FORMATS}")
        if self.gguf_type not in GGUF_TYPES:
            raise ValueError(f"export --gguf_type {self.gguf_type!r} is not one of {GGUF_TYPES}")
        if self.format != "gguf" and self.gguf_type != "f32":
            raise ValueError(f"--gguf_type {self.gguf_type} applies to --format gguf only (this is --format "
                             f"{self.format})")


def args_parser(args_cls, description: str | None = None) -> ArgumentParser:
    """The parser of one command's argument dataclass: its flags, and `--config FILE.yaml` with any of them."""
    parser = ArgumentParser(description=description, exit_on_error=False)  # cli.main words its errors
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the options below")
    parser.add_class_arguments(args_cls, nested_key=None)
    return parser


SEED_LIMIT = 2 ** 53
"""Seeds reach torch's generators (64-bit) multiplied by 1000 (`model.hybrid`: one per layer): below this they fit."""


INT_LIMIT = 2 ** 63
"""Integer options reach torch, numpy and range lengths as 64-bit integers: from this magnitude on they overflow."""


def in_range(value: float, interval: str) -> bool:
    """Whether `value` lies in `interval`, written as in maths: "(0, 1)", "[1, inf)", "[0.05, 20]"."""
    low, high = (float(x) for x in interval[1:-1].split(","))
    return ((value >= low) if interval[0] == "[" else (value > low)) and (
        (value <= high) if interval[-1] == "]" else (value < high))


def ranges_of(args) -> dict[str, str]:
    """The RANGES of an argument dataclass and of the classes it extends (a subclass's own entry wins)."""
    out = {}
    for klass in reversed(type(args).__mro__):
        out.update(vars(klass).get("RANGES", {}))
    return out


PATH_OPTIONS = ("teacher", "student", "model", "hybrid", "out", "source", "token_cache")  # files and directories


def check_options(args, prefix: str = "--") -> None:
    """The one check of a built argument dataclass (nested ones and lists too). NaN and inf are refused in every float
    option: every comparison with NaN is false, so range checks let it through and it would silently turn off what it
    sets (a NaN grad_clip clips nothing). Then each option outside its class's RANGES (a negative learning rate climbs
    the loss, a zero temperature trains nothing while the metrics read as perfect agreement), and integers past 64 bits
    (an OverflowError deep in the run). A path option (PATH_OPTIONS) may not be empty (read as a hub id or the working
    directory), and `~` in it is expanded as the shell would have (`--teacher=~/t` and a --config file reach us
    unexpanded)."""
    ranges = ranges_of(args)
    for f in fields(args):
        value, name = getattr(args, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            check_options(value, f"{name}.")
        if f.name in PATH_OPTIONS and isinstance(value, str):
            if not value.strip():
                what = {"teacher": "a path or a hub id", "out": "a directory path"}.get(f.name, "a path")
                raise ValueError(f"{name} is empty; pass {what}")
            if value == "~" or value.startswith("~/"):
                setattr(args, f.name, os.path.expanduser(value))
        seed = f.name in ("seed", "seeds") or f.name.endswith("_seed")
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{name}={v} is not a finite number; pass a finite value")
            if (f.name in ranges and isinstance(v, (int, float)) and not isinstance(v, bool)
                    and not in_range(v, ranges[f.name])):
                raise ValueError(f"{name}={v} is out of range: it must lie in {ranges[f.name]}; pass a value there")
            if seed and isinstance(v, int) and abs(v) >= SEED_LIMIT:
                raise ValueError(f"{name}={v} is out of range: a seed must be an integer of magnitude below 2**53 "
                                 "(the random generators take 64 bits, and a layer's seed is derived from it)")
            if isinstance(v, int) and abs(v) >= INT_LIMIT:
                raise ValueError(f"{name}={v} is out of range: an integer option must be of magnitude below 2**63")


MAY_BE_EMPTY = ("sets", "windows", "extra")  # list options whose empty value means something (none of them)


def check_values(namespace, args_cls, prefix: str = "--") -> None:
    """Before the arguments are built: a `null` (from a --config YAML) for an option that takes no None, and an empty
    list where one is needed, would end in a TypeError or a StopIteration once the work began; refused here naming
    the option, its type and default."""
    for f in fields(args_cls):
        value, name = getattr(namespace, f.name, None), f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if is_dataclass(default):
            if value is not None and hasattr(value, "__dict__"):
                check_values(value, type(default), f"{name}.")
            continue
        if value is None and "None" not in str(f.type):
            keep = "" if default is dataclasses.MISSING else f" (then: {default!r})"
            raise ValueError(f"{name} is null (a `null` in --config?), but it takes a {f.type}: give it a value or "
                             f"leave it out{keep}")
        if isinstance(value, list) and not value and f.name not in MAY_BE_EMPTY:
            raise ValueError(nothing_to_run(name, default))


def args_of(args_cls, namespace):
    """A parsed (instantiated) namespace -> the argument dataclass, its float options checked finite and in range,
    `~` in its paths expanded."""
    args = args_cls(**{k: v for k, v in vars(namespace).items() if k != "config" and not k.startswith("__")})
    check_options(args)
    return args


def parse_args_of(args_cls, argv: list[str], what: str | None = None):
    """Flags -> `args_cls` (e.g. the `distill` flags of an end-to-end phase inside `tradeoff`); with `what`, an error
    names them as that (else the calling command's parser words it as one of its own options)."""
    import argparse

    parser = args_parser(args_cls)
    try:
        cfg = parser.parse_args(argv)
        check_values(cfg, args_cls)
        return args_of(args_cls, parser.instantiate(cfg))
    except (argparse.ArgumentError, ValueError) as e:
        if what is None:
            raise
        raise ValueError(f"{what}: {' '.join(str(e).split())}") from None


# The token cache's directory (`data.cached_tokens` keeps its entries there), here so that the output checks can
# find it without importing the data stage.
TOKEN_CACHE_ENV = "TAYLOR_CALIBRATE_TOKEN_CACHE"


TEACHER_CACHE_ENV = "TAYLOR_CALIBRATE_TEACHER_CACHE"
CACHE_OFF = ("off", "0", "false", "no", "none")


def teacher_cache_dir() -> Path | None:
    """Where dequantised GGUF teachers are kept (`teacher.teacher_cache_entry`): $TAYLOR_CALIBRATE_TEACHER_CACHE,
    else $XDG_CACHE_HOME/taylor_calibrate/teachers, else ~/.cache/taylor_calibrate/teachers; None when that variable
    says off (or 0, false, no, none)."""
    value = os.environ.get(TEACHER_CACHE_ENV, "").strip()
    if value.lower() in CACHE_OFF:
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "taylor_calibrate" / "teachers"


def token_cache_dir(option: str | None = None) -> Path:
    """The token cache: `option` (--data.token_cache), else $TAYLOR_CALIBRATE_TOKEN_CACHE, else
    $XDG_CACHE_HOME/taylor_calibrate/tokens, else ~/.cache/taylor_calibrate/tokens."""
    if option:
        return Path(option).expanduser()
    if os.environ.get(TOKEN_CACHE_ENV):
        return Path(os.environ[TOKEN_CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "taylor_calibrate" / "tokens"
