"""The conversations of a multi-turn run: scripted user messages (chat filler, or a pass key
in turn 1 asked for in the last turn) and how each turn's prompt is built from the
conversation so far."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.quality.tasks import fill_haystack

PROMPT_BUILDS = ("template", "tokens")
RECALL_PREFIX = "The pass key is"
CHAT_LEADS = (
    "Here are my notes from today, part {turn}. Read them and tell me what you think.",
    "I wrote down some more things that happened, part {turn}. What do you make of them?",
    "Part {turn} of my notes follows. Please comment on it.",
)
RECALL_FIRST = ("I am giving you a pass key now. Remember it: I will ask you for it at the end "
                "of our conversation. Here are my notes, the pass key is among them.")
RECALL_QUESTION = "What is the pass key I gave you in my first message?"


@dataclass
class Conversation:
    """One scripted conversation: a user message per turn (the answers come from the model).
    ``answer_prefix`` starts the last turn's assistant message (recall); ``references`` are
    what that answer must contain."""

    index: int
    user: list[str]
    answer_prefix: str = ""
    references: list[str] = field(default_factory=list)


TokenCounter = Callable[[str], int]


def filler(rng: random.Random, tokens: int, count: TokenCounter, needles: Sequence[str] = (),
           depths: Sequence[float] = ()) -> str:
    return " ".join(fill_haystack(rng, tokens, count, needles, depths))


def chat_conversations(num: int, turns: int, user_tokens: int, seed: int,
                       count: TokenCounter) -> list[Conversation]:
    """Each turn: a lead line and filler of about ``user_tokens`` tokens in all."""
    conversations = []
    for index in range(num):
        rng = random.Random(f"{seed}/chat/{index}")
        messages = []
        for turn in range(1, turns + 1):
            lead = rng.choice(CHAT_LEADS).format(turn=turn)
            body = filler(rng, max(0, user_tokens - count(lead) - 1), count)
            messages.append(f"{lead}\n{body}")
        conversations.append(Conversation(index, messages))
    return conversations


def recall_conversations(num: int, turns: int, user_tokens: int, seed: int,
                         count: TokenCounter) -> list[Conversation]:
    """Turn 1 hides a five-digit pass key in filler, turns 2..N-1 are filler, turn N asks."""
    if turns < 2:
        raise ValueError("--recall needs at least 2 turns (the fact, then the question)")
    conversations = []
    for index in range(num):
        rng = random.Random(f"{seed}/recall/{index}")
        key = str(rng.randint(10000, 99999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        first = filler(rng, max(0, user_tokens - count(RECALL_FIRST) - 1), count, [needle],
                       [rng.uniform(0.1, 0.9)])
        messages = [f"{RECALL_FIRST}\n{first}"]
        for turn in range(2, turns):
            lead = rng.choice(CHAT_LEADS).format(turn=turn)
            messages.append(f"{lead}\n{filler(rng, max(0, user_tokens - count(lead) - 1), count)}")
        messages.append(RECALL_QUESTION)
        conversations.append(Conversation(index, messages, RECALL_PREFIX, [key]))
    return conversations


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same


class PromptBuilder:
    """Turn prompts of a conversation. ``template``: the whole conversation through the chat
    template, tokenized (what a chat client and vLLM's chat endpoint do). ``tokens``: the
    previous prompt's and answer's token ids, then the template's text after the answer
    tokenized on its own: an exact extension by construction."""

    def __init__(self, tokenizer: Any, mode: str = "template") -> None:
        if mode not in PROMPT_BUILDS:
            raise ValueError(f"prompt build {mode!r}; allowed: {', '.join(PROMPT_BUILDS)}")
        self.tokenizer = tokenizer
        self.mode = mode

    def render(self, messages: Sequence[Mapping[str, str]], answer_prefix: str = "") -> str:
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=True)
        return text + answer_prefix

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, state: ConversationState) -> tuple[list[int], str]:
        """The next turn's (token ids, text) for ``state``."""
        conversation, turn = state.conversation, state.turn
        messages = [*state.messages, {"role": "user", "content": conversation.user[turn]}]
        last = turn == len(conversation.user) - 1
        text = self.render(messages, conversation.answer_prefix if last else "")
        if self.mode == "template" or turn == 0:
            return self.encode(text), text
        head = state.prompt_text + state.answer_text
        if not text.startswith(head):
            raise ValueError("the chat template renders earlier turns differently in a longer "
                             "conversation: use --prompt-build template")
        return state.prompt_ids + state.answer_ids + self.encode(text[len(head):]), text


@dataclass
class ConversationState:
    conversation: Conversation
    turn: int = 0  # the next turn to submit, 0-based
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)  # the last submitted prompt
    prompt_text: str = ""
    answer_ids: list[int] = field(default_factory=list)  # the last answer
    answer_text: str = ""

    @property
    def done(self) -> bool:
        return self.turn >= len(self.conversation.user)

    def finish_turn(self, answer_ids: Sequence[int], answer_text: str) -> None:
        self.messages += [{"role": "user", "content": self.conversation.user[self.turn]},
                          {"role": "assistant", "content": answer_text}]
        self.answer_ids, self.answer_text = list(answer_ids), answer_text
        self.turn += 1



def longest_conversation(builder: PromptBuilder, conversation: Conversation,
                         answer_tokens: int) -> int:
    """Tokens of a conversation at its end (last prompt + answer), answers stood in for by
    ``answer_tokens`` one-token words, plus slack for re-tokenized answers."""
    messages: list[dict[str, str]] = []
    stand_in = " ".join(["word"] * answer_tokens)
    for turn, user in enumerate(conversation.user):
        messages.append({"role": "user", "content": user})
        if turn < len(conversation.user) - 1:
            messages.append({"role": "assistant", "content": stand_in})
    prompt = builder.encode(builder.render(messages, conversation.answer_prefix))
    return len(prompt) + answer_tokens + 8 * len(conversation.user)

