"""The project's own byte-level BPE tokenizers, and tokenizer fingerprints.

The tiny models need a tokenizer that exists without a download. It is trained here,
in a fraction of a second, on synthetic arithmetic text (the corpus is a pure function
of a seed, so training twice gives the same tokenizer).

Why the pre-tokenizer is Qwen2's: the tiny models are ``Qwen2ForCausalLM`` folders, and
``AutoTokenizer`` on a folder whose config says ``model_type: qwen2`` returns
``Qwen2Tokenizer``, which rebuilds the normaliser and pre-tokenizer with Qwen2's own
(NFC, the digit-splitting split regex, ByteLevel without its regex) and keeps only the
vocabulary and merges from the file. vLLM loads tokenizers the same way. Training with
exactly that pipeline, and saving through ``Qwen2Tokenizer`` itself, makes
AutoTokenizer, PreTrainedTokenizerFast, vLLM and the raw ``tokenizers.Tokenizer`` all
produce the same ids.

A second recipe (``ALT``) gives a tokenizer with another vocabulary for the ``tiny-alt``
model: a different size, corpus and a seeded permutation of the ids, so no id means the
same piece in both (a peer that mixed them up would fail loudly, not subtly).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)

# The split regex Qwen2Tokenizer installs (digits are split one by one).
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Maria", "Omar", "Priya", "Tom")
_ITEMS = (
    "apples",
    "oranges",
    "books",
    "coins",
    "pencils",
    "cookies",
    "marbles",
    "stickers",
    "cards",
    "flowers",
    "eggs",
    "tickets",
    "stamps",
    "shells",
    "candies",
    "balloons",
)
_TEMPLATES = (
    "{a}+{b}=<answer>{s}</answer>",
    "{a}-{b}=<answer>{d}</answer>",
    "{a}+{b}-{c}=<answer>{e}</answer>",
    "What is {a} plus {b}? The answer is {s}.",
    "What is {a} minus {b}? The answer is {d}.",
    "Calculate {a} + {b} - {c}. The result equals {e}.",
    "State the final answer to the following arithmetic problem: {a} + {b} = {s}",
    "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now? {s}",
    "{name} had {a} {item} and gave {b} to a friend. How many {item} are left? {d}",
    "The sum of {a} and {b} is {s}, and their difference is {d}.",
    "Put only the final answer between <answer> and </answer>, e.g. <answer>{s}</answer>.",
    "Each of {b} boxes holds {a} {item}; in total there are {p} {item}.",
    "Think step by step, then write the number: first add {a} and {b}, then subtract {c}.",
)


class TokenizerRecipe(BaseModel):
    """Everything that decides a trained tokenizer; equal recipes give equal tokenizers."""

    model_config = ConfigDict(frozen=True)

    vocab_size: int = Field(512, ge=len(SPECIAL_TOKENS) + 256, le=65536)
    corpus_seed: int = 0
    corpus_size: int = Field(4000, ge=100)
    shuffle_seed: int | None = Field(None, description="Permute the non-special ids with this seed.")


PROJECT = TokenizerRecipe()
ALT = TokenizerRecipe(vocab_size=384, corpus_seed=1, shuffle_seed=1)


def arithmetic_corpus(seed: int, size: int) -> list[str]:
    """``size`` lines of arithmetic text, a pure function of ``seed``."""
    rng = random.Random(seed)
    lines = []
    for _ in range(size):
        a, b, c = rng.randint(0, 999), rng.randint(0, 99), rng.randint(0, 99)
        lines.append(
            rng.choice(_TEMPLATES).format(
                a=a, b=b, c=c, s=a + b, d=a - b, e=a + b - c, p=a * b, name=rng.choice(_NAMES), item=rng.choice(_ITEMS)
            )
        )
    return lines


def _qwen2_pipeline(tok: Tokenizer) -> None:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()


def train_bpe(recipe: TokenizerRecipe = PROJECT) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train the BPE; returns (vocab, merges). Specials get ids 0 and 1."""
    tok = Tokenizer(models.BPE())
    _qwen2_pipeline(tok)
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknowns
        show_progress=False,
    )
    tok.train_from_iterator(arithmetic_corpus(recipe.corpus_seed, recipe.corpus_size), trainer)
    state = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = state["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    if recipe.shuffle_seed is not None:
        pieces = sorted((p for p in vocab if p not in SPECIAL_TOKENS), key=vocab.__getitem__)
        random.Random(recipe.shuffle_seed).shuffle(pieces)
        vocab = {**{s: vocab[s] for s in SPECIAL_TOKENS}, **{p: i + len(SPECIAL_TOKENS) for i, p in enumerate(pieces)}}
    return vocab, merges


def build_tokenizer(recipe: TokenizerRecipe = PROJECT, model_max_length: int = 512) -> Any:
    """The trained tokenizer as a transformers ``Qwen2Tokenizer`` (see the module docstring)."""
    from transformers import Qwen2Tokenizer

    vocab, merges = train_bpe(recipe)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # transformers annotates list[str]; tokenizers' BPE takes pairs
        unk_token=None,  # type: ignore[arg-type]  # annotated str, but None (no unknown token) is accepted
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
    )


def save_tokenizer(folder: str | Path, recipe: TokenizerRecipe = PROJECT, model_max_length: int = 512) -> Any:
    """Train, then write tokenizer.json + tokenizer_config.json into ``folder``; returns the tokenizer."""
    tokenizer = build_tokenizer(recipe, model_max_length)
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable hash of what decides token ids (and how ids read back as text).

    Covers the vocabulary, merges, normaliser, pre-tokenizer, post-processor, decoder and
    added tokens; leaves out padding and truncation settings, which transformers changes
    per call. Accepts a transformers tokenizer or a ``tokenizers.Tokenizer``. Two nodes
    whose fingerprints are equal can use each other's token ids directly.
    """
    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
    elif hasattr(tokenizer, "get_vocab"):  # a Python tokenizer: the vocabulary is what we can see
        state = {
            "class": type(tokenizer).__name__,
            "vocab": tokenizer.get_vocab(),
            "special": sorted(map(str, getattr(tokenizer, "all_special_tokens", []))),
        }
    else:
        raise TypeError(f"cannot fingerprint {type(tokenizer).__name__}: not a tokenizer")
    blob = json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]
