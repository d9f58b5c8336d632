"""Reference equivalence with NVIDIA kvpress: the same inputs through kvpress's presses and through
kvcompress's policies, compared by kept set and by passkey accuracy.

Runs in its own environment (kvpress needs transformers < 5.3; vLLM is not imported):

    bash scripts/setup_kvpress_env.sh
    OMP_NUM_THREADS=1 .venv-kvpress/bin/python -m benchmarks.kvpress_reference

Prompts: seeded passkey prompts of ~300 tokens, raw text (no chat template): filler sentences with
one "The pass key is N. Remember it." needle at a random depth, ending with the question
"What is the pass key? The pass key is", so the question is the prompt's tail and lies in the
observation window (the last ``WINDOW`` = 8 tokens).

Per prompt the HF model (float32, eager attention) runs once over the prompt; forward hooks keep,
per layer, the attention input, the post-RoPE keys and the softmax probabilities of the last
``WINDOW`` queries. Both sides get these very probabilities:

- kvpress: each press's own ``compress`` is called on them (values carry the positions, so the
  values it returns are the kept positions; Ada-KV's masked indices are read back), with the
  budget turned into kvpress's ``compression_ratio`` so that it keeps ``budget`` tokens per head
  and layer on average.
- kvcompress: ``aggregate_window_probs`` (GQA mean, window sum) then ``plan_keep``, configured
  twice: "kvpress" (kvpress's knobs: avg pooling kernel 5, Ada-KV's floor and uniform totals as
  kvpress computes them) and "defaults" (kvcompress's: max pooling kernel 7, floor 0.2 of the
  selected quota, pyramid totals).

Accuracy: greedy answers of ``NEW_TOKENS`` tokens, right when they contain the pass key. kvpress
runs its own press context manager over the prompt (SDPA attention, which its Ada-KV masking
needs), then decodes as its pipeline does. kvcompress's kept sets are applied by masking: the
first token comes from the full prefill (as in the engine), then every decode step attends, per
KV head, only to that head's kept prompt positions and the generated tokens; that is exactly
evicting the others per head (positions are not renumbered, as in kvpress and the engine).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.report import RESULTS_DIR, command_string, format_table, machine_info, write_json
from kvcompress.policies import (
    PolicySettings,
    aggregate_window_probs,
    layer_budgets,
    plan_keep,
    window_attention_probs,
)

MODEL_DIR = Path(__file__).resolve().parents[1] / ".models" / "SmolLM2-135M-Instruct"
OUTPUT = RESULTS_DIR / "kvpress_reference.json"
METHODS = ("snapkv", "pyramidkv", "adakv", "streamingllm")
DEFAULT_BUDGETS = (64, 128)
WINDOW = 8
NEW_TOKENS = 12
# kvpress's defaults, used on both sides of the "kvpress" configuration.
KVPRESS_KERNEL = 5  # SnapKVPress.kernel_size: avg pooling
KVPRESS_ALPHA = 0.20  # AdaKVPress.alpha_safeguard
KVPRESS_SINKS = 4  # StreamingLLMPress.n_sink
PYRAMID_BETA = 20  # PyramidKVPress.beta, kvcompress's DEFAULT_BETA
# Budgets of the PyramidKV totals table (beyond the run's): kvpress's pyramid engages only once
# budget / beta >= window, i.e. from 160 tokens on.
PYRAMID_TABLE_BUDGETS = (64, 128, 160, 192, 256)

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
FILLER_REPEATS = 11  # ~300 tokens with the needle and the question
QUESTION = "What is the pass key? The pass key is"


# ----------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class PasskeyPrompt:
    text: str
    passkey: str
    depth: float  # needle position as a fraction of the filler sentences


def needle(passkey: str) -> str:
    return f"The pass key is {passkey}. Remember it."


def passkey_prompts(num: int, seed: int, repeats: int = FILLER_REPEATS) -> list[PasskeyPrompt]:
    """``num`` prompts, the same for the same seed: filler, one needle at a random depth, and
    the question last."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        passkey = str(rng.randrange(100_000, 1_000_000))
        sentences = list(FILLER) * repeats
        slot = rng.randint(0, len(sentences))
        sentences.insert(slot, needle(passkey))
        text = " ".join(sentences) + "\n" + QUESTION
        prompts.append(PasskeyPrompt(text, passkey, slot / (len(sentences) - 1)))
    return prompts


def is_correct(answer: str, passkey: str) -> bool:
    return passkey in answer


