"""RULER-style task generators: seeded prompts at a token length, with their answers.

Each generator takes ``(rng, length, count)`` (``count`` = the model's token counter) and
returns ``(prompt, answers, metric, max_tokens)``; ``make_samples`` runs them for every task,
length and sample index with an RNG of its own, so a prompt never depends on the others.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.quality.words import (
    CITIES,
    COMMON_WORD_POOL,
    FIRST_NAMES,
    HOBBIES,
    KEY_ADJECTIVES,
    KEY_NOUNS,
    LAST_NAMES,
    OBJECTS,
    PROFESSIONS,
    SUBJECTS,
    TAILS,
    VERBS,
)

TokenCounter = Callable[[str], int]


@dataclass
class Sample:
    """One prompt with its references. ``metric``: "all" = fraction of references found,
    "any" = 1 if one is found."""

    task: str
    length: int
    index: int
    prompt: str
    answers: list[str]
    metric: str
    max_tokens: int


def magic_number(rng: random.Random) -> str:
    return str(rng.randint(100000, 999999))


def needle_key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(KEY_ADJECTIVES)}-{rng.choice(KEY_NOUNS)}"
        if key not in taken:
            taken.add(key)
            return key


def filler_sentence(rng: random.Random) -> str:
    return " ".join(
        (rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(TAILS))
    )


def fill_haystack(rng: random.Random, budget: int, count: TokenCounter,
                  needles: Sequence[str], depths: Sequence[float],
                  filler: Callable[[random.Random], str] = filler_sentence) -> list[str]:
    """Sentences from ``filler`` totalling about ``budget`` tokens with ``needles`` at
    relative ``depths`` (0 = start, 1 = end), in the order given."""
    sentences: list[str] = []
    used = sum(count(" " + needle) for needle in needles)
    while True:
        sentence = filler(rng)
        cost = count(" " + sentence)
        if used + cost > budget:
            break
        sentences.append(sentence)
        used += cost
    positions = [round(depth * len(sentences)) for depth in depths]
    # insert from the back so earlier positions stay valid; ties keep the given order
    for position, needle in sorted(zip(positions, needles), key=lambda p: p[0], reverse=True):
        sentences.insert(position, needle)
    return sentences


def assemble(rng: random.Random, length: int, count: TokenCounter, header: str, question: str,
             needles: Sequence[str], depths: Sequence[float]) -> str:
    """header + haystack with needles + question, at most ``length`` tokens, as close as the
    filler's granularity allows: filler is dropped from the end until the prompt fits."""
    fixed = count(f"{header}\n\n\n\n{question}")
    sentences = fill_haystack(rng, max(0, length - fixed), count, needles, depths)
    needle_set = set(needles)
    while True:
        prompt = f"{header}\n\n{' '.join(sentences)}\n\n{question}"
        if count(prompt) <= length:
            return prompt
        for i in range(len(sentences) - 1, -1, -1):  # drop the last filler sentence
            if sentences[i] not in needle_set:
                del sentences[i]
                break
        else:
            raise ValueError(f"cannot fit the needles and question in {length} tokens")


def spread_depths(rng: random.Random, n: int, low: float = 0.05, high: float = 0.95) -> list[float]:
    """n sorted depths, one in each of n equal bands of [low, high] (evenly spread, jittered)."""
    width = (high - low) / n
    return [low + width * (i + rng.random()) for i in range(n)]


NIAH_HEADER = (
    "Some special magic numbers are hidden inside the following text. Make sure to memorize "
    "them. I will quiz you about the numbers afterwards."
)


def make_niah_single(rng: random.Random, length: int, count: TokenCounter) -> tuple:
    key, value = needle_key(rng, set()), magic_number(rng)
    needle = f"The special magic number for {key} is {value}."
    question = (f"What is the special magic number for {key} mentioned in the text? "
                f"The special magic number for {key} is")
    depth = rng.uniform(0.05, 0.95)
    prompt = assemble(rng, length, count, NIAH_HEADER, question, [needle], [depth])
    return prompt, [value], "all", 12


PASSKEY_HEADER = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it."
)


def make_passkey(rng: random.Random, length: int, count: TokenCounter) -> tuple:
    """The classic passkey retrieval: one five-digit key in filler, asked at the very end
    (the question lies inside the observation window)."""
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    question = "What is the pass key? The pass key is"
    prompt = assemble(rng, length, count, PASSKEY_HEADER, question, [needle],
                      [rng.uniform(0.05, 0.95)])
    return prompt, [key], "all", 10


