"""Long-context retrieval: RULER-style needle-in-a-haystack tasks, generated locally and scored by generation.

Three tasks (after RULER, Hsieh et al. 2024, and the passkey test of Mohtashami & Jaggi 2023):

    single    one needle "The special magic number for <key> is: <7 digits>." in natural text; asks for it
    multikey  four such needles with different keys (three distractors); asks for one key's number
    passkey   "The pass key is <5 digits>. Remember it. <5 digits> is the pass key." in repeated filler

    samples = make_samples("single", tokenizer, length=4096, samples=20, seed=0)   # deterministic
    acc = accuracy(model, tokenizer, samples)                                        # greedy generate

Every prompt is plain text (same for a base model, an instruct model and the hybrid) that ends in an answer
prefix ("... The pass key is"), so a model answers by continuing it. `length` counts tokens of the model's
tokenizer as RULER does: the prompt plus `max_new_tokens` generated tokens fit in `length`, and the prompt is at
most a few tokens shorter than that budget. Needle depths spread evenly over [0, 1] across the samples of a
(task, length). A sample is correct iff its answer string appears in the greedy continuation.

The haystack of single/multikey is English prose: the Python language reference that ships inside the standard
library (`pydoc_data.topics`), so it needs no download; like data.py's builtin corpus, its exact text depends on
the Python version. passkey's haystack is RULER's noise filler.
"""
from __future__ import annotations

import functools
import logging
import random
import re
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from taylor_calibrate.config import NIAH_LENGTHS as LENGTHS, NIAH_NEW_TOKENS, NIAH_TASKS as TASKS
from taylor_calibrate.memory import SLIDING_TYPES
from taylor_calibrate.model.hybrid_config import cached_layer_types

log = logging.getLogger("taylor_calibrate")

MULTIKEY_NEEDLES = 4  # one asked + three distractors (RULER's niah_multikey_1)
NEW_TOKENS = NIAH_NEW_TOKENS

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_MAGIC_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the numbers afterwards.\n")
_MAGIC_QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
                   "The special magic number for {key} mentioned in the provided text is")
_PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                  "I will quiz you about the important information there.\n")
_PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"

# Keys are "<adjective>-<noun>" (RULER draws word keys too): 30 x 30 = 900 distinct keys.
_ADJECTIVES = ("amber", "brave", "calm", "clever", "crimson", "distant", "eager", "fancy", "gentle", "golden",
               "hidden", "hollow", "icy", "jolly", "kind", "lively", "lucky", "mellow", "misty", "noble", "quiet",
               "rapid", "rustic", "silent", "silver", "sleepy", "swift", "tender", "vivid", "wild")
_NOUNS = ("anchor", "badger", "canyon", "cedar", "comet", "falcon", "forest", "garden", "harbor", "island",
          "lantern", "meadow", "mirror", "orchid", "otter", "pebble", "planet", "quarry", "river", "saddle",
          "signal", "spruce", "thunder", "tiger", "tower", "valley", "violin", "walrus", "willow", "zephyr")


@dataclass
class Sample:
    task: str
    length: int  # token budget: prompt + max_new_tokens <= length
    prompt: str
    answer: str  # the string the continuation must contain
    depth: float  # intended depth of the asked needle in the haystack, in [0, 1]
    needle: str  # the asked needle sentence, as it appears in the prompt
    distance: int  # tokens from the asked needle's first to the prompt's last: how far back the answer sits
    distractors: tuple[str, ...] = ()  # the other needles' answers (multikey): saying one is confusing the keys


@functools.lru_cache(maxsize=1)
def prose_words() -> tuple[str, ...]:
    """Words of the prose paragraphs of the Python language reference (`pydoc_data.topics`, in the stdlib):
    paragraphs without indented lines (code, grammar) or underlines (headings), in topic order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions split pydoc_data out of the stdlib package
        raise FileNotFoundError("the NIAH haystack needs the standard library's pydoc_data module; install your "
                                "distribution's full Python standard library (e.g. libpython3-stdlib)") from e
    words = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            lines = para.strip("\n").splitlines()
            if not lines or any(l[:1].isspace() or re.fullmatch(r"[*=\-~^]{3,}", l.strip()) for l in lines):
                continue
            text = " ".join(l.strip() for l in lines)
            if text.endswith(".") and len(text) > 80:
                words.extend(text.split())
    return tuple(words)


def _haystack(task: str, n: int, words: tuple[str, ...] | None = None) -> list[str]:
    """The first n words of the task's haystack (cycled when the source is shorter): `words` when given (the
    calibration prompts' text), else the evaluation haystack (prose for single / multikey, filler for passkey)."""
    src = words or (FILLER.split() if task == "passkey" else prose_words())
    return [src[i % len(src)] for i in range(n)]


