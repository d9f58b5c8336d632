#!/usr/bin/env python
"""Long-context quality: RULER-style synthetic tasks, full cache vs every compression method.

Tasks are generated here from a seed (no data sets, no downloads) at token lengths inside the
model's context, run greedily through vLLM for the full cache (vanilla vLLM) and for each method
at each budget, and scored by string match against the known answers:

    niah_single        one "special magic number" hidden in filler text
    niah_multikey      the same, among distractor needles with other keys
    niah_multivalue    one key with several values: all must be recalled
    variable_tracking  VAR X = 12345, VAR Y = VAR X, ...: name every variable holding the value
    common_words       a long numbered word list: name the most frequent words
    qa                 questions on one of many short synthetic biographies

    python benchmarks/quality.py                                   # defaults (CPU: ~25 min)
    python benchmarks/quality.py --lengths 1024,2048,4096 --samples 10 --budgets 64,128,256,512,2048

Reported per configuration: accuracy per task (mean over samples and lengths), the fraction of
the full cache's accuracy retained, and fidelity: how much of the full cache's greedy output
the configuration reproduces token for token (common prefix / full-cache output length).
A budget at or above every prompt length evicts nothing; such configurations are not run and
are reported as the full cache (marked ``not_run``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import string
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    METHODS,
    RESULTS_DIR,
    CompressionSpec,
    EngineSettings,
    Reporter,
    command_string,
    default_model_dir,
    default_threads,
    detect_device,
    format_table,
    kv_bytes_per_token,
    machine_info,
    make_workdir,
    model_shape,
    parse_ints,
    parse_kv_options,
    parse_names,
    resolve_dtype,
    run_jobs,
    worker_env,
    worker_main,
    write_json,
)

TokenCounter = Callable[[str], int]

# ----------------------------------------------------------------------------- word pools
SUBJECTS = (
    "The farmer", "A young engineer", "The old captain", "My neighbour", "The librarian",
    "A tired student", "The baker", "The pilot", "Our teacher", "The gardener", "A quiet painter",
    "The doctor", "The shopkeeper", "A travelling musician", "The mayor", "The fisherman",
)
VERBS = (
    "repaired", "painted", "sold", "borrowed", "described", "carried", "cleaned", "found",
    "photographed", "measured", "moved", "admired", "ignored", "wrapped", "checked", "lost",
)
OBJECTS = (
    "the wooden fence", "a blue bicycle", "the kitchen table", "an old map", "the garden gate",
    "a heavy box", "the red boat", "a small lamp", "the stone bridge", "a broken clock",
    "the village bell", "a basket of apples", "the green door", "a pair of boots",
    "the long ladder", "a bundle of letters",
)
TAILS = (
    "before lunch.", "in the rain.", "on Tuesday.", "near the river.", "after the storm.",
    "with great care.", "for the third time.", "without a word.", "at dawn.",
    "during the festival.", "while humming a song.", "for a neighbour.", "in the old barn.",
    "next to the market.", "late in the evening.", "as the bells rang.",
)
KEY_ADJECTIVES = (
    "amber", "silent", "crimson", "frozen", "golden", "hollow", "ivory", "jagged", "lunar",
    "misty", "noble", "olive", "rapid", "scarlet", "tidal", "velvet", "wild", "young", "azure",
    "bitter",
)
KEY_NOUNS = (
    "falcon", "river", "lantern", "meadow", "harbor", "canyon", "orchard", "glacier", "compass",
    "willow", "thunder", "pebble", "cactus", "anchor", "beacon", "dragon", "violin", "marble",
    "tulip", "comet",
)
COMMON_WORD_POOL = (
    "apple", "bread", "chair", "dance", "eagle", "flute", "grape", "house", "island", "jacket",
    "kettle", "lemon", "mirror", "needle", "ocean", "pencil", "quilt", "rabbit", "saddle",
    "tiger", "umbrella", "valley", "wagon", "yellow", "zebra", "anchor", "button", "candle",
    "dragon", "engine", "forest", "garden", "hammer", "insect", "jungle", "kitten", "ladder",
    "market", "napkin", "orange", "parrot", "rocket", "silver", "tunnel", "violet", "window",
    "basket", "cactus", "donkey", "feather", "goblet", "helmet", "iceberg", "jigsaw", "lantern",
    "meadow", "noodle", "oyster", "pillow", "ribbon", "spider", "teapot", "walnut", "blanket",
    "carrot", "desert", "falcon", "guitar", "harbor", "marble", "pepper", "rubber", "shadow",
    "tomato", "velvet", "whistle", "bottle", "castle", "dolphin", "forest", "glove", "honey",
    "kingdom", "lizard", "mountain", "nectar", "pirate", "puzzle", "river", "salmon", "thunder",
)
FIRST_NAMES = (
    "Alice", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas",
    "Kira", "Lucas", "Mira", "Nadia", "Oscar", "Petra", "Quentin", "Rosa", "Stefan", "Tanya",
    "Umar", "Vera", "Walter", "Yara", "Zoltan", "Amelia", "Boris", "Celine", "Diego", "Esther",
)
LAST_NAMES = (
    "Abbott", "Brennan", "Castillo", "Dalton", "Eriksen", "Fischer", "Garner", "Holloway",
    "Ivanova", "Jensen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov",
    "Quinn", "Romano", "Sato", "Thorne", "Ueda", "Varga", "Whitaker", "Yilmaz", "Zimmer",
)
CITIES = (
    "Lisbon", "Oslo", "Nairobi", "Toronto", "Kyoto", "Lima", "Dublin", "Prague", "Cairo",
    "Madrid", "Vienna", "Helsinki", "Seoul", "Havana", "Athens", "Warsaw", "Bogota", "Manila",
    "Zurich", "Denver", "Glasgow", "Osaka", "Quito", "Riga", "Tallinn", "Tunis", "Accra", "Perth",
    "Lyon", "Porto", "Krakow", "Bergen", "Geneva", "Austin", "Boston", "Chicago", "Seattle",
    "Hamburg", "Munich", "Naples", "Venice", "Florence", "Seville", "Valencia", "Marseille",
)
PROFESSIONS = (
    "architect", "baker", "carpenter", "dentist", "electrician", "florist", "geologist",
    "historian", "journalist", "lawyer", "mechanic", "nurse", "pharmacist", "plumber",
    "sculptor", "surgeon", "tailor", "veterinarian", "violinist", "zoologist", "astronomer",
    "chemist", "economist", "firefighter", "locksmith", "photographer", "pilot", "translator",
)
HOBBIES = (
    "chess", "fishing", "gardening", "knitting", "painting", "pottery", "rowing", "sailing",
    "skiing", "surfing", "swimming", "climbing", "archery", "cycling", "dancing", "fencing",
    "juggling", "origami", "photography", "singing", "tennis", "volleyball", "woodworking",
)
BIO_FILLERS = (
    "{first} enjoys long walks on quiet weekends.",
    "Friends describe {first} as patient and curious.",
    "{first} keeps a small notebook full of sketches.",
    "Every morning {first} drinks a cup of strong tea.",
    "{first} once spent a summer volunteering at a library.",
    "{first} prefers trains to planes when travelling.",
    "Neighbours often ask {first} for advice.",
    "{first} collects postcards from faraway places.",
)


# ----------------------------------------------------------------------------- samples
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
                  needles: Sequence[str], depths: Sequence[float]) -> list[str]:
    """Filler sentences totalling about ``budget`` tokens with ``needles`` at relative
    ``depths`` (0 = start, 1 = end), in the order given."""
    sentences: list[str] = []
    used = sum(count(" " + needle) for needle in needles)
    while True:
        sentence = filler_sentence(rng)
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


TASKS: dict[str, Callable[..., tuple]] = {
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


# ----------------------------------------------------------------------------- scoring
def contains(text: str, reference: str) -> bool:
    """``reference`` as a whole word / number in ``text`` (case-insensitive)."""
    pattern = r"(?<![A-Za-z0-9])" + re.escape(reference) + r"(?![A-Za-z0-9])"
    return re.search(pattern, text, flags=re.IGNORECASE) is not None


def score(text: str, answers: Sequence[str], metric: str) -> float:
    found = [contains(text, answer) for answer in answers]
    if metric == "any":
        return float(any(found))
    return sum(found) / len(found)


def prefix_agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Share of the reference (full-cache) greedy tokens reproduced before the first change."""
    if not reference:
        return 1.0
    same = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        same += 1
    return same / len(reference)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_config(samples: Sequence[Sample], outputs: Sequence[dict[str, Any]],
                     reference: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
    """Accuracy per task and per (task, length), mean over tasks, fidelity to the reference."""
    scores = [score(o["text"], s.answers, s.metric) for s, o in zip(samples, outputs)]
    tasks = list(dict.fromkeys(s.task for s in samples))
    lengths = sorted({s.length for s in samples})
    per_task = {t: mean([x for s, x in zip(samples, scores) if s.task == t]) for t in tasks}
    per_length = {
        f"{t}@{n}": mean([x for s, x in zip(samples, scores) if s.task == t and s.length == n])
        for t in tasks for n in lengths
    }
    result: dict[str, Any] = {
        "accuracy": mean([per_task[t] for t in tasks]),  # macro average over tasks
        "per_task": per_task,
        "per_task_length": per_length,
        "per_length": {
            str(n): mean([x for s, x in zip(samples, scores) if s.length == n]) for n in lengths
        },
        "scores": scores,
    }
    if reference is not None:
        agree = [prefix_agreement(o["token_ids"], r["token_ids"])
                 for o, r in zip(outputs, reference)]
        exact = [float(o["token_ids"] == r["token_ids"]) for o, r in zip(outputs, reference)]
        result["fidelity"] = mean(agree)
        result["exact_match_full"] = mean(exact)
    return result


def add_retained(rows: list[dict[str, Any]], full: dict[str, Any]) -> None:
    """Fraction of the full cache's accuracy kept, overall and per task (None if full is 0)."""
    for row in rows:
        if not row.get("ok"):
            continue
        base = full.get("accuracy")
        row["retained"] = row["accuracy"] / base if base else None
        row["retained_per_task"] = {
            task: (acc / full["per_task"][task] if full["per_task"].get(task) else None)
            for task, acc in row["per_task"].items()
        }


# ----------------------------------------------------------------------------- worker side
def run_job(job: dict[str, Any], reporter: Reporter) -> dict[str, Any]:
    from common import build_engine, generate, shutdown_engine
    from vllm import SamplingParams

    settings = EngineSettings(**job["settings"])
    spec = CompressionSpec(**job["spec"])
    prompts = json.loads(Path(job["prompts_path"]).read_text())
    engine = build_engine(settings, spec)
    try:
        params = [SamplingParams(max_tokens=p["max_tokens"], temperature=0.0) for p in prompts]
        started = time.perf_counter()
        outputs, elapsed = generate(
            engine, [p["prompt_token_ids"] for p in prompts], params,
            lambda finished, _tokens: reporter.progress(finished),
        )
    finally:
        shutdown_engine(engine)
    return {
        "outputs": [{"text": o.text, "token_ids": o.token_ids} for o in outputs],
        "generate_s": elapsed,
        "engine_s": time.perf_counter() - started,
    }


# ----------------------------------------------------------------------------- parent side
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="model folder (default: embedded model)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated task names")
    parser.add_argument("--lengths", default="1024",
                        help="prompt lengths in tokens (each prompt is at most this long)")
    parser.add_argument("--samples", type=int, default=2, help="samples per task and length")
    parser.add_argument("--methods", default=",".join(METHODS))
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budgets", default="64,128,256,512,2048",
                        help="tokens kept per layer and KV head (window included)")
    budget.add_argument("--ratios", default=None,
                        help="fractions of each prompt evicted instead of budgets, e.g. 0.875")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto",
                        help="auto = bfloat16, or float32 on CPUs without native bf16")
    parser.add_argument("--kv-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra kvcompress setting, e.g. kv_window=16")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of the engine (default: cores - 1)")
    parser.add_argument("--compile", action="store_true", help="no enforce_eager")
    parser.add_argument("--job-timeout", type=float, default=1800.0)
    parser.add_argument("--output-json", type=Path, default=RESULTS_DIR / "quality.json")
    parser.add_argument("--plot", type=Path, default=RESULTS_DIR / "quality.png")
    parser.add_argument("--log-file", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--replot", type=Path, default=None, metavar="JSON",
                        help="redraw the table and --plot from a saved JSON, no engine")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the generated prompts' statistics and one example, no engine")
    return parser


