"""In-context recall in natural language: a phonebook, then questions about it.

A context of ``length`` tokens lists people and their numbers ("Alice Smith's number is 555-0192."), then asks
``n_queries`` of them in turn ("What is Alice Smith's number? Alice Smith's number is 555-0192."). The answer is
the four random digits after "555-" (the rest of the line is predictable from the format), scored by *greedy
exact match*: every token of it is the model's argmax given all that precedes it. That is what greedy decoding
would write, read from one teacher-forced forward per context instead of a decode loop per query (later
questions see the earlier answers, as a reader of a transcript would; the looked-up entries are far back in the
list either way).

Why exact match and not the rank of the right number among candidates: the digits are random, so a model that
does not retrieve cannot write them (chance is 10^-4 per answer, 0 in practice) and any hit is retrieval; the
rank among k candidates would put chance at 1/k. Beside it, ``token_acc`` (the share of answer tokens that are
the argmax: chance 1/10 for single-digit tokens) and the answers' mean log-probability give a graded signal for
members that rarely get all four digits: on SmolLM2-135M the exact match is low (a small model often slips one
digit), so read the three together.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

FIRST = ("Alice", "Bruno", "Chen", "Dana", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kemal", "Lena",
         "Marco", "Nadia", "Omar", "Paula", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wendy", "Xavier",
         "Yara", "Zane", "Amir", "Beth", "Carlos", "Daria", "Emil", "Fiona", "Gus", "Hana", "Ivan", "Julia")
LAST = ("Smith", "Novak", "Garcia", "Okafor", "Tanaka", "Rossi", "Muller", "Larsen", "Dubois", "Kowalski",
        "Haddad", "Silva", "Nguyen", "Petrov", "Brennan", "Costa", "Ivanova", "Fischer", "Moreau", "Lindqvist",
        "Sato", "Keller", "Park", "Adeyemi", "Horvat", "Jensen", "Reyes", "Schmidt", "Yilmaz", "Ward")
HEADER = "Here is a phone book.\n\n"
QUESTIONS = "\nQuestions about the phone book above.\n"


@dataclass
class Probe:
    """One context: ``ids`` and, per query, the ``[start, end)`` positions of its answer's tokens."""

    ids: list[int]
    answers: list[tuple[int, int]]


def make_probe(tokenizer, length: int, n_queries: int, seed: int) -> Probe:
    """A phonebook context of about ``length`` tokens (within a few) ending in ``n_queries`` answered questions
    about entries drawn from the whole book."""
    rng = random.Random(seed)
    people = [f"{f} {s}" for f in FIRST for s in LAST]
    rng.shuffle(people)
    numbers = rng.sample(range(10000), len(people))

    def answer(k: int) -> str:  # the four random digits: everything else in the line is predictable
        return f"{numbers[k]:04d}"

    def question(k: int) -> str:
        return f"What is {people[k]}'s number? {people[k]}'s number is 555-"

    ids = tokenizer.encode(HEADER)
    # the queries' length, estimated from entries asked about the first people (names and numbers vary little)
    q_tokens = len(tokenizer.encode(QUESTIONS, add_special_tokens=False)) + sum(
        len(tokenizer.encode(question(k) + answer(k) + ".\n", add_special_tokens=False)) for k in range(n_queries))
    budget = length - q_tokens - 8
    entries = 0
    while entries < len(people):
        line = tokenizer.encode(f"{people[entries]}'s number is 555-{answer(entries)}.\n", add_special_tokens=False)
        if len(ids) + len(line) > budget:
            break
        ids += line
        entries += 1
    if entries < n_queries:
        raise ValueError(f"a {length}-token context holds {entries} phone book entries, fewer than the {n_queries} "
                         f"queries; give a longer length or fewer queries")
    ids += tokenizer.encode(QUESTIONS, add_special_tokens=False)
    answers = []
    for k in rng.sample(range(entries), n_queries):
        ids += tokenizer.encode(question(k), add_special_tokens=False)
        a = tokenizer.encode(answer(k), add_special_tokens=False)
        answers.append((len(ids), len(ids) + len(a)))
        ids += a + tokenizer.encode(".\n", add_special_tokens=False)
    return Probe(ids, answers)


@torch.no_grad()
def score_probe(model, probe: Probe) -> tuple[list[bool], list[float], list[float]]:
    """Per query: greedy exact match of its answer, the share of its tokens that are the argmax, and the answer
    tokens' mean log-probability."""
    positions = torch.tensor([p - 1 for s, e in probe.answers for p in range(s, e)])
    device = next(model.parameters()).device
    ids = torch.tensor([probe.ids], device=device)
    logits = model(ids, logits_to_keep=positions.to(device))[0].float()
    targets = ids[0, positions + 1]
    hit = logits.argmax(-1) == targets
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    exact, token_acc, mean_logp, i = [], [], [], 0
    for s, e in probe.answers:
        exact.append(bool(hit[i:i + e - s].all()))
        token_acc.append(float(hit[i:i + e - s].float().mean()))
        mean_logp.append(float(logp[i:i + e - s].mean()))
        i += e - s
    return exact, token_acc, mean_logp


def recall(model, tokenizer, *, lengths=(1024, 4096), n_queries: int = 16, contexts: int = 2, seed: int = 0,
           progress: bool = True) -> dict[int, dict]:
    """Per context length: greedy exact-match accuracy over ``contexts`` x ``n_queries`` queries, its 95% Wilson
    interval, the answer tokens' argmax accuracy and their mean log-probability."""
    from tqdm import tqdm

    from .intervals import wilson

    out = {}
    jobs = [(L, c) for L in lengths for c in range(contexts)]
    results: dict[int, tuple[list, list, list]] = {L: ([], [], []) for L in lengths}
    for L, c in tqdm(jobs, desc="recall probe", unit="context", disable=not progress):
        for acc, got in zip(results[L], score_probe(model, make_probe(tokenizer, L, n_queries, seed * 1000 + c)),
                            strict=True):
            acc.extend(got)
    for L, (exact, token_acc, logp) in results.items():
        k, n = sum(exact), len(exact)
        lo, hi = wilson(k, n)
        out[L] = {"exact": k / n, "ci95": [lo, hi], "n": n, "token_acc": sum(token_acc) / n,
                  "mean_answer_logprob": sum(logp) / n}
    return out