def make_niah_multikey(rng: random.Random, length: int, count: TokenCounter,
                       num_keys: int = 4) -> tuple:
    taken: set[str] = set()
    keys = [needle_key(rng, taken) for _ in range(num_keys)]
    values = [magic_number(rng) for _ in range(num_keys)]
    needles = [f"The special magic number for {k} is {v}." for k, v in zip(keys, values)]
    order = list(range(num_keys))
    rng.shuffle(order)
    target = rng.randrange(num_keys)
    question = (f"What is the special magic number for {keys[target]} mentioned in the text? "
                f"The special magic number for {keys[target]} is")
    prompt = assemble(rng, length, count, NIAH_HEADER, question, [needles[i] for i in order],
                      spread_depths(rng, num_keys))
    return prompt, [values[target]], "all", 12


def make_niah_multivalue(rng: random.Random, length: int, count: TokenCounter,
                         num_values: int = 3) -> tuple:
    key = needle_key(rng, set())
    values = [magic_number(rng) for _ in range(num_values)]
    needles = [f"One of the special magic numbers for {key} is {v}." for v in values]
    question = (f"What are all the special magic numbers for {key} mentioned in the text? "
                f"The special magic numbers for {key} are")
    prompt = assemble(rng, length, count, NIAH_HEADER, question, needles,
                      spread_depths(rng, num_values))
    return prompt, values, "all", 10 * num_values


def variable_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name


def make_variable_tracking(rng: random.Random, length: int, count: TokenCounter,
                           hops: int = 2, chains: int = 1) -> tuple:
    """``chains`` assignment chains (VAR A = 12345. VAR B = VAR A. ...) with ``hops`` copies
    each, interleaved through the filler; name every variable of the first chain's value."""
    taken: set[str] = set()
    values = rng.sample(range(10000, 100000), chains)
    names = [[variable_name(rng, taken) for _ in range(hops + 1)] for _ in range(chains)]
    per_chain = [
        [f"VAR {chain[0]} = {value}."] + [f"VAR {chain[i + 1]} = VAR {chain[i]}." for i in
                                           range(hops)]
        for chain, value in zip(names, values)
    ]
    statements = [s for step in zip(*per_chain) for s in step]  # hop by hop, chains mixed
    header = ("Memorize and track the chain of variable assignments hidden in the following "
              "text.")
    value = values[0]
    question = (f"Question: Find all variables that are assigned the value {value} in the text "
                f"above. Answer: According to the chain of variable assignment in the text "
                f"above, {hops + 1} variables are assigned the value {value}, they are: VAR")
    prompt = assemble(rng, length, count, header, question, statements,
                      spread_depths(rng, len(statements)))
    return prompt, names[0], "all", 8 * (hops + 1)