def make_specs(methods: Sequence[str], budgets: Sequence[int] | None,
               ratios: Sequence[float] | None) -> list[CompressionSpec]:
    if ratios:
        return [CompressionSpec(m, ratio=r) for m in methods for r in ratios]
    return [CompressionSpec(m, budget=b) for m in methods for b in budgets or ()]


def evicts_nothing(spec: CompressionSpec, prompt_lens: Sequence[int]) -> bool:
    """A budget >= every prompt keeps every prompt whole (ratios always evict)."""
    return spec.budget is not None and spec.budget >= max(prompt_lens)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:], run_job)
    args = build_parser().parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, args.plot)
    started = time.perf_counter()
    try:
        tasks = parse_names(args.tasks, list(TASKS), "--tasks")
        methods = parse_names(args.methods, METHODS, "--methods")
    except ValueError as error:
        raise SystemExit(str(error)) from None
    ratios = [float(r) for r in args.ratios.split(",")] if args.ratios else None
    budgets = None if ratios else parse_ints(args.budgets)
    lengths = parse_ints(args.lengths)

    from transformers import AutoTokenizer

    device = detect_device()
    model = args.model or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    context = model_shape(model)["max_position_embeddings"]
    if context and max(lengths) > context:
        raise SystemExit(f"--lengths: {max(lengths)} exceeds the model's context {context}")

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    samples = make_samples(tasks, lengths, args.samples, args.seed, count)
    prompts = [{"prompt_token_ids": tokenizer.encode(s.prompt), "max_tokens": s.max_tokens}
               for s in samples]
    prompt_lens = [len(p["prompt_token_ids"]) for p in prompts]
    if args.dry_run:
        return dry_run(samples, prompt_lens)

    specs = make_specs(methods, budgets, ratios)
    to_run = [CompressionSpec()] + [s for s in specs if not evicts_nothing(s, prompt_lens)]
    dtype = resolve_dtype(args.dtype, device)
    longest = max(n + p["max_tokens"] for n, p in zip(prompt_lens, prompts))
    # Room for every request at once: quality runs are not meant to be memory-bound.
    kv_tokens = min(sum(n + p["max_tokens"] for n, p in zip(prompt_lens, prompts)),
                    args.max_num_seqs * longest)
    kv_tokens = max(kv_tokens, 2 * longest)
    settings = EngineSettings(
        model=model, dtype=dtype, max_model_len=longest, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(2048, longest),
        kv_cache_memory_bytes=kv_tokens * kv_bytes_per_token(model, dtype),
        enforce_eager=not args.compile, seed=args.seed,
        compression_options=parse_kv_options(args.kv_option),
    )
    threads = None if device != "cpu" else args.threads or default_threads()
    workdir = make_workdir("quality")
    prompts_path = workdir / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    log_path = args.log_file or workdir / "vllm.log"
    header = {
        "benchmark": "quality",
        "command": command_string([sys.argv[0], *argv]),
        "machine": machine_info(device),
        "settings": {**vars(settings), "threads": threads},
        "workload": {
            "tasks": tasks, "lengths": lengths, "samples_per_task_length": args.samples,
            "seed": args.seed, "num_prompts": len(samples),
            "prompt_tokens": sum(prompt_lens), "prompt_len_range": [min(prompt_lens),
                                                                    max(prompt_lens)],
            "methods": methods, "budgets": budgets, "ratios": ratios,
        },
    }
    print(f"command: {header['command']}")
    print(f"settings: {json.dumps(header['settings'])}")
    print(f"workload: {json.dumps(header['workload'])}")
    print(f"{len(to_run)} engine runs ({len(specs) + 1 - len(to_run)} budgets >= every prompt "
          f"not run); vLLM logs: {log_path}", flush=True)

    jobs = [{"id": spec.label, "spec": vars(spec), "settings": vars(settings),
             "prompts_path": str(prompts_path)} for spec in to_run]
    results = run_jobs(
        Path(__file__).resolve(), jobs, workdir=workdir, log_path=log_path,
        units={job["id"]: len(prompts) for job in jobs}, job_timeout=args.job_timeout,
        env=worker_env(args.verbose, False, threads), desc="quality",
        show_progress=not args.no_progress,
    )
    rows = collect_rows(samples, [CompressionSpec(), *specs], results, prompt_lens)
    report = {**header, "configs": rows, "samples": sample_records(samples, prompt_lens),
              "runtime_s": time.perf_counter() - started}
    write_json(args.output_json, report)
    print()
    print(render(rows, tasks))
    for row in rows:
        if not row["ok"]:
            print(f"\n{row['label']} FAILED:\n{row['error']}")
    plot(rows, args.plot, title=plot_title(header))
    print(f"\nwrote {args.output_json} and {args.plot} ({report['runtime_s']:.0f} s)")
    return 0 if all(row["ok"] for row in rows) else 1