def _insert(words: list[str], needles: list[tuple[float, str]]) -> str:
    """Join words with the needles inserted at their depths, each moved back to the nearest sentence start."""
    out = list(words)
    spots = []
    for depth, needle in needles:
        i = round(depth * len(words))
        while i > 0 and not words[i - 1].endswith("."):
            i -= 1
        spots.append((i, needle))
    for i, needle in sorted(spots, key=lambda s: -s[0]):  # back to front keeps earlier positions valid
        out.insert(i, needle)
    return " ".join(out)


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _build(task: str, rng: random.Random, depth: float):
    """(prompt template taking the context, needles with depths, answer, asked needle, distractors' answers) for one
    sample."""
    if task == "passkey":
        key = str(rng.randint(10_000, 99_999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        return _PASSKEY_INTRO + "{context}" + _PASSKEY_QUESTION, [(depth, needle)], key, needle, ()
    keys = [_key(rng)]
    while len(keys) < (MULTIKEY_NEEDLES if task == "multikey" else 1):
        k = _key(rng)
        if k not in keys:
            keys.append(k)
    numbers = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
    needles = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, numbers)]
    placed = [(depth, needles[0])] + [(rng.random(), s) for s in needles[1:]]  # distractors anywhere
    template = _MAGIC_INTRO + "{context}" + _MAGIC_QUESTION.replace("{key}", keys[0])
    return template, placed, numbers[0], needles[0], tuple(numbers[1:])


def _num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text)["input_ids"])  # with the special tokens (BOS) generation will see