def make_common_words(rng: random.Random, length: int, count: TokenCounter,
                      num_common: int = 3, share: float = 0.25) -> tuple:
    """A numbered word list where ``num_common`` words each fill ``share`` of the entries
    and every other word appears at most twice."""
    header = ("Below is a numbered list of words. In these words, some appear more often than "
              "others. Memorize the ones that appear most often.")
    question = (f"Question: What are the {num_common} most common words in the above list? "
                f"Answer: The top {num_common} words that appear most often in the list are:")
    words = list(dict.fromkeys(COMMON_WORD_POOL))
    rng.shuffle(words)
    common, rare = words[:num_common], words[num_common:]
    list_seed = rng.random()

    def build(entries: int) -> list[str]:
        local = random.Random(list_seed)  # same list for a given size, whatever the retries
        repeats = max(3, round(share * entries))
        items = [word for word in common for _ in range(repeats)]
        rare_cycle = [word for word in rare for _ in range(2)]
        local.shuffle(rare_cycle)
        items += rare_cycle[: max(0, entries - len(items))]
        local.shuffle(items)
        return items

    def render(items: list[str]) -> str:
        body = " ".join(f"{i + 1}. {word}" for i, word in enumerate(items))
        return f"{header}\n\n{body}\n\n{question}"

    fixed = count(render([]))
    entries = max(10, (length - fixed) // count(" 100. lantern"))
    for _ in range(3):  # entry numbers grow longer with the list: rescale on measured size
        used = count(render(build(entries))) - fixed
        entries = max(10, int(entries * (length - fixed) / max(used, 1)))
    items = build(entries)
    while count(render(items)) > length and len(items) > 10:
        items.pop(next(i for i in range(len(items) - 1, -1, -1) if items[i] not in common))
    return render(items), common, "all", 6 * num_common


def unique_names(rng: random.Random) -> list[str]:
    """Full names in which no first and no last name repeats (until a pool runs out): people
    who share a name part are easy to confuse for a small model."""
    firsts, lasts = list(FIRST_NAMES), list(LAST_NAMES)
    rng.shuffle(firsts)
    rng.shuffle(lasts)
    names = [f"{f} {last}" for f, last in zip(firsts, lasts)]
    rest = [f"{f} {last}" for f in FIRST_NAMES for last in LAST_NAMES if f"{f} {last}" not in names]
    rng.shuffle(rest)
    return names + rest


QA_QUESTIONS = {
    "city": ("In which city does {name} live?", "{name} lives in the city of"),
    "job": ("What does {name} work as?", "{name} works as a"),
    "hobby": ("What does {name} love in free time?", "In free time, {name} loves"),
}


def make_qa(rng: random.Random, length: int, count: TokenCounter, num_docs: int = 6) -> tuple:
    """``num_docs`` documents, each about one person: three facts (city, job, hobby) among
    filler sentences; one question about one attribute of one person."""
    header = ("Answer the question based on the documents below. Each document describes a "
              "different person.")
    people = [
        {"name": name, "city": rng.choice(CITIES), "job": rng.choice(PROFESSIONS),
         "hobby": rng.choice(HOBBIES)}
        for name in unique_names(rng)[:num_docs]
    ]
    target = people[rng.randrange(num_docs)]
    attribute = rng.choice(sorted(QA_QUESTIONS))
    ask, prefix = QA_QUESTIONS[attribute]
    question = f"Question: {ask.format(name=target['name'])}\nAnswer: " + prefix.format(
        name=target["name"])
    fixed = count(f"{header}\n\n\n\n{question}") + num_docs * count("\nDocument 10:")
    per_doc = max(0, (length - fixed) // num_docs)
    docs: list[list[str]] = []
    facts: set[str] = set()
    for person in people:
        name = person["name"]  # the full name in every fact: only this document answers
        mine = [f"{name} lives in the city of {person['city']}.",
                f"{name} works as a {person['job']}.",
                f"In free time, {name} loves {person['hobby']}."]
        rng.shuffle(mine)
        facts.update(mine)
        docs.append(fill_haystack(rng, per_doc, count, mine, spread_depths(rng, len(mine))))

    def render() -> str:
        body = "\n".join(f"Document {i + 1}: {' '.join(doc)}" for i, doc in enumerate(docs))
        return f"{header}\n\n{body}\n\n{question}"

    prompt = render()
    while count(prompt) > length:  # tokenization drift: drop filler, else a whole document
        with_filler = [doc for doc in docs if any(sentence not in facts for sentence in doc)]
        if with_filler:
            doc = max(with_filler, key=len)
            del doc[max(i for i, sentence in enumerate(doc) if sentence not in facts)]
        else:
            others = [i for i, person in enumerate(people) if person is not target]
            if not others:
                raise ValueError(f"no document fits in {length} tokens")
            del docs[others[-1]], people[others[-1]]
        prompt = render()
    return prompt, [target[attribute]], "any", 8


QUESTION_SEPARATOR = "\n\n"  # every task's prompt: context, a blank line, the question


def split_question(prompt: str) -> tuple[str, str]:
    """``(context, question)`` of a task's prompt, ``context + question == prompt``: the
    question (with its answer prefix) starts at the last blank line, which it keeps. The
    question-outside mode compresses the context alone and asks the question after it."""
    cut = prompt.rfind(QUESTION_SEPARATOR)
    if cut <= 0:
        raise ValueError("the prompt has no blank line before its question")
    return prompt[:cut], prompt[cut:]


TASKS: dict[str, Callable[..., tuple]] = {
    "passkey": make_passkey,
    "niah_single": make_niah_single,
    "niah_multikey": make_niah_multikey,
    "niah_multivalue": make_niah_multivalue,
    "variable_tracking": make_variable_tracking,
    "common_words": make_common_words,
    "qa": make_qa,
}


def make_samples(tasks: Sequence[str], lengths: Sequence[int], samples: int, seed: int,
                 count: TokenCounter) -> list[Sample]:
    """Deterministic: each (task, length, index) has its own RNG derived from the seed."""
    out = []
    for task in tasks:
        for length in lengths:
            for index in range(samples):
                rng = random.Random(f"{seed}/{task}/{length}/{index}")
                prompt, answers, metric, max_tokens = TASKS[task](rng, length, count)
                out.append(Sample(task, length, index, prompt, answers, metric, max_tokens))
    return out