# ----------------------------------------------------------------------------- kept sets
def kept_mask(indices: torch.Tensor, counts: torch.Tensor, size: int) -> torch.Tensor:
    """Boolean [..., size] from kept positions [..., K] of which the first ``counts`` are real."""
    slots = torch.arange(indices.shape[-1])
    real = slots < counts.unsqueeze(-1)
    target = torch.where(real, indices, size)
    mask = torch.zeros((*indices.shape[:-1], size + 1), dtype=torch.bool)
    return mask.scatter_(-1, target, True)[..., :size]


def overlap_stats(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    """Kept masks [..., S] of both sides: |ours & theirs| / |theirs| averaged over rows, the
    fraction of identical rows, and the tokens each side keeps in all."""
    common = (ours & theirs).sum(dim=-1).float()
    reference = theirs.sum(dim=-1).float().clamp(min=1)
    return {
        "overlap": float((common / reference).mean()),
        "identical": float((ours == theirs).all(dim=-1).float().mean()),
        "kept_ours": int(ours.sum()),
        "kept_theirs": int(theirs.sum()),
    }


def kvpress_ratio(prompt_len: int, budget: int) -> float:
    """The compression_ratio for which kvpress keeps ``budget`` of ``prompt_len`` tokens:
    ``int(prompt_len * (1 - ratio))`` (compute_n_kept) and ``round(...)`` (PyramidKV's fallback)
    both give ``budget``."""
    ratio = 1 - budget / prompt_len
    while int(prompt_len * (1 - ratio)) < budget:
        ratio = math.nextafter(ratio, 0.0)
    return ratio


def kvcache_factory_pyramid(num_layers: int, prompt_len: int, budget: int, window: int,
                            beta: int) -> list[int]:
    """Tokens per head and layer (window included) of PyramidKV's original code
    (KVCache-Factory, pyramidkv_utils.py): integer division for the smallest layer and the step,
    so the layers' sum overshoots num_layers * budget. Prompts under the budget keep all, under
    2 * (budget - window) keep the budget in every layer (the regimes kvcompress follows)."""
    if prompt_len < budget:
        return [prompt_len] * num_layers
    selected = budget - window
    if prompt_len < 2 * selected:
        return [budget] * num_layers
    min_num = selected // beta
    max_num = selected * 2 - min_num
    if max_num >= prompt_len - window:
        max_num = prompt_len - window
        min_num = selected * 2 - max_num
    steps = (max_num - min_num) // (num_layers - 1)
    return [max_num - layer * steps + window for layer in range(num_layers)]


# ----------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class OursConfig:
    name: str
    settings: PolicySettings


def _settings(**fields: Any) -> PolicySettings:
    """PolicySettings, leaving out fields this version of kvcompress does not have yet."""
    known = {field.name for field in dataclasses.fields(PolicySettings)}
    return PolicySettings(**{k: v for k, v in fields.items() if k in known})


def kvpress_adakv_floor(budget: int, window: int, alpha: float) -> float:
    """Our adakv_floor (a fraction of the selected quota, rounded up) that reproduces kvpress's
    floor: int(alpha * budget) tokens per head, window included (the window scores highest)."""
    floor_tokens = max(int(budget * alpha) - window, 0)
    return max(floor_tokens - 0.5, 0) / (budget - window)


def ours_configs(method: str, budget: int) -> list[OursConfig]:
    """kvcompress's settings matching kvpress's, then kvcompress's defaults (one config for
    StreamingLLM, which has no scores)."""
    base = {"method": method, "budget": budget, "window": WINDOW, "beta": float(PYRAMID_BETA),
            "sink_tokens": KVPRESS_SINKS}
    matched = _settings(**base, pooling="avg", pooling_kernel=KVPRESS_KERNEL,
                        adakv_floor=kvpress_adakv_floor(budget, WINDOW, KVPRESS_ALPHA),
                        adakv_totals="uniform")
    if method == "streamingllm":
        return [OursConfig("-", matched)]
    # "defaults": kvcompress's defaults when docs/methods.md's figures were taken (max pooling,
    # kernel 7, beta 20, floor 0.2, pyramid totals), pinned so that the rows stay comparable
    return [OursConfig("kvpress", matched),
            OursConfig("defaults", _settings(**base, pooling="max", pooling_kernel=7,
                                             adakv_floor=0.2, adakv_totals="pyramid"))]


# ----------------------------------------------------------------------------- model side
@dataclass
class Capture:
    """One prompt's prefill: what both sides are fed, and the full cache to decode from."""

    input_ids: torch.Tensor  # [1, S]
    hidden: list[torch.Tensor]  # per layer, attention input [1, S, D]
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    keys: list[torch.Tensor]  # per layer, post-RoPE [1, H_kv, S, hd]
    probs: list[torch.Tensor]  # per layer, eager probabilities of the last W queries [1, H_q, W, S]
    queries: list[torch.Tensor]  # per layer, post-RoPE window queries [1, H_q, W, hd]
    cache: Any  # DynamicCache of the whole prompt
    first_token: int

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])


