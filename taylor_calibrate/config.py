"""Configs: the GDN mixer's options, the hybrid model's HF config, and the CLI's argument dataclasses.

Everything a user can set is a field of a dataclass here; the CLI (jsonargparse) and YAML files both fill
them, and the field docstrings become `--help`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from transformers import PreTrainedConfig

from taylor_calibrate.data import CorpusSpec
from taylor_calibrate.retrieval import TASKS as NIAH_TASKS

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")

ATTENTION_TYPES = ("full_attention", "sliding_attention")
GDN_TYPE = "linear_attention"  # transformers' cache name for a recurrent-state layer
# transformers' cache names for a layer that holds both: a KV cache (of the kept heads) and a recurrent state
HEADWISE_TYPES = {"full_attention": "hybrid", "sliding_attention": "hybrid_sliding"}


@dataclass
class GDNConfig:
    """Options of a converted Gated DeltaNet layer (METHOD.md sections 2 and 7).

    Head count and head dim are not options: they are the teacher's (num_heads = query heads, expand_v = 1).
    """

    short_conv: str = "random"
    """Short causal depthwise conv on q/k/v (fla's `use_short_conv`, on by default there) and its library init, which
    the `copy` / `zero_gate` baselines keep: "random" (fla's: nn.Conv1d's default), "identity", or "none" (no conv:
    SiLU on q/k/v, as the reference). `taylor` sets the convs itself (v: the teacher's local attention profile, q/k:
    identity; --calib.local_profile), `paper` to identity (the reference's conv-free layer at step 0). With convs,
    taylor + alignment: 4.20 / 4.55 / 4.68 PPL on uniform / bypass / greedy against 4.54 / 4.71 / 5.11 without
    (H200, docs/decisions.md)."""
    conv_size: int = 4
    """Kernel size of the short convolution."""
    qk_activation: str = "silu"
    """Activation on q and k before L2 normalisation: "silu" (fla) or "identity"."""
    v_activation: str = "identity"
    """Activation on v: "identity" (keeps the teacher's values linear, as attention mixes them; CPU quick, 100
    alignment steps: 18.72 -> 16.21 PPL, docs/decisions.md) or "silu" (fla's layer)."""
    output_norm: bool = True
    """Per-head RMSNorm on the recurrent readout before the gate (fla's o_norm)."""
    gate: str = "swish"
    """Output gate form: "swish" (fla), "sigmoid", or "none" (no g_proj)."""
    norm_eps: float = 1e-5
    """Epsilon of the per-head RMSNorm."""

    def __post_init__(self):
        choices = {"short_conv": ("none", "identity", "random"), "qk_activation": ("silu", "identity"),
                   "v_activation": ("silu", "identity"), "gate": ("swish", "sigmoid", "none")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GDN option {name}={getattr(self, name)!r} is not one of {allowed}")
        if not 2 <= self.conv_size <= 16:
            raise ValueError(f"GDN option conv_size={self.conv_size} must be in [2, 16]")

    @classmethod
    def from_dict(cls, d: dict | None) -> "GDNConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown GDN option(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


# Attributes of the teacher config that generation, masking and caching read from the top-level config.
_MIRRORED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "max_position_embeddings", "sliding_window", "rms_norm_eps", "bos_token_id",
             "eos_token_id", "pad_token_id", "final_logit_softcapping")


class HybridConfig(PreTrainedConfig):
    """HF config of a hybrid: the teacher's own config plus which layers are GDN.

    `layer_types` uses transformers' names ("full_attention", "sliding_attention", "linear_attention"), so
    `DynamicCache(config=...)` builds KV layers for kept attention and recurrent-state layers for GDN.
    """

    model_type = "taylor_hybrid"

    base_config: dict | None = None
    layer_types: list[str] | None = None
    attention_heads: dict | None = None
    """Head-wise layers ("hybrid" / "hybrid_sliding" in layer_types): {str(layer): [KV groups kept as attention]};
    the query heads of every other group of that layer are GDN heads."""
    gdn: dict | None = None
    teacher_name: str | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        base = self.base_config or {}
        for key in _MIRRORED:
            if key in base:
                setattr(self, key, base[key])
        if "tie_word_embeddings" in base:
            self.tie_word_embeddings = base["tie_word_embeddings"]
        super().__post_init__(**kwargs)

    @property
    def gdn_layers(self) -> list[int]:
        """Layers with GDN heads: converted whole or head-wise."""
        return [i for i, t in enumerate(self.layer_types or []) if t == GDN_TYPE or t in HEADWISE_TYPES.values()]

    def kept_groups(self, layer: int) -> list[int]:
        """KV groups of `layer` kept as softmax attention ([] for a GDN layer)."""
        return list((self.attention_heads or {}).get(str(layer), []))

    @property
    def gdn_config(self) -> GDNConfig:
        return GDNConfig.from_dict(self.gdn)


def gdn_dict(cfg: GDNConfig) -> dict:
    return asdict(cfg)


SCHEDULES = ("constant", "cosine", "linear", "wsd")


@dataclass
class CalibArgs:
    """Phase 1 options."""

    decay: bool = True
    """Set the decay from the mean attention distance d_h (half-life d_h tokens)."""
    half_life_scale: float = 1.0
    """taylor's decay half-life in units of d_h (1: memory halves after d_h tokens; ln 2 = 0.69 makes the decay
    kernel's own mean distance gamma / (1 - gamma) about d_h; less: shorter memory than the teacher's mean reach)."""
    write_gate: bool = True
    """Set the write gate from the attention concentration c_h: beta*_h = beta_min + beta_span * c_h."""
    value_scale: bool = True
    """Least-squares per-head amplitude sigma_h of the student head output against the teacher's."""
    output_gate: bool = True
    """Initialise the output gate (paper: alpha * v_proj; taylor: perturbation around the head amplitude, which it
    carries; off: g_proj keeps its library init and the amplitude goes into o_proj)."""
    far_half_life: bool = False
    """With the local profile in the v conv: the decay's half-life is the mean distance of the attention mass beyond
    the conv's reach, (d_h - sum_{j<K} j b_j) / (1 - sum_{j<K} b_j), instead of d_h (b_j = mean p_{t,t-j})."""
    local_profile: bool = True
    """With short convs (--gdn.short_conv identity|random): taylor sets each head's v conv kernel to the teacher's
    mean attention over the conv's K nearest offsets, p_{t,t-j} for j < K (renormalised), and the q / k convs to
    identity: the local part of the attention pattern at step 0, which the RoPE-free recurrence cannot express."""
    sinks: str = "drop"
    """Attention sinks in d_h and c_h: "keep" (mass on the first token counts) or "drop" (removed, renormalised)."""
    concentration: str = "abs"
    """Entropy normalisation: "abs" (1 - H_t / log n_t) or "minmax" (over the layer's heads, as the reference)."""
    beta_min: float = 0.3
    beta_span: float = 0.4
    gate_alpha: float = 0.01
    """Relative size of the output gate's perturbation (reference: 0.01)."""
    sigma_rows: int = 4
    """Calibration rows used to fit sigma_h (a student forward per converted layer)."""
    fit_rows: int = 16
    """Calibration rows phase 1 reads at most (the write gate's input direction, the lstsq / value fits)."""
    readout: str = "scale"
    """Output map after the recurrence: "scale" (per-head sigma_h, METHOD.md 3b), "lstsq" (closed-form ridge fit
    of o_proj from the student's head outputs to the teacher's attention output, on the calibration rows) or
    "value" (closed-form ridge fit of each head's v_proj rows so that the head's recurrent readout matches the
    teacher's head output; W_O and the head layout stay the teacher's; then sigma_h as for "scale")."""
    ridge: float = 1e-3
    """Ridge strength of the lstsq / value fit (relative to the mean feature energy), shrinking toward the current
    weights (W_O; the copied W_V)."""

    def __post_init__(self):
        if self.sinks not in ("keep", "drop"):
            raise ValueError(f"calib option sinks={self.sinks!r} must be 'keep' or 'drop'")
        if self.concentration not in ("abs", "minmax"):
            raise ValueError(f"calib option concentration={self.concentration!r} must be 'abs' or 'minmax'")
        if not self.half_life_scale > 0:
            raise ValueError(f"calib option half_life_scale={self.half_life_scale} must be > 0")
        if self.readout not in ("scale", "lstsq", "value"):
            raise ValueError(f"calib option readout={self.readout!r} must be 'scale', 'lstsq' or 'value'")
        if self.sigma_rows < 1 or self.fit_rows < 1:
            raise ValueError(f"calib options sigma_rows={self.sigma_rows} and fit_rows={self.fit_rows} must be >= 1")
        if not self.ridge > 0:
            raise ValueError(f"calib option ridge={self.ridge} must be > 0")
        if not (0 < self.beta_min and self.beta_min + self.beta_span < 1 and self.beta_span >= 0):
            raise ValueError("calib options need 0 < beta_min and beta_min + beta_span < 1")


@dataclass
class AlignArgs:
    """Phase 2 (METHOD.md section 4): per-layer alignment of each GDN mixer to the teacher's attention output."""

    steps: int | None = None
    """Optimizer steps per layer (None: from --profile, 300 full / 100 quick). Longer is better but phase 1's lead
    fades: H200, SmolLM2, uniform / bypass / greedy, lr_qkv 9e-4, taylor + alignment 4.05 / 4.37 / 4.22 at 300
    steps, 3.87 / 4.14 / 3.99 at 1000 (at 9.9 s per 300 steps on the H200, about 23 s more), copy + alignment 4.44 /
    4.85 / 4.60 and 4.03 / 4.31 / 4.13 (docs/decisions.md)."""
    batch_size: int | None = None
    """Sequences per step (None: from --profile, 4 full / 2 quick), cycled deterministically through the stored rows
    (a seeded permutation per epoch)."""
    seq_len: int | None = None
    """Crop training rows to their first seq_len tokens (cheaper steps on CPU); None = full rows (the quick
    profile crops to 256). Evaluation always uses full rows."""
    lr: float = 6e-3
    """Learning rate of the new parameters other than the decay and write gate (those take `lr_dynamics`): g_proj,
    short convs, and o_norm when it trains (the reference: 1e-3 for all new parameters). The four learning rates
    keep the ratios tuned one by one (lr 2e-3, lr_qkv 3e-4, lr_o 1e-3, lr_dynamics 1e-2) and are 3x those: with the
    wsd schedule that lowered H200 taylor + alignment from 4.20 / 4.55 / 4.61 to 4.05 / 4.37 / 4.44 on uniform /
    bypass / greedy (x2: 4.08 / 4.40 / 4.51, x4 4.04 / 4.38 / 4.43, x6 worse; docs/decisions.md). lr_qkv was then
    raised on its own for the full profile (below)."""
    lr_qkv: float | None = None
    """Learning rate of the copied projections q_proj, k_proj, v_proj (the reference: 1e-4). None: from --profile,
    3.6e-3 full / 9e-4 quick: the best rate depends on the budget. H200 full (300 steps of 4 x 1024), seed 0, taylor +
    alignment uniform / bypass / greedy: 9e-4 4.05 / 4.37 / 4.22, 1.8e-3 4.00 / 4.32 / 4.15, 2.7e-3 3.96 / 4.27 / 4.11,
    3.6e-3 3.95 / 4.26 / 4.10 (copy and paper gain alike; phase 1 gets the scales right, alignment has to turn the
    copied directions). CPU quick (100 steps of 2 x 256), uniform, seeds 0 / 1: 9e-4 8.89 / 8.79, 3.6e-3 9.21 / 9.06
    (docs/decisions.md)."""
    lr_o: float = 3e-3
    """Learning rate of o_proj (when it trains)."""
    lr_dynamics: float | None = 3e-2
    """Learning rate of the decay and write-gate parameters (A_log, dt_bias, a_proj, b_proj), which phase 1 sets
    from the teacher's attention statistics: None = `lr`; 0 = frozen, so alignment keeps phase 1's dynamics."""
    weight_decay: float = 0.01
    """AdamW weight decay, on every trained parameter (as the reference)."""
    grad_clip: float = 1.0
    """Max gradient norm, per layer (<= 0: no clipping)."""
    train_o_proj: bool = True
    """Also train o_proj (the reference freezes it; training it lowered aligned PPL 8.10 -> 7.34, docs/decisions.md)."""
    train_o_norm: bool = False
    """Also train o_norm's weight (the reference freezes it)."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over this many steps (0 = none, as the reference; 15 / 50 did not lower taylor +
    alignment on the H200, docs/decisions.md)."""
    schedule: str = "wsd"
    """Learning rate after warmup: "constant" (the reference), "cosine" (decay to 10% at the last step), "linear"
    (straight to 0 at the last step) or "wsd" (constant, then straight to 0 over the last `decay_fraction` of the
    steps: at 300 steps on the H200 the best of the three decays, for every learning-rate scale; docs/decisions.md)."""
    decay_fraction: float = 0.2
    """The "wsd" schedule's decay: the last this fraction of the steps (after warmup). H200, 300 steps: 0.5 gave
    taylor + alignment 4.08 / 4.42 / 4.27 against 4.05 / 4.37 / 4.22 (lr_qkv 9e-4; docs/decisions.md)."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay (torch's default). Lower values forget the large gradients of the first steps
    sooner: 0.95 helps copy + alignment (4.44 / 4.85 / 4.60 -> 4.40 / 4.82 / 4.58) but not taylor (4.06 / 4.39 /
    4.22; H200, 300 steps, lr_qkv 9e-4, docs/decisions.md)."""
    sink_weight: float = 64.0
    """Weight of each row's first position in the loss, in positions (1 = a plain mean over positions). The first
    token is where later layers' heads park their attention (the sink): an error there moves every later token. H200,
    greedy (layer 0 converted), 300 steps: taylor + alignment 4.44 -> 4.22 with 64 (16: 4.28, 256: 4.25), its layer
    0 alone from 3.561 to 3.380 PPL (teacher 3.369); uniform / bypass (layer 0 kept) unchanged (docs/decisions.md)."""
    layer_group: int | None = None
    """Layers trained together in one stacked forward/backward (None: all; fewer bounds activation memory). The
    result does not depend on it."""
    seed: int = 0
    """Seed of the row order."""
    log_every: int = 50
    """Evaluate (and keep the best state) every this many steps, and at the end."""

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"align option schedule={self.schedule!r} is not one of {SCHEDULES}")
        for name in ("batch_size", "log_every", "layer_group"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"align option {name}={getattr(self, name)} must be >= 1")
        for name in ("steps", "warmup_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"align option {name}={getattr(self, name)} must be >= 0")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"align option seq_len={self.seq_len} must be >= 1 or None")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"align option decay_fraction={self.decay_fraction} must be in (0, 1]")
        if not 0.0 < self.adam_beta2 < 1.0:
            raise ValueError(f"align option adam_beta2={self.adam_beta2} must be in (0, 1)")
        if self.sink_weight < 0:
            raise ValueError(f"align option sink_weight={self.sink_weight} must be >= 0")
        if self.lr_qkv is not None and self.lr_qkv < 0:
            raise ValueError(f"align option lr_qkv={self.lr_qkv} must be >= 0 or None (from --profile)")
        if self.lr_dynamics is not None and self.lr_dynamics < 0:
            raise ValueError(f"align option lr_dynamics={self.lr_dynamics} must be >= 0 or None")


@dataclass
class DataArgs(CorpusSpec):
    """Which text to calibrate on and which to evaluate on (never overlapping documents)."""

    seq_len: int | None = None
    """Tokens per sequence, for calibration and evaluation (None: from --profile, 1024 full / 512 quick)."""
    calib_seqs: int | None = None
    """Number of calibration sequences (None: from --profile, 128 full / 64 quick). Phase 2 cycles through them, and
    a small set is what limited it: H200, 300 steps, taylor + alignment 5.57 / 5.90 / 7.36 PPL (uniform / bypass /
    greedy) with 16, 4.70 / 4.79 / 5.19 with 64, 4.54 / 4.71 / 5.11 with 128 (docs/decisions.md)."""
    eval_seqs: int | None = None
    """Number of held-out sequences for perplexity (None: from --profile, 32 full / 16 quick)."""

    def __post_init__(self):
        for name in ("seq_len", "calib_seqs", "eval_seqs"):
            if getattr(self, name) is not None and getattr(self, name) < (2 if name == "seq_len" else 1):
                raise ValueError(f"data option {name}={getattr(self, name)} is out of range (must be positive)")


INITS = ("copy", "zero_gate", "paper", "taylor")

# Sizes that `--profile` fills in where an option is left unset (None). "full" is the GPU setting; "quick" keeps
# the default conversion of the embedded teacher under 10 minutes on a 2-core CPU.
PROFILES = {
    "full": {"seq_len": 1024, "calib_seqs": 128, "eval_seqs": 32, "align_steps": 300, "align_batch_size": 4,
             "align_seq_len": None, "align_lr_qkv": 3.6e-3},
    "quick": {"seq_len": 512, "calib_seqs": 64, "eval_seqs": 16, "align_steps": 100, "align_batch_size": 2,
              "align_seq_len": 256, "align_lr_qkv": 9e-4},
}


def check_profile(profile: str) -> None:
    if profile not in ("auto", *PROFILES):
        raise ValueError(f"profile={profile!r} is not one of {('auto', *PROFILES)}")


@dataclass
class PipelineArgs:
    """What every stage that builds hybrids shares: the teacher, the GDN layer, phase 1 and 2, data, hardware."""

    teacher: str = "smollm2-135m"
    """HF checkpoint directory, hub id, .gguf file, or "smollm2-135m" (the embedded default teacher)."""
    keep_every: int = 4
    """Keep one attention layer in this many (all policies keep ceil(n / keep_every) layers, or KV groups for
    `heads`); a shorthand for --kv_budget."""
    kv_budget: float | None = None
    """Fraction of the teacher's KV cache the hybrid keeps, in (0, 1): at most this fraction of the layers (layer
    policies) or of the KV groups (`heads`) stays softmax attention. None: one in --keep_every."""
    probe_samples: int = 8
    """Retrieval probes per task (single, multikey, passkey) and length: the `retrieval` / `heads` policies score the
    teacher's heads on calibration probes at --data.seq_len and 4x that many tokens (capped by the teacher's
    context); convert reports the teacher-forced answer log-probability of teacher and hybrid on evaluation probes
    at --data.seq_len (other needles, other haystack)."""
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

    def __post_init__(self):
        check_profile(self.profile)
        if self.kv_budget is not None and not 0 < self.kv_budget < 1:
            raise ValueError(f"kv_budget={self.kv_budget} must be a fraction of the teacher's KV cache in (0, 1)")
        if self.probe_samples < 1:
            raise ValueError(f"probe_samples={self.probe_samples} must be >= 1")


@dataclass
class ConvertArgs(PipelineArgs):
    """`taylor-calibrate convert`: teacher -> hybrid."""

    out: str = "out/hybrid"
    """Output directory (model, tokenizer, report.json)."""
    init: str = "taylor"
    """Phase 1 (METHOD.md 3): "taylor" (ours), "paper" (the reference code), "copy" (weight copy, library-default
    dynamics), "zero_gate" (copy with g_proj = 0)."""
    align: bool = True
    """Phase 2 (METHOD.md 4): teacher-forced per-layer alignment after phase 1."""
    policy: str = "uniform"
    """Which layers stay softmax attention: "uniform", "bypass", "greedy", "retrieval" (the layers whose heads the
    teacher retrieves with), "heads" (head-wise: the KV groups the teacher retrieves with, in any layer), or
    "layers=0,4,8"."""

    def __post_init__(self):
        super().__post_init__()
        if self.init not in INITS:
            raise ValueError(f"init={self.init!r} is not one of {INITS}")


@dataclass
class AblateArgs(PipelineArgs):
    """`taylor-calibrate ablate`: zero-shot held-out perplexity for every init x policy."""

    out: str = "out/ablate"
    """Output directory for ablation.json and ablation.md."""
    inits: list[str] = field(default_factory=lambda: ["copy", "zero_gate", "paper", "paper+align", "align", "taylor",
                                                      "taylor+align"])
    """Rows: <copy|zero_gate|paper|taylor>[+align]; "align" = copy + alignment (phase-2-only)."""
    policies: list[str] = field(default_factory=lambda: ["uniform", "bypass", "greedy"])
    """Columns: layer policies."""
    command: str | None = None
    """The command line to record in the results (for reproducibility)."""


_ALIGN_FROM_PROFILE = ("steps", "batch_size", "seq_len", "lr_qkv")


def fill_align(phase2: AlignArgs, profile: str) -> AlignArgs:
    """Fill phase 2's unset (None) sizes and copied-projection learning rate from a profile, in place."""
    for key in _ALIGN_FROM_PROFILE:
        if getattr(phase2, key) is None:
            setattr(phase2, key, PROFILES[profile][f"align_{key}"])
    return phase2


def apply_profile(args, device_type: str) -> str:
    """Fill unset (None) data/alignment sizes (and the copied projections' learning rate) from the profile; returns
    the profile used."""
    name = args.profile if args.profile != "auto" else ("full" if device_type == "cuda" else "quick")
    prof = PROFILES[name]
    for key in ("seq_len", "calib_seqs", "eval_seqs"):
        if getattr(args.data, key) is None:
            setattr(args.data, key, prof[key])
    if getattr(args, "phase2", None) is not None:
        fill_align(args.phase2, name)
    return name


@dataclass
class EvalArgs:
    """`taylor-calibrate eval`: perplexity of a hybrid (and optionally its teacher) on held-out text; optionally
    long-context retrieval (NIAH), agreement with the teacher and lm-eval tasks."""

    model: str = "out/hybrid"
    """A hybrid output directory (or any causal LM checkpoint)."""
    teacher: str | None = None
    """Also evaluate this teacher in the same run (same text, same tokenizer)."""
    out: str | None = None
    """Where to write report.json (default: <model>/eval)."""
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
    teacher when --teacher is given."""
    niah_tasks: list[str] = field(default_factory=lambda: ["single", "multikey", "passkey"])
    """NIAH tasks: "single" (one magic-number needle in prose), "multikey" (four, one asked), "passkey"."""
    niah_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    """NIAH context lengths in tokens of the model's tokenizer (prompt + answer); lengths beyond the model's
    max_position_embeddings are skipped (null in report.json)."""
    niah_samples: int = 20
    """NIAH prompts per task and length, needle depths spread evenly from start to end."""
    niah_seed: int = 0
    """Seed of the NIAH needles (keys, numbers); same seed, same prompts."""
    agreement: bool = False
    """Mean KL(teacher || model) and top-1 agreement on the held-out rows (needs --teacher)."""
    lm_eval_tasks: list[str] | None = None
    """lm-evaluation-harness tasks to run on the model in memory, e.g. [hellaswag] (needs the `eval` extra:
    pip install "taylor-calibrate[eval]"; built-in tasks download their data, so offline use a local task file)."""
    lm_eval_include: str | None = None
    """Directory of extra lm-eval task YAML files (searched before lm-eval's built-in tasks)."""
    lm_eval_limit: int | None = None
    """Examples per lm-eval task (None: all)."""

    def __post_init__(self):
        check_profile(self.profile)
        if self.agreement and not self.teacher:
            raise ValueError("--agreement compares the model with its teacher: pass --teacher too")
        bad = [t for t in self.niah_tasks if t not in NIAH_TASKS]
        if bad:
            raise ValueError(f"niah_tasks {bad} unknown; choose from {list(NIAH_TASKS)}")
        if any(n < 64 for n in self.niah_lengths) or self.niah_samples < 1:
            raise ValueError(f"niah_lengths {self.niah_lengths} must all be >= 64 tokens and niah_samples "
                             f"({self.niah_samples}) >= 1")
        if self.lm_eval_include is not None and not Path(self.lm_eval_include).is_dir():
            raise FileNotFoundError(f"lm_eval_include={self.lm_eval_include!r} is not a directory of task YAML files")
        if self.lm_eval_limit is not None and self.lm_eval_limit < 1:
            raise ValueError(f"lm_eval_limit={self.lm_eval_limit} must be >= 1 or None")


PARALLEL = ("ddp", "fsdp")
TRAIN_MODES = ("mixers", "all")


@dataclass
class TrainArgs:
    """Recovery distillation (METHOD.md section 5): the student learns the teacher's next-token distribution."""

    tokens: int | None = None
    """Training-token budget (None: from --profile, 8M full / 32K quick)."""
    batch_size: int | None = None
    """Rows per optimizer step, over all processes (None: from --profile, 16 full / 2 quick). The loss curve
    does not depend on how many processes share it."""
    micro_batch_size: int | None = None
    """Rows per forward pass per process (None: batch_size / processes, i.e. no gradient accumulation)."""
    train: str = "mixers"
    """Which parameters train: "mixers" (the converted GDN layers only) or "all"."""
    lr: float = 3e-4
    """Peak learning rate (AdamW), after a linear warmup, then cosine to 10%."""
    warmup: float = 0.05
    """Warmup length as a fraction of the steps."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Max global gradient norm (<= 0: none)."""
    kl_weight: float = 1.0
    """Weight of the forward KL(teacher || student) on the logits, per token."""
    temperature: float = 1.0
    """Softmax temperature of the KL term (scaled back by T^2)."""
    hidden_weight: float = 0.0
    """Weight of the hidden-state MSE (every layer's output, relative to the teacher's mean square)."""
    ce_weight: float = 0.0
    """Weight of the next-token cross-entropy on the training text."""
    eval_every: int | None = None
    """Evaluate on held-out text every this many steps (None: 8 evaluations over the run); also at step 0 and
    at the end."""
    save_every: int = 100
    """Write a checkpoint every this many steps (atomically; the run resumes from the last one)."""
    log_every: int = 10
    parallel: str = "ddp"
    """Under torchrun: "ddp" (replicated model) or "fsdp" (FSDP2 `fully_shard`, per decoder layer)."""
    compile: bool | None = None
    """torch.compile every decoder layer of student and teacher and the KL loss (fuses the norms, activations, rotary
    and the loss's passes over the logits; fla's kernels stay as they are). None: on with CUDA (1.5B shape on an H200,
    micro-batch 4: 23.0K -> 30.5K tokens/s, peak memory 68 -> 37 GB; benchmarks/results/perf_h200.md), off on a CPU.
    The first step pays the compilation."""
    peak_tflops: float | None = None
    """Peak dense bf16 TFLOP/s of one accelerator for the MFU estimate (None: known GPUs, e.g. H100/H200 989)."""
    seed: int = 0
    """Seed of the row order."""

    def __post_init__(self):
        if self.train not in TRAIN_MODES:
            raise ValueError(f"train option train={self.train!r} is not one of {TRAIN_MODES}")
        if self.parallel not in PARALLEL:
            raise ValueError(f"train option parallel={self.parallel!r} is not one of {PARALLEL}")
        for name in ("tokens", "batch_size", "micro_batch_size", "eval_every", "save_every", "log_every"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"train option {name}={v} must be >= 1")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"train option warmup={self.warmup} must be in [0, 1)")
        if self.lr <= 0 or self.temperature <= 0:
            raise ValueError("train options lr and temperature must be > 0")
        if min(self.kl_weight, self.hidden_weight, self.ce_weight) < 0 or \
                self.kl_weight + self.hidden_weight + self.ce_weight == 0:
            raise ValueError("train loss weights must be >= 0 and not all 0")


TRAIN_PROFILES = {"full": {"tokens": 8_000_000, "batch_size": 16}, "quick": {"tokens": 32_768, "batch_size": 2}}


def apply_train_profile(train: TrainArgs, profile: str) -> None:
    """Fill unset (None) distillation sizes from the profile already chosen by `apply_profile`."""
    for key, value in TRAIN_PROFILES[profile].items():
        if getattr(train, key) is None:
            setattr(train, key, value)


@dataclass
class DistillArgs:
    """`taylor-calibrate distill`: recover a converted hybrid by distillation from its teacher."""

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

    def __post_init__(self):
        check_profile(self.profile)


@dataclass
class RecoveryArgs(PipelineArgs):
    """`taylor-calibrate recovery`: tokens-to-matched-recovery of each init on each policy (METHOD.md section 5)."""

    out: str = "out/recovery"
    """Output directory (recovery.json, recovery.md, curves PNG, one resumable run directory per policy x init)."""
    policies: list[str] = field(default_factory=lambda: ["uniform", "bypass", "greedy"])
    inits: list[str] = field(default_factory=lambda: ["copy", "align", "taylor+align"])
    """Baseline first: "copy" (copy-only), "align" (phase-2-only), "taylor+align" (ours), "paper+align" ..."""
    extra: list[str] = field(default_factory=lambda: ["uniform:paper+align"])
    """More "<policy>:<init>" runs (the reference's init on one policy)."""
    train: TrainArgs = field(default_factory=TrainArgs)
    niah: bool = True
    """Needle-in-a-haystack retrieval at the start and end of each run."""
    niah_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    niah_samples: int = 4
    command: str | None = None
    """The command line to record in the results."""
