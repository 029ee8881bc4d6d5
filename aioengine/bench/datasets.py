"""Benchmark workloads: seeded lists of `BenchRequest`s that every mode and engine share.

    random        prompts of random token ids, lengths uniform in [input_len_min, input_len_max]
    shared-prefix P random prefixes of L tokens, each followed by distinct S-token suffixes
                  (prefix caching turns all but the first use of a prefix into a cache hit)
    text          English prompts shipped with the package (data/prompts.jsonl), tokenized
    grounded      input-grounded prompts shipped with the package (data/grounded.jsonl):
                  150-400 words of text or Python code to repeat, correct, summarise (quoting
                  it) or edit and return whole, so the answer copies much of the prompt:
                  the workload of n-gram speculative decoding (`--speculative-config`)

Every request asks for exactly `output_len` tokens (EOS ignored), so every engine does
the same work and outputs are comparable position by position.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any

DATASETS = ("random", "shared-prefix", "text", "grounded")
_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
PROMPTS_FILE = os.path.join(_DATA, "prompts.jsonl")
GROUNDED_FILE = os.path.join(_DATA, "grounded.jsonl")
# The datasets read from a shipped file of {"prompt": ...} lines (`text_dataset`).
TEXT_FILES = {"text": PROMPTS_FILE, "grounded": GROUNDED_FILE}


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    `prompt_token_ids` is always set (offline engines and `/v1/completions` take ids);
    `prompt_text` is the prompt as the user wrote it (text dataset) or the ids decoded,
    for endpoints that only take text (chat).
    """

    prompt_token_ids: list[int]
    prompt_text: str | None
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    seed: int
    # dataset parameters, recorded with the results
    params: dict[str, Any]

    @property
    def prompts(self) -> list[list[int]]:
        return [r.prompt_token_ids for r in self.requests]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_len(self) -> int:
        """The (single) output length every request asks for."""
        return self.requests[0].output_len

    def summary(self) -> dict[str, Any]:
        lens = [r.prompt_len for r in self.requests]
        return {"dataset": self.name, "num_prompts": len(lens), "prompt_len_min": min(lens),
                "prompt_len_max": max(lens), "num_prompt_tokens": sum(lens),
                "output_len": self.output_len, "seed": self.seed, **self.params}


def normal_vocab(tokenizer: Any) -> list[int]:
    """Token ids a prompt may use: the whole vocabulary minus special and added tokens.

    Special tokens (BOS, <|im_start|>, ...) would change the model's behaviour in ways
    no real prompt does, and some engines treat them specially on input.
    """
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return [i for i in range(len(tokenizer)) if i not in excluded]


def _check_counts(num_prompts: int, output_len: int) -> None:
    if num_prompts < 1 or output_len < 1:
        raise ValueError("num_prompts and output_len must be >= 1")


def random_dataset(vocab: list[int], num_prompts: int, input_len_min: int, input_len_max: int,
                   output_len: int, seed: int) -> Workload:
    """Seeded: the same arguments always give the same prompts (the W1 workload is
    `random_dataset(vocab, 32, 32, 256, 64, 0)`)."""
    if not 1 <= input_len_min <= input_len_max:
        raise ValueError(f"need 1 <= input_len_min <= input_len_max, got "
                         f"[{input_len_min}, {input_len_max}]")
    _check_counts(num_prompts, output_len)
    rng = random.Random(seed)
    # Draw order (length, then ids, per prompt) is part of the workload's identity: keep it.
    prompts = [rng.choices(vocab, k=rng.randint(input_len_min, input_len_max))
               for _ in range(num_prompts)]
    return Workload("random", [BenchRequest(p, None, output_len) for p in prompts], seed,
                    {"input_len_min": input_len_min, "input_len_max": input_len_max})


