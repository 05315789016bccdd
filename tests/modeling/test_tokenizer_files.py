"""The tokenizer beside a model's weights loads through `PreTrainedTokenizerFast` when it is generic, and then
behaves exactly as `AutoTokenizer`'s: same ids, text, special tokens and chat template."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mtpserve.modeling.tokenizer_files import load_tokenizer, loads_generic, tokenizer_class
from tests.helpers.hf_tiny import write_hf_target
from tests.helpers.service import TOKENIZER_FILES, default_tokenizer_dir

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "naïve café — 東京 🚀", "<|im_start|>user\nhi<|im_end|>"]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ],
]


def _copy_tokenizer(dest: Path, template_file: bool, with_config: bool = True) -> Path:
    """SmolLM2's tokenizer files (and its llama config.json unless told not to) copied into `dest`."""
    src = default_tokenizer_dir()
    for name in (*TOKENIZER_FILES, "config.json") if with_config else TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    if template_file:  # the template in chat_template.jinja only, as newer checkpoints save it
        config = json.loads((dest / "tokenizer_config.json").read_text())
        template = config.pop("chat_template", None) or (src / "chat_template.jinja").read_text()
        (dest / "tokenizer_config.json").write_text(json.dumps(config))
        (dest / "chat_template.jinja").write_text("{# own #}" + template)
    return dest


@pytest.mark.parametrize("template_file", [False, True])
def test_generic_tokenizer_behaves_as_auto_tokenizer(tmp_path: Path, template_file: bool) -> None:
    directory = _copy_tokenizer(tmp_path, template_file)
    assert tokenizer_class(directory) == "TokenizersBackend" and loads_generic(directory)
    ours, auto = load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
    assert ours.get_vocab() == auto.get_vocab()
    special = ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id")
    assert [getattr(ours, s) for s in special] == [getattr(auto, s) for s in special]
    assert ours.all_special_ids == auto.all_special_ids
    assert ours.chat_template == auto.chat_template and ours.chat_template
    for text in TEXTS:
        ids = auto.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == auto.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    for chat in CHATS:
        for gen in (False, True):
            kwargs = {"tokenize": False, "add_generation_prompt": gen}
            assert ours.apply_chat_template(chat, **kwargs) == auto.apply_chat_template(chat, **kwargs)


def test_generic_tokenizer_loads_without_torch() -> None:
    code = (
        "import sys; from pathlib import Path; from mtpserve.modeling.tokenizer_files import load_tokenizer; "
        f"tok = load_tokenizer(Path({str(default_tokenizer_dir())!r})); "
        "print(tok.encode('hi'), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    ids, torch_loaded = out.stdout.rsplit(" ", 1)
    assert json.loads(ids) and torch_loaded.strip() == "False", out.stdout


def test_other_classes_go_through_auto_tokenizer(tmp_path: Path) -> None:
    generic = _copy_tokenizer(tmp_path, template_file=False)
    named = tmp_path / "named"
    named.mkdir()
    _copy_tokenizer(named, template_file=False)
    config = json.loads((named / "tokenizer_config.json").read_text())
    (named / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2TokenizerFast"}))
    assert tokenizer_class(named) == "GPT2TokenizerFast"
    tok = load_tokenizer(named)
    assert type(tok) is type(AutoTokenizer.from_pretrained(str(named)))
    assert tok.encode("Hello there") == load_tokenizer(generic).encode("Hello there")


def test_a_family_that_builds_its_own_class_goes_through_auto_tokenizer(tmp_path: Path) -> None:
    """A qwen2 config beside a generic tokenizer: `AutoTokenizer` builds Qwen2's class (its own normalizer and
    pre-tokenizer), and so does `load_tokenizer`."""
    write_hf_target(tmp_path, "qwen2", mimic=True, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    _copy_tokenizer(tmp_path, template_file=False, with_config=False)
    assert not loads_generic(tmp_path)
    ours, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(auto) and type(auto).__name__ != "TokenizersBackend"
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
