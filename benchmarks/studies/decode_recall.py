"""Decode-time recall: a fact the model *generated* early, asked for ~1000 generated tokens
later, so that decode-time eviction (not prompt compression) decides whether it survives.

A 135M model does not reliably invent a fact and restate it on its own, so the generation is
scripted: a vLLM V1 logits processor (``ForcedScriptProcessor``) teacher-forces each request's
first generated tokens, the token script ``S`` passed per request in
``SamplingParams.extra_args["forced_tokens"]``: while a request has generated t < len(S)
tokens, every logit but S[t]'s is -inf. The script states a five-digit secret code, runs on
through filler sentences and ends with the question (``...The code is``); the tokens after it
are the model's own greedy answer. The chat prompt asks for the code to be invented but does
not contain it: the code exists only in the generated (decode) part of the KV cache.

Scoring: the answer is correct when its first run of digits is exactly the code; partial
credit (``leading_digits``) is the share of the code's leading digits that run reproduces.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from benchmarks.quality.tasks import filler_sentence

FORCED_TOKENS_KEY = "forced_tokens"
# vLLM loads logits processors by "module:Class" (the engine may live in another process).
PROCESSOR_PATH = "benchmarks.studies.decode_recall:ForcedScriptProcessor"
ANSWER_TOKENS = 10  # free greedy tokens after the script: " 48213." takes 7 (a token a digit)
SENTENCES_PER_PARAGRAPH = 6
PROMPT = ("Write a long story about the people of a small village. Begin by inventing a "
          "five-digit secret code and telling it to me; at the very end I will ask you for it.")
OPENING = "Sure. First, the secret code: the code is {code}. Remember it.\n\n"
QUESTION = "\n\nNow, what was the secret code? The code is"


@dataclass(frozen=True)
class RecallPrompt:
    """One chat prompt, the generated tokens forced after it, and the code they state."""

    prompt_token_ids: list[int]
    forced_tokens: list[int]
    code: str

    @property
    def max_tokens(self) -> int:
        return len(self.forced_tokens) + ANSWER_TOKENS


# ----------------------------------------------------------------------------- the task
def script_text(code: str, filler: str) -> str:
    """What the model is made to generate: the code first, the question last."""
    return OPENING.format(code=code) + filler + QUESTION


def filler_text(rng: random.Random, filler_tokens: int, tokenizer: Any) -> str:
    """Story-like sentences (no digits) of about ``filler_tokens`` tokens, in paragraphs."""
    sentences: list[str] = []
    used = 0
    while True:
        sentence = filler_sentence(rng)
        cost = len(tokenizer.encode(" " + sentence, add_special_tokens=False))
        if used + cost > filler_tokens:
            break
        sentences.append(sentence)
        used += cost
    paragraphs = [" ".join(sentences[i:i + SENTENCES_PER_PARAGRAPH])
                  for i in range(0, len(sentences), SENTENCES_PER_PARAGRAPH)]
    return "\n\n".join(paragraphs)


def recall_prompts(tokenizer: Any, num: int, filler_tokens: int,
                   seed: int = 0) -> list[RecallPrompt]:
    """``num`` prompts, each with a code and filler of its own drawn from one seeded RNG."""
    rng = random.Random(seed)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                         add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    prompts = []
    for _ in range(num):
        code = str(rng.randint(10000, 99999))
        script = script_text(code, filler_text(rng, filler_tokens, tokenizer))
        prompts.append(RecallPrompt(list(prompt_ids),
                                    tokenizer.encode(script, add_special_tokens=False), code))
    return prompts


def first_number(answer: str) -> str | None:
    """The first maximal run of digits in ``answer`` (" 48213." -> "48213"), or None."""
    match = re.search(r"\d+", answer)
    return match.group() if match else None


def is_recalled(answer: str, code: str) -> bool:
    """Correct only when the answer's first number is exactly the code (not a longer or
    shorter number containing it)."""
    return first_number(answer) == code


def leading_digits_recalled(answer: str, code: str) -> float:
    """Partial credit: the share of the code's leading digits that the answer's first number
    reproduces in order (" 456." for 45432 -> 0.6), so that losing part of the code is told
    from losing all of it."""
    number = first_number(answer) or ""
    same = next((i for i, (a, b) in enumerate(zip(number, code)) if a != b),
                min(len(number), len(code)))
    return same / len(code)


# ----------------------------------------------------------------------------- the forcing
class ForcedScriptProcessor(LogitsProcessor):
    """Teacher-forces ``extra_args["forced_tokens"]`` as a request's first generated tokens;
    requests without the key, and the tokens after the script, are left alone.

    vLLM hands each added request's live list of output tokens to ``update_state``; its length
    at ``apply`` time is the position of the token being sampled.
    """

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        script = (sampling_params.extra_args or {}).get(FORCED_TOKENS_KEY)
        if script is not None and not (
            isinstance(script, list) and all(isinstance(t, int) and t >= 0 for t in script)
        ):
            raise ValueError(f"extra_args[{FORCED_TOKENS_KEY!r}] must be a list of token ids")

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (script, the request's output token ids, updated in place by vLLM)
        self.scripts: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the greedy choice, so vLLM must apply it under greedy too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        # The interface's order: removed, added, moved.
        for row in batch_update.removed:
            self.scripts.pop(row, None)
        for row, params, _prompt_ids, output_ids in batch_update.added:
            script = (params.extra_args or {}).get(FORCED_TOKENS_KEY)
            if script:
                self.scripts[row] = (script, output_ids)
            else:
                self.scripts.pop(row, None)  # a new request reusing a scripted row
        for source, target, direction in batch_update.moved:
            moving, displaced = self.scripts.pop(source, None), self.scripts.pop(target, None)
            if moving is not None:
                self.scripts[target] = moving
            if direction == MoveDirectionality.SWAP and displaced is not None:
                self.scripts[source] = displaced

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, tokens = [], []
        for row, (script, output_ids) in self.scripts.items():
            position = len(output_ids)
            if position < len(script):
                rows.append(row)
                tokens.append(script[position])
        if rows:
            row_index = torch.tensor(rows, device=logits.device)
            token_index = torch.tensor(tokens, device=logits.device)
            logits[row_index] = float("-inf")
            logits[row_index, token_index] = 0.0
        return logits


# ----------------------------------------------------------------------------- scoring
def score_recall(prompts: list[RecallPrompt], outputs: list[list[int]],
                 tokenizer: Any) -> dict[str, Any]:
    """Per prompt: whether the script was followed, the free answer, and whether it holds
    the code; accuracy over the prompts with its 95% Wilson interval."""
    from benchmarks.quality.scoring import wilson_interval

    followed, answers, scores, digits = [], [], [], []
    for prompt, token_ids in zip(prompts, outputs):
        forced = len(prompt.forced_tokens)
        followed.append(token_ids[:forced] == prompt.forced_tokens)
        answer = tokenizer.decode(token_ids[forced:], skip_special_tokens=True)
        answers.append(answer)
        scores.append(float(is_recalled(answer, prompt.code)))
        digits.append(leading_digits_recalled(answer, prompt.code))
    return {"accuracy": sum(scores) / len(scores) if scores else None,
            "interval": wilson_interval(scores), "n": len(scores), "scores": scores,
            "leading_digits": sum(digits) / len(digits) if digits else None,
            "script_followed": sum(followed) / len(followed) if followed else None,
            "answers": answers}
