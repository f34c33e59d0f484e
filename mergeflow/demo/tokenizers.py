"""Tiny tokenizer folders built from scratch (no downloads): the demo's base pipeline and the tests'.

A small byte-level BPE vocabulary is learned in memory from a fixed corpus with the target
class's own normalizer and splitter, wrapped in that Transformers tokenizer class and written
with ``save_pretrained`` plus ``vocab.json`` and ``merges.txt``, like a real base's folder.
Two calls write byte-identical folders.
"""

from __future__ import annotations

import json
import string
from collections import Counter
from pathlib import Path
from typing import Any

# Real prompts plus every printable ASCII character, so any ASCII prompt tokenises without <unk>.
_CORPUS: tuple[str, ...] = (
    "a photo of a cat sitting on a red chair",
    "an astronaut riding a horse on the moon, high quality",
    "a painting of a city at night in the style of van gogh",
    "describe the image by detailing the color, shape, size, texture, quantity, text",
    "a dog running in the park, 4k, cinematic lighting",
    string.ascii_lowercase,
    string.ascii_uppercase,
    string.digits,
    string.punctuation,
)

# Special tokens of Qwen2.5-VL that Qwen-Image prompts and Qwen2VLProcessor rely on.
QWEN2_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Keys that save_pretrained writes but a real hub folder does not carry (absolute local paths,
# loading flags); leaving them would put a path of this machine into every fixture.
_LOCAL_CONFIG_KEYS: tuple[str, ...] = (
    "vocab_file",
    "merges_file",
    "tokenizer_file",
    "is_local",
    "local_files_only",
    "name_or_path",
    "_name_or_path",
)

_BPE_VOCAB_SIZE = 1000


def _corpus() -> list[str]:
    """Return the fixed training corpus (repeated, so that no statistic rests on a single count)."""
    return list(_CORPUS) * 4


def _strip_local_keys(directory: Path) -> None:
    """Drop machine-specific keys from the tokenizer_config.json that save_pretrained wrote."""
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in _LOCAL_CONFIG_KEYS:
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _merge_pair(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """Replace every adjacent occurrence of ``pair`` in ``symbols`` by the merged symbol."""
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def _learn_bpe(template: Any, *, end_of_word: str = "") -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn byte-level BPE merges on the corpus with ``template``'s own normalizer and splitter.

    The ``tokenizers`` trainer breaks ties between equally frequent pairs in hash order, so
    two runs give different vocabularies; fixtures must be byte-identical across builds, so
    the (tiny) merge loop runs here with ties broken by the pair itself.
    """
    from tokenizers import pre_tokenizers

    backend = template.backend_tokenizer
    words: Counter[tuple[str, ...]] = Counter()
    for text in _corpus():
        normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
        for piece, _ in backend.pre_tokenizer.pre_tokenize_str(normalized):
            words[(*piece[:-1], piece[-1] + end_of_word)] += 1
    vocab: dict[str, int] = {}
    for token in template.all_special_tokens:
        vocab.setdefault(token, len(vocab))
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(symbol, len(vocab))
        if end_of_word:
            vocab.setdefault(symbol + end_of_word, len(vocab))
    merges: list[tuple[str, str]] = []
    while len(vocab) < _BPE_VOCAB_SIZE:
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, count in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        merged: Counter[tuple[str, ...]] = Counter()
        for symbols, count in words.items():
            merged[_merge_pair(symbols, best)] += count
        words = merged
    return vocab, merges


def _write_bpe_files(tokenizer: Any, directory: Path) -> None:
    """Write vocab.json and merges.txt next to tokenizer.json, as real BPE folders have them."""
    tokenizer.backend_tokenizer.model.save(str(directory))


def save_qwen2_tokenizer(directory: Path | str) -> Path:
    """Write a tiny Qwen2 byte-level BPE tokenizer folder with the Qwen2.5-VL special tokens."""
    from transformers import Qwen2Tokenizer

    directory = Path(directory)
    vocab, merges = _learn_bpe(Qwen2Tokenizer())
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_SPECIAL_TOKENS[1:])})
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    _write_bpe_files(tokenizer, directory)
    _strip_local_keys(directory)
    return directory