def tolerance(budget: int) -> int:
    """How far below its budget a prompt may end: 0.5% of it, at least 4 tokens."""
    return max(4, budget // 200)


def most_that_fit(count, budget: int, fixed: int) -> int:
    """A number of haystack words n with budget - tolerance <= count(n) <= budget, where count(n) (the prompt's
    tokens) grows about linearly from count(0) = fixed. Secant steps on tokens per word find it in a few
    tokenisations of the whole prompt; bisection (13 for 8K tokens) is the fallback."""
    lo, hi = 0, budget  # every word is at least one token, so `budget` words never fit once the rest is added
    target, n, rate = budget - tolerance(budget) // 2, budget // 2, None
    for _ in range(8):
        c = count(n)
        if budget - tolerance(budget) <= c <= budget:
            return n
        if c <= budget:
            lo = max(lo, n)
        else:
            hi = min(hi, n - 1)
        rate = max((c - fixed) / n, 0.1) if n > 0 else 1.0
        n = min(max(n + round((target - c) / rate), lo), hi)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(mid) <= budget else (lo, mid - 1)
    return lo


def make_sample(task: str, tokenizer, length: int, depth: float, rng: random.Random, max_new_tokens: int = NEW_TOKENS,
                words: tuple[str, ...] | None = None) -> Sample:
    """One prompt of `length - max_new_tokens` tokens (at most, and `tolerance` fewer at least); `words`: another
    haystack text (see `_haystack`)."""
    if task not in TASKS:
        raise ValueError(f"unknown NIAH task {task!r}; choose from {TASKS}")
    budget = length - max_new_tokens
    template, needles, answer, needle, distractors = _build(task, rng, depth)
    fixed = _num_tokens(tokenizer, template.format(context=" ".join(n for _, n in needles)))
    if fixed > budget:
        raise ValueError(f"NIAH length {length} is too short: the {task} question and needles alone take {fixed} "
                         f"tokens (+ {max_new_tokens} to generate); use a length >= {fixed + max_new_tokens + 32}")
    n = most_that_fit(lambda n: _num_tokens(tokenizer, template.format(context=_insert(_haystack(task, n, words),
                                                                                              needles))), budget, fixed)
    prompt = template.format(context=_insert(_haystack(task, n, words), needles))
    distance = len(tokenizer(prompt[prompt.index(needle):], add_special_tokens=False)["input_ids"])
    return Sample(task=task, length=length, prompt=prompt, answer=answer, depth=depth, needle=needle,
                  distance=distance, distractors=distractors)


def check_lengths(tokenizer, tasks, lengths, max_new_tokens: int = NEW_TOKENS) -> None:
    """Fail before any model loads when the shortest NIAH length cannot hold a task's question and needles (how many
    tokens they take depends on the tokenizer, so the check needs it)."""
    for task in tasks:
        make_samples(task, tokenizer, min(lengths), 1, 0, max_new_tokens)


def depths(samples: int) -> list[float]:
    """Needle depths spread evenly over the haystack, both ends included (RULER); the middle for one sample."""
    return [0.5] if samples == 1 else [i / (samples - 1) for i in range(samples)]


def make_samples(task: str, tokenizer, length: int, samples: int, seed: int = 0, max_new_tokens: int = NEW_TOKENS,
                 words: tuple[str, ...] | None = None) -> list[Sample]:
    """`samples` prompts of one task and length; the same arguments always give the same prompts."""
    rng = random.Random(f"niah:{seed}:{task}:{length}")  # str seeds are hashed with sha512: stable across runs
    return [make_sample(task, tokenizer, length, d, rng, max_new_tokens, words) for d in depths(samples)]


@torch.no_grad()
def generate_continuations(model, tokenizer, prompts: list[str], max_new_tokens: int = NEW_TOKENS, batch_size: int = 1,
                           progress=None) -> list[str]:
    """Greedy continuations of `prompts`, decoded; batches are left-padded (prompts of a (task, length) differ by
    a few tokens only). Works for the hybrid (its own cache) and for any HF causal LM."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad = 0 if pad is None else pad
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    out = []
    for i in range(0, len(encoded), batch_size):
        chunk = encoded[i:i + batch_size]
        width = max(len(x) for x in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, x in enumerate(chunk):
            ids[r, width - len(x):] = torch.tensor(x)
            mask[r, width - len(x):] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad)
        out.extend(tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True))
        if progress is not None:
            progress.update(len(chunk))
    return out


def accuracy(model, tokenizer, samples: list[Sample], max_new_tokens: int = NEW_TOKENS, batch_size: int = 1,
             progress=None, answers: list | None = None) -> float:
    """Fraction of samples whose greedy continuation contains the answer. `answers`, when given, gets one record per
    sample: what it asked, what the model said, whether that was right, whether the reply's first number is the
    answer (a stricter score: a reply that lists several numbers is right only if it starts with the answer), a
    distractor's answer (multikey), or no number at all (the model did not answer in the needle's form within
    `max_new_tokens`)."""
    texts = generate_continuations(model, tokenizer, [s.prompt for s in samples], max_new_tokens, batch_size, progress)
    right = [s.answer in t for s, t in zip(samples, texts)]
    if answers is not None:
        for s, t, r in zip(samples, texts, right):
            confused = (not r and any(d in t for d in s.distractors)) if s.distractors else None
            first = re.search(r"\d+", t)
            answers.append({"task": s.task, "length": s.length, "depth": s.depth, "distance": s.distance,
                            "answer": s.answer, "output": t, "right": r,
                            "first_right": first is not None and first.group() == s.answer,
                            "distractor": confused, "no_number": first is None})
    return sum(right) / len(samples)


REPLY_KINDS = ("first_right", "distractor", "no_number")
"""What `reply_rates` can count, beside the accuracy, in every report that scores NIAH by generation."""


def distance_bin(distance: int) -> int:
    """The bin of a needle `distance` tokens back: the power of two N >= 512 with N / 2 < distance <= N (512 for
    every distance up to 512)."""
    n = 512
    while n < distance:
        n *= 2
    return n


def reply_rates(answers: list[dict], kind: str, by: str = "length") -> dict:
    """{task: {cell: share of its replies with `kind` true}} over the records `accuracy` wrote, for the tasks where
    `kind` applies; cells are str(length), or with by="distance" str(distance_bin(distance)): how far back the
    asked needle sat, whatever the prompt's length, so a retrieval horizon shows as a fall past some distance.
    "right": the accuracy; "first_right": the strict accuracy (the reply's first number is the answer);
    "distractor" (multikey): the keys confused rather than nothing retrieved; "no_number": no answer in the needle's
    form at all, a failure of the reply's form that a wrong number is not."""
    if by not in ("length", "distance"):
        raise ValueError(f"reply_rates by={by!r}: choose 'length' or 'distance'")
    cells: dict = {}
    for a in answers:
        if a.get(kind) is not None:
            cell = a["length"] if by == "length" else distance_bin(a["distance"])
            cells.setdefault(a["task"], {}).setdefault(cell, []).append(a[kind])
    return {t: {str(n): sum(v) / len(v) for n, v in sorted(by_cell.items())} for t, by_cell in cells.items()}


def niah_scores(model, tokenizer, tasks=TASKS, lengths=LENGTHS, samples: int = 20, seed: int = 0,
                batch_size: int = 1, max_new_tokens: int = NEW_TOKENS, desc: str = "niah",
                answers: list | None = None) -> dict:
    """{task: {str(length): accuracy}}; a length beyond the model's max_position_embeddings is None (logged).
    `answers`: see `accuracy`.

    The same (tasks, lengths, samples, seed) and tokenizer give the same prompts, so teacher and hybrid are scored
    on identical samples."""
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"unknown NIAH task(s) {bad}; choose from {TASKS}")
    if samples < 1:
        raise ValueError(f"NIAH samples={samples} must be >= 1")
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    fits = [n for n in lengths if max_pos is None or n <= max_pos]
    for n in sorted(set(lengths) - set(fits)):
        log.warning("%s: skipping NIAH length %d: beyond the model's max_position_embeddings (%d)", desc, n, max_pos)
    cells = {(t, n): make_samples(t, tokenizer, n, samples, seed, max_new_tokens) for t in tasks for n in fits}
    was_training = model.training  # prompts first: a too-short length fails before any generation
    model.eval()
    scores = {t: {str(n): None for n in lengths} for t in tasks}
    with tqdm(total=len(cells) * samples, desc=desc, leave=False) as bar:
        for (task, n), batch in cells.items():
            bar.set_postfix_str(f"{task} {n}")
            scores[task][str(n)] = accuracy(model, tokenizer, batch, max_new_tokens, batch_size, bar, answers)
    model.train(was_training)
    return scores


