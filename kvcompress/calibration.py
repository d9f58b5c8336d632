"""Calibration text made once per model by ``python -m kvcompress.profile_model``: synthetic
documents (records, notes, logs, prose with names, numbers and codes) generated from a seed,
unlike every benchmark's documents, with questions about them. No vLLM imports.
"""

from __future__ import annotations

import random

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