def replot(json_path: Path, png_path: Path) -> int:
    report = json.loads(json_path.read_text())
    print(render(report["configs"], report["workload"]["tasks"]))
    plot(report["configs"], png_path, title=plot_title(report))
    print(f"wrote {png_path}")
    return 0


def collect_rows(samples: Sequence[Sample], specs: Sequence[CompressionSpec],
                 results: dict[str, Any], prompt_lens: Sequence[int]) -> list[dict[str, Any]]:
    full = results.get("vanilla")
    reference = full.result["outputs"] if full is not None and full.result else None
    rows = []
    for spec in specs:
        row: dict[str, Any] = {"label": spec.label, "method": spec.method, "budget": spec.budget,
                               "ratio": spec.ratio}
        outcome = results.get(spec.label)
        if outcome is None and evicts_nothing(spec, prompt_lens) and reference is not None:
            row.update(ok=True, not_run="budget >= every prompt: nothing evicted, full cache")
            row.update(summarize_config(samples, reference, reference))
        elif outcome is None or outcome.error is not None:
            row.update(ok=False, error=getattr(outcome, "error", "not run"))
        else:
            row.update(ok=True, generate_s=outcome.result["generate_s"],
                       job_seconds=outcome.seconds)
            row.update(summarize_config(samples, outcome.result["outputs"], reference))
            row["outputs"] = [o["text"] for o in outcome.result["outputs"]]
        row["kept_fraction"] = kept_fraction(spec, prompt_lens)
        rows.append(row)
    if rows and rows[0]["ok"]:
        add_retained(rows, rows[0])
    return rows


