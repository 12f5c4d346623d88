"""NIAH prompts (determinism, needle placement, length against the real tokenizer) and their scoring."""
import random
import re

import pytest
import torch

from taylor_calibrate.retrieval import (NEW_TOKENS, TASKS, accuracy, distance_bin, generate_continuations,
                                        make_sample, make_samples, niah_scores, reply_rates, tolerance)
from conftest import tiny_teacher


def _context(prompt: str) -> str:
    """The haystack between the instruction line and the question line."""
    return prompt.split("\n")[1]


def test_samples_are_deterministic(smollm2_tokenizer):
    for task in TASKS:
        a = make_samples(task, smollm2_tokenizer, 512, 3, seed=1)
        b = make_samples(task, smollm2_tokenizer, 512, 3, seed=1)
        c = make_samples(task, smollm2_tokenizer, 512, 3, seed=2)
        assert [s.prompt for s in a] == [s.prompt for s in b]
        assert [s.answer for s in a] != [s.answer for s in c]
        assert len({s.answer for s in a}) == 3, "each sample hides a different answer"


@pytest.mark.parametrize("task", TASKS)
def test_needle_holds_the_answer_at_its_depth(task, smollm2_tokenizer):
    samples = make_samples(task, smollm2_tokenizer, 1024, 5)
    assert [s.depth for s in samples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    for s in samples:
        ctx = _context(s.prompt)
        assert ctx.count(s.needle) == 1 and s.answer in s.needle
        assert s.prompt.count(s.answer) == (2 if task == "passkey" else 1), "the answer appears only in its needle"
        where = ctx.index(s.needle) / (len(ctx) - len(s.needle))
        assert abs(where - s.depth) < 0.06, (where, s.depth)  # needles move back to a sentence start
        if task == "multikey":
            key = re.search(r"magic number for (\S+) mentioned", s.prompt).group(1)
            assert f"The special magic number for {key} is: {s.answer}." == s.needle
            found = re.findall(r"magic number for (\S+) is: (\d{7})\.", ctx)
            assert len(found) == 4 and len({k for k, _ in found}) == 4, "four needles with distinct keys"


@pytest.mark.parametrize("task", TASKS)
def test_distance_counts_the_tokens_from_the_needle_to_the_question(task, smollm2_tokenizer):
    """A sample's distance: the tokens from its asked needle to the prompt's end, so it falls as the needle goes
    deeper, from about the prompt's length (needle first) to the needle and question (needle last)."""
    samples = make_samples(task, smollm2_tokenizer, 1024, 5)
    n = len(smollm2_tokenizer(samples[0].prompt, add_special_tokens=False)["input_ids"])
    dist = [s.distance for s in samples]
    assert dist == sorted(dist, reverse=True) and len(set(dist)) == 5
    assert n - 64 < dist[0] <= n  # only the instruction line before the first needle
    tail = samples[-1].prompt[samples[-1].prompt.index(samples[-1].needle):]
    assert dist[-1] == len(smollm2_tokenizer(tail, add_special_tokens=False)["input_ids"]) < 100


def test_replies_binned_by_distance():
    """reply_rates by="distance": cells are power-of-two bins (N/2, N] of how far back the needle sat, whatever the
    prompt's length; anything else for `by` is a clear error."""
    assert [distance_bin(d) for d in (1, 512, 513, 1024, 1025, 5000)] == [512, 512, 1024, 1024, 2048, 8192]
    answers = [{"task": "single", "length": 4096, "distance": d, "right": r}
               for d, r in ((100, True), (900, True), (1000, False), (3000, False), (3500, True))]
    answers.append({"task": "single", "length": 1024, "distance": 700, "right": True})
    assert reply_rates(answers, "right", by="distance") == {"single": {"512": 1.0, "1024": 2 / 3, "4096": 0.5}}
    assert reply_rates(answers, "right") == {"single": {"1024": 1.0, "4096": 0.6}}
    with pytest.raises(ValueError, match="choose 'length' or 'distance'"):
        reply_rates(answers, "right", by="depth")


@pytest.mark.parametrize("length", [1024, 2048])
def test_prompt_fills_the_length_in_real_tokens(length, smollm2_tokenizer):
    budget = length - NEW_TOKENS  # room for the generated tokens
    for task in TASKS:
        for s in make_samples(task, smollm2_tokenizer, length, 2):
            n = len(smollm2_tokenizer(s.prompt)["input_ids"])
            assert budget - tolerance(budget) <= n <= budget, (task, n)


def test_too_short_length_is_a_clear_error(smollm2_tokenizer):
    with pytest.raises(ValueError, match="too short.*use a length >="):
        make_sample("multikey", smollm2_tokenizer, 128, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="unknown NIAH task"):
        niah_scores(torch.nn.Linear(1, 1), smollm2_tokenizer, tasks=("haystack",))


class StubLM(torch.nn.Module):
    """Answers every prompt by reading the asked needle out of it (oracle), with a wrong number, (`confuse`) with
    another key's number where there is one, (`mute`) with words and no number, or (`late`) with a wrong number
    before the answer."""

    def __init__(self, tokenizer, right: bool, max_positions: int = 4096, confuse: bool = False, mute: bool = False,
                 late: bool = False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"max_position_embeddings": max_positions})()
        self.tok, self.right, self.confuse, self.mute, self.late, self.calls = tokenizer, right, confuse, mute, late, []

    def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
        self.calls.append(tuple(input_ids.shape))
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            assert mask.cummax(0).values.equal(mask), "padding must be on the left"
            text = self.tok.decode(ids[mask.bool()])
            key = re.search(r"magic number for (\S+) mentioned", text)
            pattern = rf"magic number for {key.group(1)} is: (\d+)\." if key else r"The pass key is (\d+)\."
            answer = re.search(pattern, text).group(1) if self.right else "0000000"
            others = [n for k, n in re.findall(r"magic number for (\S+) is: (\d+)\.", text) if key and k != key.group(1)]
            if self.confuse and others:
                answer = others[0]
            if self.mute:
                answer = "\nthe special magic number for the key"
            if self.late:
                answer = f"1234 or {answer}"
            new = self.tok(f" {answer}.", add_special_tokens=False)["input_ids"][:max_new_tokens]
            rows.append(new + [kw["pad_token_id"]] * (max_new_tokens - len(new)))
        return torch.cat([input_ids, torch.tensor(rows)], 1)