# --- teacher-forced retrieval score: cheap enough to drive layer and head selection -----------------------------
PROBE_ROOM = 16
"""Tokens a probe's prompt leaves free below its length, for the appended answer (a few tokens): fixed, so the
probes, and the layers and heads they select, do not move with the NIAH reply budget."""

CALIB_SEED = 1_000_003
"""Seed of the calibration probes; evaluation uses --niah_seed (0 by default): different needles, and calibration
probes also read a different haystack (the calibration documents), so selection never sees an evaluation prompt."""


@dataclass
class Probe:
    """A retrieval prompt followed by its answer, as token ids: `answer` are the positions of the answer's tokens
    (predicted from the position before each), `needle` the positions of the answer's tokens inside the needle."""

    task: str
    ids: list[int]
    answer: list[int]
    needle: list[int]


def token_positions(offsets, spans) -> list[int]:
    """Positions of the tokens whose character range overlaps one of `spans` (special tokens have empty ranges)."""
    return [i for i, (a, b) in enumerate(offsets) if b > a and any(b > s and a < e for s, e in spans)]


def make_probe(sample: Sample, tokenizer) -> Probe:
    """Tokenise prompt + " " + answer once (so the answer's tokens are the ones the model would read) and locate the
    answer tokens and the needle's copy of them."""
    text = sample.prompt + " " + sample.answer
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
    except (TypeError, NotImplementedError) as e:  # slow (Python) tokenizers have no offsets
        raise ValueError(f"retrieval probes need a fast tokenizer (character offsets): {e}") from e
    start = len(sample.prompt) + 1
    at = sample.prompt.index(sample.needle)
    spans = [(at + m.start(), at + m.end()) for m in re.finditer(re.escape(sample.answer), sample.needle)]
    answer = token_positions(enc["offset_mapping"], [(start, len(text))])
    needle = token_positions(enc["offset_mapping"], spans)
    if not answer or not needle or answer[0] == 0:
        raise ValueError(f"cannot locate the answer tokens of a {sample.task} probe: the tokenizer gives no offsets")
    return Probe(task=sample.task, ids=list(enc["input_ids"]), answer=answer, needle=needle)