def kept_fraction(spec: CompressionSpec, prompt_lens: Sequence[int]) -> float:
    """Mean share of each prompt's cache kept (window included) at this budget or ratio."""
    if spec.is_vanilla:
        return 1.0
    if spec.ratio is not None:
        return 1.0 - spec.ratio
    return mean([min(1.0, spec.budget / n) for n in prompt_lens]) or 1.0


def sample_records(samples: Sequence[Sample], prompt_lens: Sequence[int]) -> list[dict]:
    return [
        {"task": s.task, "length": s.length, "index": s.index, "prompt_tokens": n,
         "answers": s.answers, "metric": s.metric, "max_tokens": s.max_tokens}
        for s, n in zip(samples, prompt_lens)
    ]


def dry_run(samples: Sequence[Sample], prompt_lens: Sequence[int]) -> int:
    for task in dict.fromkeys(s.task for s in samples):
        lens = [n for s, n in zip(samples, prompt_lens) if s.task == task]
        print(f"{task:18s} {len(lens):3d} prompts, {min(lens)}..{max(lens)} tokens")
    example = samples[0]
    print(f"\nexample ({example.task}, answers {example.answers}):\n"
          f"{example.prompt[:600]} [...] {example.prompt[-300:]}")
    print(json.dumps([asdict(s) | {"prompt": None} for s in samples[:3]], indent=1))
    return 0