def test_strict_score_wants_the_answer_as_the_replys_first_number(smollm2_tokenizer):
    """A reply that holds the answer after another number is right, but not by the strict (first number) score."""
    for late, first in ((False, 1.0), (True, 0.0)):
        answers = []
        scores = niah_scores(StubLM(smollm2_tokenizer, True, late=late), smollm2_tokenizer, lengths=(512,), samples=2,
                             answers=answers)
        assert scores == {t: {"512": 1.0} for t in TASKS}
        assert reply_rates(answers, "first_right") == {t: {"512": first} for t in TASKS}


def test_scores_one_for_right_answers_zero_for_wrong(smollm2_tokenizer):
    for right in (True, False):
        stub = StubLM(smollm2_tokenizer, right, max_positions=1024)
        scores = niah_scores(stub, smollm2_tokenizer, lengths=(512, 1024, 2048), samples=3, batch_size=2)
        want = 1.0 if right else 0.0
        assert scores == {t: {"512": want, "1024": want, "2048": None} for t in TASKS}, scores
        assert [b for b, _ in stub.calls] == [2, 1] * 6, "3 samples per cell in batches of 2"


@pytest.mark.parametrize("right, confuse, mute, rate", [(True, False, False, 0.0), (False, False, False, 0.0),
                                                       (False, True, False, 1.0), (False, False, True, 0.0)])
def test_answers_record_every_reply_and_multikey_key_confusions(smollm2_tokenizer, right, confuse, mute, rate):
    """A wrong answer that is another needle's number counts as a key confusion; only multikey has distractors. A
    reply without any number is told apart from a wrong number, in every task."""
    stub = StubLM(smollm2_tokenizer, right, confuse=confuse, mute=mute)
    answers = []
    scores = niah_scores(stub, smollm2_tokenizer, lengths=(512,), samples=2, answers=answers)
    assert len(answers) == 3 * 2 and all(a["right"] == right for a in answers)
    assert all(0 < a["distance"] <= 512 for a in answers) and reply_rates(answers, "right", by="distance") == \
        {t: {"512": float(right)} for t in TASKS}
    assert all((a["answer"] in a["output"]) == right for a in answers)  # the reply as the model gave it
    assert [a["distractor"] is None for a in answers] == [t != "multikey" for t in TASKS for _ in range(2)]
    assert reply_rates(answers, "distractor") == {"multikey": {"512": rate}}
    assert reply_rates(answers, "no_number") == {t: {"512": float(mute)} for t in TASKS}
    assert scores["multikey"]["512"] == float(right)


