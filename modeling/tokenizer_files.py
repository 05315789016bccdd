"""Load the tokenizer saved beside a model's weights, without loading the model's config classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# tokenizer_config.json classes that are tokenizer.json plus tokenizer_config.json and nothing model-specific
GENERIC_FAST_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# config.json model types for which `AutoTokenizer` keeps a generic class as it is (for others, such as qwen2, it
# builds the family's own class, which redoes the normalizer and pre-tokenizer)
GENERIC_MODEL_TYPES = frozenset({"llama"})


def json_name(path: Path, key: str) -> str | None:
    """The string that the JSON file at `path` holds under `key`, or None (no file, no such string)."""
    if not path.is_file():
        return None
    name = json.loads(path.read_text()).get(key)
    return name if isinstance(name, str) else None


def tokenizer_class(directory: Path) -> str | None:
    """The `tokenizer_class` that `directory/tokenizer_config.json` names, or None."""
    return json_name(directory / "tokenizer_config.json", "tokenizer_class")


def loads_generic(directory: Path) -> bool:
    """Whether `AutoTokenizer` would load the tokenizer in `directory` as the generic fast class."""
    return (
        (directory / "tokenizer.json").is_file()
        and tokenizer_class(directory) in GENERIC_FAST_CLASSES
        and json_name(directory / "config.json", "model_type") in GENERIC_MODEL_TYPES
    )


def load_tokenizer(directory: Path) -> Any:
    """The HF tokenizer in `directory`, as `AutoTokenizer` loads it. One that `AutoTokenizer` would load as the
    generic fast class loads through `PreTrainedTokenizerFast` directly, which needs neither torch nor the model
    family's modules (importing those costs seconds of start-up in every process that loads a tokenizer)."""
    if loads_generic(directory):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