def render(rows: list[dict[str, Any]], tasks: Sequence[str]) -> str:
    short = {t: t.replace("niah_", "").replace("variable_tracking", "vt")
             .replace("common_words", "cwe")[:10] for t in tasks}
    table = []
    for row in rows:
        flat = {**row, **{f"t:{t}": (row.get("per_task") or {}).get(t) for t in tasks}}
        if row.get("not_run"):
            flat["label"] = f"{row['label']} (=full)"
        table.append(flat)
    columns = [("label", "config"), ("kept_fraction", "kept")]
    columns += [(f"t:{t}", short[t]) for t in tasks]
    columns += [("accuracy", "mean"), ("retained", "retained"), ("fidelity", "fidelity")]
    return format_table(table, columns)


def plot_title(header: dict[str, Any]) -> str:
    work = header["workload"]
    return (f"{Path(header['settings']['model']).name}: {len(work['tasks'])} tasks, lengths "
            f"{','.join(map(str, work['lengths']))}, {work['samples_per_task_length']} "
            f"samples each")


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = rows[0] if rows and rows[0]["label"] == "vanilla" and rows[0]["ok"] else None
    by_ratio = any(r.get("ratio") is not None for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, ylabel in ((axes[0], "accuracy", "accuracy (mean over tasks)"),
                            (axes[1], "fidelity", "fidelity to full cache")):
        for index, method in enumerate(METHODS):
            color = f"C{index}"
            ran = sorted((r["ratio"] if by_ratio else r["budget"], r[key]) for r in rows
                         if r["method"] == method and r["ok"] and r.get(key) is not None
                         and not r.get("not_run"))
            skipped = sorted((r["budget"], r[key]) for r in rows
                             if r["method"] == method and r.get("not_run"))
            if ran:
                ax.plot(*zip(*ran), marker="o", color=color, label=method)
            if skipped:  # budget >= every prompt: the full cache, drawn hollow and unlinked
                ax.plot(*zip(*skipped), marker="o", linestyle="none", color=color,
                        markerfacecolor="none")
        if full is not None and full.get(key) is not None:
            ax.axhline(full[key], color="black", linestyle="--", label="full cache")
        if not by_ratio:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("fraction of prompt evicted" if by_ratio else "KV budget (tokens / head)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.02, 1.02)
        if any(r.get("not_run") for r in rows):
            ax.text(0.99, 0.01, "hollow: budget >= every prompt (= full cache, not run)",
                    transform=ax.transAxes, ha="right", va="bottom", fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