def shared_prefix_dataset(vocab: list[int], num_prompts: int, num_prefixes: int,
                          prefix_len: int, suffix_len: int, output_len: int,
                          seed: int) -> Workload:
    """Request i uses prefix `i % num_prefixes` plus its own suffix; the order is then
    shuffled (seeded) so requests sharing a prefix arrive interleaved, as users would."""
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 1:
        raise ValueError("num_prefixes, prefix_len and suffix_len must be >= 1")
    if num_prompts < num_prefixes:
        raise ValueError(f"num_prompts ({num_prompts}) < num_prefixes ({num_prefixes})")
    _check_counts(num_prompts, output_len)
    rng = random.Random(seed)
    prefixes = [rng.choices(vocab, k=prefix_len) for _ in range(num_prefixes)]
    prompts = []
    seen: set[tuple[int, ...]] = set()
    for i in range(num_prompts):
        suffix = rng.choices(vocab, k=suffix_len)
        # Invariant: suffixes are distinct, so no two requests are identical.
        while tuple(suffix) in seen:
            suffix = rng.choices(vocab, k=suffix_len)
        seen.add(tuple(suffix))
        prompts.append(prefixes[i % num_prefixes] + suffix)
    rng.shuffle(prompts)
    return Workload("shared-prefix", [BenchRequest(p, None, output_len) for p in prompts], seed,
                    {"num_prefixes": num_prefixes, "prefix_len": prefix_len,
                     "suffix_len": suffix_len})


def load_prompt_texts(path: str = PROMPTS_FILE) -> list[str]:
    """The `prompt` field of each JSON line."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                texts.append(json.loads(line)["prompt"])
    return texts


def text_dataset(tokenizer: Any, num_prompts: int, output_len: int, seed: int,
                 path: str = PROMPTS_FILE, name: str = "text") -> Workload:
    """`num_prompts` prompts in a seeded order, cycling through the file when it has fewer;
    token ids are the prompt's text tokens (no BOS), as a completions server would see it.
    `name` is the workload's dataset name (a key of TEXT_FILES)."""
    _check_counts(num_prompts, output_len)
    texts = load_prompt_texts(path)
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    requests = []
    for i in range(num_prompts):
        text = texts[order[i % len(order)]]
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        requests.append(BenchRequest(ids, text, output_len))
    return Workload(name, requests, seed, {"path": os.path.basename(path)})


def grounded_dataset(tokenizer: Any, num_prompts: int, output_len: int,
                     seed: int) -> Workload:
    """The shipped input-grounded prompts (GROUNDED_FILE), as `text_dataset` reads them."""
    return text_dataset(tokenizer, num_prompts, output_len, seed, GROUNDED_FILE, "grounded")


def build_workload(args: Any, tokenizer: Any) -> Workload:
    """The workload the command line asks for (`--dataset` and its flags)."""
    if args.dataset in TEXT_FILES:
        return text_dataset(tokenizer, args.num_prompts, args.output_len, args.seed,
                            TEXT_FILES[args.dataset], args.dataset)
    vocab = normal_vocab(tokenizer)
    if args.dataset == "random":
        return random_dataset(vocab, args.num_prompts, args.input_len_min, args.input_len_max,
                              args.output_len, args.seed)
    if args.dataset == "shared-prefix":
        return shared_prefix_dataset(vocab, args.num_prompts, args.num_prefixes,
                                     args.prefix_len, args.suffix_len, args.output_len,
                                     args.seed)
    raise ValueError(f"unknown dataset {args.dataset!r}; choose from {DATASETS}")


def with_text(workload: Workload, tokenizer: Any) -> Workload:
    """Fills `prompt_text` of token-id prompts by decoding them (for chat endpoints).

    The server re-tokenizes the text, so its prompt length may differ slightly from
    `prompt_len`; the serve results count prompt tokens from the server's usage.
    """
    requests = [r if r.prompt_text is not None else
                BenchRequest(r.prompt_token_ids, tokenizer.decode(r.prompt_token_ids),
                             r.output_len)
                for r in workload.requests]
    return Workload(workload.name, requests, workload.seed, workload.params)


def add_dataset_args(parser: Any) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--output-len", type=int, default=64,
                   help="exact output tokens per request (EOS ignored)")
    g.add_argument("--input-len-min", type=int, default=32, help="random: shortest prompt")
    g.add_argument("--input-len-max", type=int, default=256, help="random: longest prompt")
    g.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: P")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: L tokens")
    g.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: S tokens")