def load_model(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def capture(model: Any, input_ids: torch.Tensor, window: int) -> Capture:
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layers = model.model.layers
    hidden: list[torch.Tensor] = [torch.empty(0)] * len(layers)
    probs = list(hidden)
    queries = list(hidden)
    rope: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = []

    def attention_hook(module: Any, args: Any, kwargs: dict, output: Any) -> None:
        layer = module.layer_idx
        hidden[layer] = kwargs["hidden_states"].detach().clone()
        probs[layer] = output[1][:, :, -window:, :].detach().clone()
        cos, sin = kwargs["position_embeddings"]
        if not rope:
            rope.append((cos, sin))
        q = module.q_proj(kwargs["hidden_states"][:, -window:])
        q = q.view(1, window, -1, module.head_dim).transpose(1, 2)
        queries[layer] = apply_rotary_pos_emb(q, q, cos[:, -window:], sin[:, -window:])[0]

    for layer in layers:
        hooks.append(layer.self_attn.register_forward_hook(attention_hook, with_kwargs=True))
    cache = DynamicCache(config=model.config)
    try:
        out = model(input_ids=input_ids, past_key_values=cache, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    keys = [cache.layers[i].keys.clone() for i in range(len(layers))]
    return Capture(input_ids, hidden, rope[0], keys, probs, queries, cache,
                   int(out.logits[0, -1].argmax()))


def our_scores(cap: Capture, num_kv_heads: int) -> torch.Tensor:
    """[L, H_kv, S] raw window scores from the captured probabilities (GQA mean, window sum)."""
    per_layer = []
    for probs in cap.probs:
        _, num_q_heads, window, seq = probs.shape
        grouped = probs[0].view(num_kv_heads, num_q_heads // num_kv_heads, window, seq)
        per_layer.append(aggregate_window_probs(grouped, "mean"))
    return torch.stack(per_layer)


def probs_reproduction_error(cap: Capture, num_kv_heads: int) -> float:
    """Max |window_attention_probs(queries, keys) - eager probabilities| over layers: our
    engine's score path recomputes the probabilities the model computed."""
    worst = 0.0
    for q, k, probs in zip(cap.queries, cap.keys, cap.probs):
        ours = window_attention_probs(q[0], k[0])  # [H_kv, G, W, S]
        worst = max(worst, float((ours.flatten(0, 1) - probs[0]).abs().max()))
    return worst


def ours_kept(config: OursConfig, scores: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Our kept mask [L, H_kv, S] from plan_keep."""
    num_layers, num_kv_heads = scores.shape[:2]
    plan = plan_keep(config.settings, [prompt_len], [scores], num_layers=num_layers,
                     num_kv_heads=num_kv_heads)
    return kept_mask(plan.indices[0], plan.counts[0], prompt_len)


@contextlib.contextmanager
def per_head_eviction(keep: torch.Tensor, group: int) -> Iterator[None]:
    """While active, eager attention sees, per layer and KV head, only the prompt positions of
    ``keep`` [L, H_kv, S] (positions from S on, the generated tokens, always)."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.eager_attention_forward
    prompt_len = keep.shape[-1]
    blocked = torch.where(keep, 0.0, float("-inf")).repeat_interleave(group, dim=1)  # [L, H_q, S]

    def masked(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        extra = torch.zeros((1, query.shape[1], 1, key.shape[-2]))
        extra[0, :, 0, :prompt_len] = blocked[module.layer_idx]
        if attention_mask is not None:
            extra = attention_mask[:, :, :, : key.shape[-2]] + extra
        return original(module, query, key, value, extra, scaling, dropout, **kwargs)

    modeling_llama.eager_attention_forward = masked
    try:
        yield
    finally:
        modeling_llama.eager_attention_forward = original


@torch.no_grad()
def decode(model: Any, cache: Any, first_token: int, start: int, new_tokens: int) -> list[int]:
    """Greedy tokens after ``first_token``, positions from ``start`` on (as kvpress's
    pipeline: explicit position ids, so a shortened cache keeps the original positions)."""
    eos = model.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos])
    tokens = [first_token]
    for step in range(new_tokens - 1):
        if tokens[-1] in stop:
            break
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                    position_ids=torch.tensor([[start + step]]))
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def ours_answer(model: Any, cap: Capture, keep: torch.Tensor | None, group: int,
                new_tokens: int) -> list[int]:
    """Decode from the full prefill cache with ``keep`` applied per head (None: full cache);
    the cache is cut back to the prompt afterwards."""
    guard = contextlib.nullcontext() if keep is None else per_head_eviction(keep, group)
    try:
        with guard:
            return decode(model, cap.cache, cap.first_token, cap.prompt_len, new_tokens)
    finally:
        cap.cache.crop(cap.prompt_len)


# ----------------------------------------------------------------------------- kvpress side
def make_press(method: str, prompt_len: int, budget: int) -> Any:
    import kvpress

    ratio = kvpress_ratio(prompt_len, budget)
    if method == "snapkv":
        return kvpress.SnapKVPress(ratio, window_size=WINDOW, kernel_size=KVPRESS_KERNEL)
    if method == "pyramidkv":
        return kvpress.PyramidKVPress(ratio, window_size=WINDOW, kernel_size=KVPRESS_KERNEL,
                                      beta=PYRAMID_BETA)
    if method == "adakv":
        inner = kvpress.SnapKVPress(ratio, window_size=WINDOW, kernel_size=KVPRESS_KERNEL)
        return kvpress.AdaKVPress(inner, alpha_safeguard=KVPRESS_ALPHA)
    if method == "streamingllm":
        return kvpress.StreamingLLMPress(ratio, n_sink=KVPRESS_SINKS)
    raise ValueError(f"unknown method {method!r}")


def layer_stand_in(config: Any, layer: int) -> SimpleNamespace:
    """What a press reads of an attention layer given the attention probabilities: the config
    (heads, layers; "sdpa" so that Ada-KV accepts it), head_dim and layer_idx."""
    return SimpleNamespace(
        config=SimpleNamespace(
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            num_hidden_layers=config.num_hidden_layers,
            _attn_implementation="sdpa",
        ),
        head_dim=config.head_dim,
        layer_idx=layer,
        masked_key_indices=None,
    )


@torch.no_grad()
def kvpress_kept(press: Any, cap: Capture, config: Any) -> torch.Tensor:
    """kvpress's kept mask [L, H_kv, S]: the press's own compress on the captured tensors."""
    seq = cap.prompt_len
    masks = []
    for layer, (hidden, keys, probs) in enumerate(zip(cap.hidden, cap.keys, cap.probs)):
        stand_in = layer_stand_in(config, layer)
        positions = torch.arange(seq, dtype=torch.float32).view(1, 1, seq, 1).expand_as(keys)
        kwargs = {"position_embeddings": cap.position_embeddings}
        _, kept_values = press.compress(stand_in, hidden, keys, positions.clone(), probs, kwargs)
        mask = torch.zeros((keys.shape[1], seq), dtype=torch.bool)
        if stand_in.masked_key_indices is not None:  # Ada-KV masks instead of dropping
            _, heads, tokens = stand_in.masked_key_indices
            mask[:] = True
            mask[heads, tokens] = False
        else:
            mask.scatter_(-1, kept_values[0, :, :, 0].long(), True)
        masks.append(mask)
    return torch.stack(masks)


@torch.no_grad()
def kvpress_answer(model: Any, press: Any, input_ids: torch.Tensor, new_tokens: int) -> list[int]:
    """kvpress end to end: its press context manager over the prompt (SDPA: its Ada-KV masking
    patches the SDPA attention, not eager), then greedy decoding as in its pipeline."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    try:
        cache = DynamicCache(config=model.config)
        with press(model):
            out = model(input_ids=input_ids, past_key_values=cache, logits_to_keep=1)
        first = int(out.logits[0, -1].argmax())
        return decode(model, cache, first, input_ids.shape[1], new_tokens)
    finally:
        model.set_attn_implementation("eager")
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None


@torch.no_grad()
def kvpress_score_check(press_cls: Any, model: Any, cap: Capture) -> float:
    """Max |score from the captured probabilities - score kvpress computes from hidden states|
    over layers (SnapKV): feeding kvpress the probabilities changes nothing but rounding."""
    press = press_cls(0.5, window_size=WINDOW, kernel_size=KVPRESS_KERNEL)
    worst = 0.0
    for layer, module in enumerate(model.model.layers):
        attn = module.self_attn
        args = (attn, cap.hidden[layer], cap.keys[layer], cap.keys[layer])
        kwargs = {"position_embeddings": cap.position_embeddings}
        given = press.score(*args, cap.probs[layer], kwargs)
        own = press.score(*args, None, kwargs)
        worst = max(worst, float((given - own).abs().max()))
    return worst


def pyramid_totals(config: Any, prompt_len: int, budgets: Sequence[int]) -> list[dict[str, Any]]:
    """Tokens per KV head summed over layers, PyramidKV, for one prompt length: ours (exact),
    kvpress's PyramidKVPress.get_layer_budget and the original code's arithmetic."""
    import kvpress

    num_layers = config.num_hidden_layers
    rows = []
    for budget in budgets:
        if budget >= prompt_len:
            continue
        press = kvpress.PyramidKVPress(kvpress_ratio(prompt_len, budget), window_size=WINDOW,
                                       beta=PYRAMID_BETA)
        theirs = [press.get_layer_budget(layer_stand_in(config, layer), prompt_len)
                  for layer in range(num_layers)]
        ours = layer_budgets("pyramidkv", num_layers, prompt_len, budget, None, WINDOW,
                             float(PYRAMID_BETA))
        original = kvcache_factory_pyramid(num_layers, prompt_len, budget, WINDOW, PYRAMID_BETA)
        target = num_layers * budget
        rows.append({
            "prompt_len": prompt_len, "budget": budget, "target": target,
            "ours": sum(ours), "kvpress": sum(theirs), "kvcache_factory": sum(original),
            "kvpress_excess_pct": 100 * (sum(theirs) - target) / target,
            "kvcache_factory_excess_pct": 100 * (sum(original) - target) / target,
            "kvpress_is_pyramid": len(set(theirs)) > 1,
            "ours_layers": [ours[0], ours[-1]], "kvpress_layers": [theirs[0], theirs[-1]],
            "kvcache_factory_layers": [original[0], original[-1]],
        })
    return rows


# ----------------------------------------------------------------------------- the run
@dataclass
class RowTotals:
    method: str
    budget: int
    config: str
    overlap: list[float] = dataclasses.field(default_factory=list)
    identical: list[float] = dataclasses.field(default_factory=list)
    kept_ours: list[int] = dataclasses.field(default_factory=list)
    kept_theirs: list[int] = dataclasses.field(default_factory=list)
    correct_ours: list[bool] = dataclasses.field(default_factory=list)
    correct_theirs: list[bool] = dataclasses.field(default_factory=list)

    def summary(self, full_accuracy: float, heads: int) -> dict[str, Any]:
        def mean(values: Sequence[float]) -> float:
            return sum(values) / len(values)

        ours, theirs = sum(self.kept_ours), sum(self.kept_theirs)
        return {
            "method": self.method, "budget": self.budget, "config": self.config,
            "overlap": mean(self.overlap), "identical": mean(self.identical),
            "kept_per_head_ours": mean(self.kept_ours) / heads,
            "kept_per_head_kvpress": mean(self.kept_theirs) / heads,
            "kept_diff_pct": 100 * (ours - theirs) / theirs,
            "acc_ours": mean(self.correct_ours), "acc_kvpress": mean(self.correct_theirs),
            "acc_full": full_accuracy,
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model)
    config = model.config
    num_kv_heads = config.num_key_value_heads
    group = config.num_attention_heads // num_kv_heads
    layer_heads = config.num_hidden_layers * num_kv_heads
    prompts = passkey_prompts(args.num_prompts, args.seed)

    rows: dict[tuple[str, int, str], RowTotals] = {}
    full_correct: list[bool] = []
    lengths: list[int] = []
    probs_error = 0.0
    score_check = None
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        input_ids = tokenizer(prompt.text, return_tensors="pt").input_ids
        cap = capture(model, input_ids, WINDOW)
        lengths.append(cap.prompt_len)
        probs_error = max(probs_error, probs_reproduction_error(cap, num_kv_heads))
        if score_check is None:
            import kvpress

            score_check = kvpress_score_check(kvpress.SnapKVPress, model, cap)
        answer = tokenizer.decode(ours_answer(model, cap, None, group, args.new_tokens))
        full_correct.append(is_correct(answer, prompt.passkey))
        scores = our_scores(cap, num_kv_heads)
        for method in args.methods:
            for budget in args.budgets:
                press = make_press(method, cap.prompt_len, budget)
                theirs = kvpress_kept(press, cap, config)
                their_answer = tokenizer.decode(
                    kvpress_answer(model, press, input_ids, args.new_tokens))
                for ours_config in ours_configs(method, budget):
                    key = (method, budget, ours_config.name)
                    row = rows.setdefault(key, RowTotals(*key))
                    ours = ours_kept(ours_config, scores, cap.prompt_len)
                    stats = overlap_stats(ours, theirs)
                    row.overlap.append(stats["overlap"])
                    row.identical.append(stats["identical"])
                    row.kept_ours.append(stats["kept_ours"])
                    row.kept_theirs.append(stats["kept_theirs"])
                    answer = tokenizer.decode(
                        ours_answer(model, cap, ours, group, args.new_tokens))
                    row.correct_ours.append(is_correct(answer, prompt.passkey))
                    row.correct_theirs.append(is_correct(their_answer, prompt.passkey))
        print(f"prompt {index + 1}/{len(prompts)}: {cap.prompt_len} tokens, "
              f"{time.perf_counter() - started:.0f} s", flush=True)

    full_accuracy = sum(full_correct) / len(full_correct)
    mean_len = round(sum(lengths) / len(lengths))
    table_budgets = sorted(set(PYRAMID_TABLE_BUDGETS) | set(args.budgets))
    return {
        "command": command_string(),
        "versions": {name: version(name) for name in ("kvpress", "transformers", "torch")},
        "machine": machine_info("cpu"),
        "settings": {
            "model": str(args.model), "num_prompts": args.num_prompts, "seed": args.seed,
            "budgets": args.budgets, "methods": args.methods, "window": WINDOW,
            "new_tokens": args.new_tokens, "chat_template": False, "question": QUESTION,
            "kvpress": {"kernel_size": KVPRESS_KERNEL, "pooling": "avg",
                        "alpha_safeguard": KVPRESS_ALPHA, "n_sink": KVPRESS_SINKS,
                        "beta": PYRAMID_BETA},
        },
        "prompt_len": {"min": min(lengths), "mean": sum(lengths) / len(lengths),
                       "max": max(lengths)},
        "checks": {
            "max_abs_probs_window_attention_probs_vs_eager": probs_error,
            "max_abs_kvpress_snapkv_score_from_probs_vs_from_hidden_states": score_check,
        },
        "layer_heads": layer_heads,
        "full_cache_accuracy": full_accuracy,
        "rows": [row.summary(full_accuracy, layer_heads) for row in rows.values()],
        "pyramid_totals": pyramid_totals(config, mean_len, table_budgets),
        "seconds": time.perf_counter() - started,
    }


COLUMNS = (
    ("method", "method"), ("budget", "budget"), ("config", "ours as"),
    ("overlap", "overlap"), ("identical", "identical"),
    ("kept_per_head_ours", "kept/head ours"), ("kept_per_head_kvpress", "kept/head kvpress"),
    ("kept_diff_pct", "diff %"), ("acc_ours", "acc ours"), ("acc_kvpress", "acc kvpress"),
    ("acc_full", "acc full"),
)
PYRAMID_COLUMNS = (
    ("prompt_len", "prompt"), ("budget", "budget"), ("target", "L*budget"), ("ours", "ours"),
    ("kvpress", "kvpress"), ("kvpress_excess_pct", "kvpress +%"),
    ("kvcache_factory", "original"), ("kvcache_factory_excess_pct", "original +%"),
    ("kvpress_is_pyramid", "kvpress pyramid"),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    write_json(args.output, result)
    print(render(result))
    print(f"\nchecks: {result['checks']}\nwrote {args.output}")


def render(result: dict[str, Any]) -> str:
    """Token overlap and accuracy per method and budget, then PyramidKV's totals."""
    return "\n".join([
        format_table(result["rows"], COLUMNS, digits=3),
        f"\nfull cache accuracy {result['full_cache_accuracy']:.3f}; "
        f"{result['layer_heads']} layer-heads; prompts of {result['prompt_len']['min']}-"
        f"{result['prompt_len']['max']} tokens; versions {result['versions']}",
        "\nPyramidKV tokens per KV head over all layers (window included):",
        format_table(result["pyramid_totals"], PYRAMID_COLUMNS, digits=2),
    ])


if __name__ == "__main__":
    main()
