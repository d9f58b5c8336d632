"""Calibration text made once per model by ``python -m kvcompress.profile_model``, of four
kinds, each as a user would send it through the chat template:

- ``synthetic``: documents (records, notes, logs, prose with names, numbers and codes)
  generated from a seed, with a question about them;
- ``prose``: docstrings of the Python standard library (``profile_model.corpus``), a
  module's read as one text, with a question;
- ``code``: a stretch of a standard-library module's source, asked to be explained;
- ``chat``: a multi-turn transcript, a user asking what a module's functions do and the
  assistant answering with their docstrings, then one more question.

None of them is any benchmark's text. The natural kinds draw their held-out prompts from
files the fitting prompts never use. No vLLM imports.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvcompress.profile_model.corpus import SourceFile, source_files

KINDS = ("synthetic", "prose", "code", "chat")
# A natural prompt's length in characters, drawn per prompt (about 250-1,000 tokens of
# English, more of code; the teacher's cost is about twice a prompt's through the model);
# a synthetic document's in sentences (about 300-1,800 tokens: fitted on shorter ones only,
# the surrogate ranked long synthetic prompts worse, 0.70 against 0.73 top-quarter overlap).
PROMPT_CHARS = (1000, 4000)
SENTENCES = (20, 110)

REPEAT_INSTRUCTION = "Repeat the previous context exactly."
# What a reconstruction pass feeds before each chunk of the prompt (KVzip's instruction);
# the engine's passes and the surrogate's teacher alike.
REPEAT_PROMPT = f"\n\n{REPEAT_INSTRUCTION}\n"
_NAMES = ("Amara", "Bogdan", "Chiara", "Dmitri", "Esther", "Farid", "Greta", "Hiroshi",
          "Ingrid", "Jomo", "Katya", "Lorenzo", "Mei", "Nikolai", "Oksana", "Pedro")
_PLACES = ("the north warehouse", "the river depot", "the old mill", "the harbour office",
           "the east annex", "the mountain lab", "the central archive", "the south yard")
_THINGS = ("copper wire", "glass jars", "oak planks", "wool blankets", "solar panels",
           "brass valves", "paper rolls", "clay bricks", "steel bolts", "linen sheets")
_VERBS = ("inspected", "repaired", "moved", "counted", "labelled", "shipped", "ordered",
          "measured")
_PROSE = (
    "The morning was quiet and the light came in low over the fields.",
    "Nobody expected the meeting to run long, yet it did.",
    "A short note on the board reminded everyone to lock the side door.",
    "The old radio in the corner played a song that nobody could name.",
    "Rain had left the road soft, and the trucks moved slowly.",
    "It was agreed that the figures would be checked again on Friday.",
    "Someone had left a cup of tea on the windowsill, long gone cold.",
    "The committee thanked the volunteers for their patience.",
)


def calibration_document(rng: random.Random, sentences: int) -> tuple[str, list[str]]:
    """A synthetic document and questions about it (with their answers inline)."""
    lines, questions = [], []
    for _ in range(sentences):
        kind = rng.randrange(4)
        name, place = rng.choice(_NAMES), rng.choice(_PLACES)
        thing, verb = rng.choice(_THINGS), rng.choice(_VERBS)
        count = rng.randrange(2, 900)
        if kind == 0:
            lines.append(f"On day {rng.randrange(1, 29)}, {name} {verb} {count} {thing} "
                         f"at {place}.")
            questions.append(f"How many {thing} did {name} handle? {count}.")
        elif kind == 1:
            code = f"{rng.choice('BDFKLPRTVZ')}{rng.choice('AEIOU')}-{rng.randrange(1000, 9999)}"
            lines.append(f"The lot of {thing} stored at {place} carries the tag {code}.")
            questions.append(f"Which tag do the {thing} at {place} carry? {code}.")
        elif kind == 2:
            lines.append(f"{name} moved from {place} to {rng.choice(_PLACES)} and now "
                         f"looks after the {thing}.")
            questions.append(f"Who looks after the {thing}? {name}.")
        else:
            lines.append(rng.choice(_PROSE))
    return " ".join(lines), questions


def chat_text(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    return "\n".join(message["content"] for message in messages)


def available_kinds() -> tuple[str, ...]:
    """The kinds this machine can make: the natural ones need the standard library's source
    (a Python install without its .py files has only the synthetic kind)."""
    if source_files(held_out=False) and source_files(held_out=True):
        return KINDS
    return ("synthetic",)


def calibration_prompt(tokenizer, kind: str, rng: random.Random, held_out: bool) -> str:
    """One chat prompt of ``kind`` (see KINDS), drawn with ``rng``."""
    if kind == "synthetic":
        document, questions = calibration_document(rng, rng.randrange(*SENTENCES))
        question = rng.choice(questions).rsplit("? ", 1)[0] + "?" if questions else "Summarize."
        return chat_text(tokenizer, [{"role": "user", "content": f"{document}\n\n{question}"}],
                         True)
    files = [file for file in source_files(held_out) if kind != "chat" or len(file.functions) >= 3]
    return chat_text(tokenizer, _NATURAL[kind](rng, rng.choice(files)), True)


def _prose(rng: random.Random, file: SourceFile) -> list[dict]:
    text = _take(list(file.docstrings), rng.randrange(*PROMPT_CHARS), "\n\n")
    return [{"role": "user", "content": f"From the documentation of Python's {file.name} "
                                        f"module:\n\n{text}\n\nWhat is this module for?"}]


def _code(rng: random.Random, file: SourceFile) -> list[dict]:
    lines = file.source.splitlines()
    start = rng.randrange(max(1, len(lines) - 40))
    text = _take(lines[start:], rng.randrange(*PROMPT_CHARS), "\n")
    return [{"role": "user", "content": f"```python\n{text}\n```\n\nExplain what this code "
                                        "does."}]


def _chat(rng: random.Random, file: SourceFile) -> list[dict]:
    functions = list(file.functions)
    rng.shuffle(functions)
    turns, size, budget = [], 0, rng.randrange(*PROMPT_CHARS)
    for name, docstring in functions:
        if turns and size + len(docstring) > budget:
            break
        turns += [{"role": "user", "content": rng.choice(_ASKS).format(name=name,
                                                                      module=file.name)},
                  {"role": "assistant", "content": docstring}]
        size += len(docstring) + 40
    closing = rng.choice(functions)[0]
    turns.append({"role": "user", "content": f"Which of these would I use together with "
                                             f"{closing}, and why?"})
    return turns


_ASKS = ("What does {name} do?", "I am reading the {module} module. What is {name} for?",
         "How do I use {name}?", "Can you explain {name} from {module}?")


def _take(pieces: list[str], chars: int, separator: str) -> str:
    """Pieces from the start, whole, until about ``chars`` characters (at least one)."""
    taken, size = [], 0
    for piece in pieces:
        if taken and size + len(piece) > chars:
            break
        taken.append(piece)
        size += len(piece) + len(separator)
    return separator.join(taken)


_NATURAL: dict[str, Callable[[random.Random, SourceFile], list[dict]]] = {
    "prose": _prose, "code": _code, "chat": _chat}