def test_batched_generation_equals_one_by_one(smollm2_tokenizer, single_thread):
    """Left padding must not change a greedy continuation, for a plain HF model and for the hybrid."""
    from taylor_calibrate.config import GDNConfig
    from taylor_calibrate.model.hybrid import convert_teacher

    teacher = tiny_teacher("llama", vocab_size=len(smollm2_tokenizer))
    hybrid = convert_teacher(teacher, [1, 2], GDNConfig())
    samples = make_samples("single", smollm2_tokenizer, 256, 2) + make_samples("passkey", smollm2_tokenizer, 200, 1)
    prompts = [s.prompt for s in samples]
    assert len({len(smollm2_tokenizer(p)["input_ids"]) for p in prompts}) > 1, "the batch needs padding"
    for model in (teacher, hybrid):
        one = generate_continuations(model, smollm2_tokenizer, prompts, max_new_tokens=6, batch_size=1)
        assert generate_continuations(model, smollm2_tokenizer, prompts, max_new_tokens=6, batch_size=3) == one
        assert accuracy(model, smollm2_tokenizer, samples, 6, 3) == 0.0, "a random model cannot know the numbers"


class _Copier(torch.nn.Module):
    """Predicts the token that followed the longest earlier match of the current suffix (an induction / copy model);
    `copy=False` predicts uniformly. Teacher-forced retrieval must tell the two apart."""

    def __init__(self, vocab: int, copy: bool):
        super().__init__()
        self.vocab, self.copy = vocab, copy
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **kwargs):
        ids = input_ids[0].tolist()
        logits = torch.zeros(1, len(ids), self.vocab)
        if self.copy:
            for t in range(len(ids)):
                best, nxt = 0, None
                for j in range(t):
                    k = 0
                    while k <= j and ids[j - k] == ids[t - k]:
                        k += 1
                    if k > best:
                        best, nxt = k, ids[j + 1]
                if nxt is not None:
                    logits[0, t, nxt] = 30.0
        return type("Out", (), {"logits": logits})()


def test_answer_score_separates_a_model_that_copies_from_one_that_cannot(smollm2_tokenizer):
    from taylor_calibrate.retrieval import answer_scores, make_probe

    probes = [make_probe(s, smollm2_tokenizer) for s in make_samples("passkey", smollm2_tokenizer, 256, 3, seed=5)]
    for p in probes:  # the answer's tokens sit after the prompt, the needle's copy inside it
        assert p.answer[0] == len(p.ids) - len(p.answer) and max(p.needle) < p.answer[0]
    vocab = len(smollm2_tokenizer)
    good = answer_scores(_Copier(vocab, copy=True), probes)
    bad = answer_scores(_Copier(vocab, copy=False), probes)
    assert good["acc"] == 1.0 and bad["acc"] == 0.0
    assert good["logprob"] > -0.01 and bad["logprob"] < -10, (good, bad)


def test_retrieval_heads_are_attention_masses(single_thread):
    """Per layer and query head a mean attention mass in [0, 1], the same on a rerun (tiny random Llama)."""
    from taylor_calibrate.retrieval import Probe
    from taylor_calibrate.stats import retrieval_heads

    teacher = tiny_teacher("llama")
    g = torch.Generator().manual_seed(0)
    probes = [Probe("single", torch.randint(0, 97, (40,), generator=g).tolist(), [37, 38, 39], [10, 11, 12])
              for _ in range(2)]
    a, b = retrieval_heads(teacher, probes), retrieval_heads(teacher, probes)
    assert a.shape == (4, 4) and torch.equal(a, b)
    assert (a >= 0).all() and (a <= 1).all() and a.sum() > 0
