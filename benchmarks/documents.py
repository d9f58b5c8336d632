"""The documents of the document benchmarks (shared_context, shared_prefix): seeded filler
text (the quality tasks' haystacks) hiding four facts of different kinds, a question for each
and a non-retrieval task, and the chat prompts that ask them.

A document of about ``doc_tokens`` tokens hides a five-digit code, a person's city, another
person's job and an object's colour at spread depths; its questions ask them in a shuffled
order, then ask for both people's full names. Every answer starts with a prefix the assistant
message is continued from ("The secret code of the blue safe is") and is right when it holds
the reference (the names: the share of the two found).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.extension import exact_extension
from benchmarks.natural_text import sentence_source
from benchmarks.quality.tasks import fill_haystack, filler_sentence, spread_depths, unique_names
from benchmarks.quality.words import CITIES, PROFESSIONS

HEADER = "Read the following document carefully. I will ask you questions about it."
SYSTEM_HEADER = ("You are the assistant of the company whose handbook follows. Answer the "
                 "user's questions about it.")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white", "brown")
THINGS = ("umbrella", "bicycle", "kite", "scarf", "teapot", "backpack", "lamp", "notebook")


@dataclass(frozen=True)
class Question:
    kind: str  # code, city, job, color (retrieval) or people (aggregation)
    text: str
    prefix: str  # the assistant's answer starts with it
    references: tuple[str, ...]
    metric: str = "any"  # "all": the share of the references found


@dataclass(frozen=True)
class Document:
    index: int
    text: str
    questions: tuple[Question, ...]  # in the order they are asked

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Document:
        """From ``asdict(document)`` after a JSON round trip."""
        return cls(data["index"], data["text"], tuple(
            Question(q["kind"], q["text"], q["prefix"], tuple(q["references"]), q["metric"])
            for q in data["questions"]))

    def first_message(self, question: Question) -> str:
        return f"{HEADER}\n\n{self.text}\n\nQuestion: {question.text}"


FILLERS = ("synthetic", "natural")


def make_documents(num: int, doc_tokens: int, seed: int, count: Callable[[str], int],
                   filler: str = "synthetic") -> list[Document]:
    """Seeded documents, each with its own RNG: four facts at spread depths, asked in a
    shuffled order, then the people task. ``filler``: the generated sentences of the
    quality tasks' haystacks, or ``natural`` prose (``natural_text``: installed packages'
    descriptions, consecutive sentences from a random place)."""
    documents = []
    for index in range(num):
        rng = random.Random(f"{seed}/shared-context/{index}")
        first, second = unique_names(rng)[:2]
        code, city = str(rng.randint(10000, 99999)), rng.choice(CITIES)
        job = rng.choice(PROFESSIONS)
        thing, color = rng.choice(THINGS), rng.choice(COLORS)
        facts = [
            (f"The secret code of the blue safe is {code}.",
             Question("code", "What is the secret code of the blue safe?",
                      "The secret code of the blue safe is", (code,))),
            (f"{first} lives in the city of {city}.",
             Question("city", f"In which city does {first} live?",
                      f"{first} lives in the city of", (city,))),
            (f"{second} works as a {job}.",
             Question("job", f"What does {second} work as?", f"{second} works as a", (job,))),
            (f"The {thing} in the hallway is painted {color}.",
             Question("color", f"What color is the {thing} in the hallway?",
                      f"The {thing} in the hallway is painted", (color,))),
        ]
        rng.shuffle(facts)
        source = sentence_source(rng) if filler == "natural" else filler_sentence
        sentences = fill_haystack(rng, doc_tokens, count, [fact for fact, _ in facts],
                                  spread_depths(rng, len(facts)), source)
        people = Question("people", "Which two people does the document mention? Give their "
                          "full names.", "The two people are", (first, second), "all")
        documents.append(Document(index, " ".join(sentences),
                                  tuple(q for _, q in facts) + (people,)))
    return documents


class Prompts:
    """Token ids of every request, built through the model's chat template with the
    assistant message continued from the answer prefix."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  continue_final_message=True)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def independent(self, document: Document, question: Question) -> list[int]:
        return self.encode(self.render([
            {"role": "user", "content": document.first_message(question)},
            {"role": "assistant", "content": question.prefix}]))

    def chat_turn(self, document: Document, turn: int, history: Sequence[tuple[str, list[int]]],
                  previous: list[int]) -> list[int]:
        """Turn ``turn`` (0-based) of ``document``'s conversation: the previous prompt's ids and
        each earlier answer's (``history``: (text, ids), the last one's ids are in
        ``previous``'s continuation), then the template's text after them, tokenized alone:
        an exact extension, as a client that keeps token ids sends it."""
        questions = document.questions
        messages = [{"role": "user", "content": document.first_message(questions[0])}]
        for number, (answer_text, _) in enumerate(history):
            messages.append({"role": "assistant", "content": questions[number].prefix
                             + answer_text})
            messages.append({"role": "user", "content": f"Question: {questions[number + 1].text}"})
        messages.append({"role": "assistant", "content": questions[turn].prefix})
        if turn == 0:
            return self.encode(self.render(messages))
        head = self.render(messages[:-2])  # through the last answer
        try:
            return exact_extension(previous + history[-1][1], head, self.render(messages),
                                   self.encode)
        except ValueError as error:
            raise ValueError(f"the chat template renders earlier turns differently in a "
                             f"longer conversation: {error}") from None


def prompts_sharing_the_document(
        prompts: Prompts, document: Document, requests: int,
        messages: Callable[[int, Question], list[dict[str, str]]],
) -> tuple[list[int], list[list[int]], list[int]]:
    """The shared prefix's ids, then ``requests`` prompts (prefix + their own part) and the
    question each asks (numbered, cycling through the document's): request ``number``'s
    chat is ``messages(number, question)``, cut after the document, whose ids are tokenized
    once so every prompt starts with exactly them."""
    prefix_ids: list[int] | None = None
    prompts_ids, asked = [], []
    for number in range(requests):
        index = number % len(document.questions)
        text = prompts.render(messages(number, document.questions[index]))
        cut = text.index(document.text) + len(document.text)
        if prefix_ids is None:
            prefix_ids = prompts.encode(text[:cut])
        prompts_ids.append(prefix_ids + prompts.encode(text[cut:]))
        asked.append(index)
    assert prefix_ids is not None, "at least one request"
    return prefix_ids, prompts_ids, asked


def system_prompt_prompts(prompts: Prompts, document: Document, requests: int,
                          question_tokens: int, count: Callable[[str], int], seed: int
                          ) -> tuple[list[int], list[list[int]], list[int]]:
    """A chat with a system prompt: the document is the system message, every request's
    user message about ``question_tokens`` tokens of its own (seeded filler, then the
    numbered question), the assistant message continued from the answer's start. The
    shared prefix ends with the document (the template's tokens after it are each
    prompt's own)."""

    def messages(number: int, question: Question) -> list[dict[str, str]]:
        ask = f"Question {number + 1}: {question.text}"
        rng = random.Random(f"{seed}/system-prompt/{document.index}/{number}")
        context = " ".join(fill_haystack(rng, max(0, question_tokens - count(ask)), count,
                                         (), ()))
        return [{"role": "system", "content": f"{SYSTEM_HEADER}\n\n{document.text}"},
                {"role": "user", "content": f"{context}\n\n{ask}" if context else ask},
                {"role": "assistant", "content": question.prefix}]

    return prompts_sharing_the_document(prompts, document, requests, messages)


def score_answer(text: str, question: Question) -> float:
    from benchmarks.quality.scoring import score

    return score(text, list(question.references), question.metric)