def calibration_probes(tokenizer, words: tuple[str, ...], tasks=TASKS, length: int = 1024, samples: int = 8,
                       seed: int = CALIB_SEED) -> list[Probe]:
    """Retrieval probes for selection: `samples` per task at `length` tokens, needles at evenly spread depths, in a
    haystack of `words` (the calibration documents), with needles from `seed`."""
    return [make_probe(s, tokenizer) for t in tasks for s in make_samples(t, tokenizer, length, samples, seed,
                                                                       PROBE_ROOM, words)]


PROBE_MIN_LENGTH = 256
"""Shortest retrieval probe: room for multikey's four needles and question, and some haystack between them."""


def probe_length(seq_len: int, config) -> int:
    """Probes are as long as the calibration rows, at least PROBE_MIN_LENGTH tokens, at most the model's context."""
    max_pos = getattr(config, "max_position_embeddings", None) or seq_len
    if max_pos < PROBE_MIN_LENGTH:
        raise ValueError(f"retrieval probes need a context of at least {PROBE_MIN_LENGTH} tokens; this model's "
                         f"max_position_embeddings is {max_pos}")
    return min(max(seq_len, PROBE_MIN_LENGTH), max_pos)


def selection_lengths(seq_len: int, config) -> list[int]:
    """Lengths of the calibration probes that choose what stays: the calibration rows' length, and one 4x longer
    that also passes every sliding window at least twice over (beyond its window a needle is reachable only through
    full-attention layers), both capped by the model's context."""
    short = probe_length(seq_len, config)
    windowed = any(t in SLIDING_TYPES for t in cached_layer_types(config))
    window = int(getattr(config, "sliding_window", None) or 0) if windowed else 0
    return list(dict.fromkeys([short, probe_length(max(4 * short, 2 * window), config)]))


def eval_probes(tokenizer, length: int, samples: int = 8, tasks=TASKS, seed: int = 0) -> list[Probe]:
    """Retrieval probes for reporting: the evaluation haystack and the needles `niah_scores` uses with the same seed."""
    return [make_probe(s, tokenizer) for t in tasks for s in make_samples(t, tokenizer, length, samples, seed,
                                                                       PROBE_ROOM)]


def fitting_probes(tokenizer, config, seq_len: int, samples: int) -> tuple[int, list[Probe]]:
    """(length, evaluation probes) at the calibration rows' length, doubled up to the model's context while the
    probes do not fit (a tokenizer with many tokens per word needs longer prompts); ValueError when none fits."""
    length = probe_length(seq_len, config)
    while True:
        try:
            return length, eval_probes(tokenizer, length, samples)
        except ValueError:
            longer = probe_length(2 * length, config)
            if longer == length:
                raise
            length = longer


@torch.no_grad()
def answer_scores(model, probes: list[Probe]) -> dict:
    """Teacher-forced retrieval score: per probe the answer's summed log-probability (nats) and whether every answer
    token is the argmax; their means overall and per task. One forward per probe, no generation."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    logprob, correct = [], []
    for p in probes:
        ids = torch.tensor([p.ids], device=device)
        rows = torch.tensor(p.answer, device=device) - 1  # the positions that predict the answer's tokens
        logits = model(input_ids=ids, use_cache=False).logits[0, rows].float()
        target = ids[0, rows + 1]
        lp = torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0]
        logprob.append(float(lp.sum()))
        correct.append(bool((logits.argmax(-1) == target).all()))
    model.train(was_training)
    out = {"logprob": sum(logprob) / len(probes), "acc": sum(correct) / len(probes), "tasks": {}}
    for task in dict.fromkeys(p.task for p in probes):
        idx = [i for i, p in enumerate(probes) if p.task == task]
        out["tasks"][task] = {"logprob": sum(logprob[i] for i in idx) / len(idx),
                              "acc": sum(correct[i] for i in idx) / len(idx)}
    return out
