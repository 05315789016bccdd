"""Structured outputs in the engine: JSON, JSON schemas, regexes and EBNF grammars through xgrammar, exact under
speculation (chains and trees), on a tiny model with SmolLM2's tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from mtpserve.cluster.engine.errors import InvalidRequestError
from mtpserve.cluster.engine.grammar_spec import GrammarSpec
from mtpserve.cluster.engine.llm_engine import LLMEngine
from mtpserve.workers.config import MTPServeConfig
from tests.helpers.service import write_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "sunny": {"type": "boolean"},
        "rating": {"enum": ["low", "mid", "high"]},
    },
    "required": ["city", "sunny", "rating"],
    "additionalProperties": False,
}
SPECULATION: dict[str, dict[str, Any]] = {
    "target-only": {"enabled": False},
    "chain K=3": {"num_draft_tokens": 3, "adaptive": False},
    "tree": {"num_draft_tokens": 3, "tree_budget": 8, "tree_width": 3, "adaptive": False},
    "adaptive": {"num_draft_tokens": 3, "tree_budget": 8, "tree_width": 3},  # the default, over a tree too
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def _engine(tiny: tuple[Path, Path], spec: str) -> LLMEngine:
    speculative = {"draft": str(tiny[1]), **SPECULATION[spec]}
    cfg = MTPServeConfig.from_dict(
        {"model": {"path": str(tiny[0]), "device": "cpu", "dtype": "float32"}, "speculative": speculative}
    )
    return LLMEngine.from_config(cfg)


@pytest.fixture(scope="module")
def engines(tiny: tuple[Path, Path]) -> dict[str, LLMEngine]:
    return {spec: _engine(tiny, spec) for spec in SPECULATION}


def _run(eng: LLMEngine, grammar: GrammarSpec, **params: Any) -> list[Any]:
    prompts = [eng.encode_prompt(q) for q in ("Describe the weather in Paris.", "Rate Rome.", "Hi")]
    return eng.generate(prompts, {"max_tokens": 96, "grammar": grammar, **params})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_replies_validate_and_speculation_is_exact(
    engines: dict[str, LLMEngine], temperature: float
) -> None:
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    sampled = {"temperature": temperature, "seed": 5} if temperature else {}
    outs = {spec: _run(eng, grammar, **sampled) for spec, eng in engines.items()}
    for spec, out in outs.items():
        for c in out:
            assert c.finish_reason == "stop", (spec, c.text)
            jsonschema.validate(json.loads(c.text), SCHEMA)
    for spec in ("chain K=3", "tree", "adaptive"):  # greedy, and seeded sampling (keyed by position)
        assert [c.token_ids for c in outs[spec]] == [c.token_ids for c in outs["target-only"]], spec
    assert engines["chain K=3"].totals.accepted > 0, "drafts that fit the grammar are accepted"
    plain = engines["target-only"].generate([engines["target-only"].encode_prompt("Hi")], {"max_tokens": 20})
    with pytest.raises(ValueError):
        json.loads(plain[0].text)  # the model alone writes no JSON


def test_json_object_regex_and_grammar(engines: dict[str, LLMEngine]) -> None:
    eng = engines["chain K=3"]
    closing = {eng.tokenizer.convert_tokens_to_ids(t): 30.0 for t in ('"', "}")}  # a random model never ends a string
    for c in _run(eng, GrammarSpec("json_object"), temperature=0.8, seed=2, logit_bias=closing):
        assert isinstance(json.loads(c.text), dict) and c.finish_reason == "stop", c.text
    for c in _run(eng, GrammarSpec("regex", r"(yes|no), [0-9]{2,3}!")):
        assert re.fullmatch(r"(yes|no), [0-9]{2,3}!", c.text), c.text
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= "a" | "bb" | "ccc"'
    for c in _run(eng, GrammarSpec("grammar", ebnf), temperature=1.0, seed=3):
        assert re.fullmatch(r"\((a|bb|ccc)(,(a|bb|ccc))*\)", c.text), c.text
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (GrammarSpec("json_schema", "{not json"), "response_format"),
        (GrammarSpec("regex", "(unclosed", field="structured_outputs.regex"), "structured_outputs.regex"),
        (GrammarSpec("grammar", "root ::= missing_rule", field="structured_outputs.grammar"), "structured_outputs"),
    ],
)
def test_bad_grammars_are_refused_by_field(engines: dict[str, LLMEngine], grammar: GrammarSpec, message: str) -> None:
    eng = engines["target-only"]
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([1, 2, 3], {"max_tokens": 4, "grammar": grammar})
    assert message in str(err.value)
    assert not eng.has_unfinished()


@pytest.mark.parametrize("spec", ["chain K=3", "tree"])
def test_a_completed_grammar_ends_the_request_even_with_ignore_eos(engines: dict[str, LLMEngine], spec: str) -> None:
    """With ignore_eos the stop token the grammar ends on does not stop the request by itself, and a verify row
    after it allows every token: the grammar's end must still end the output there."""
    eng = engines[spec]
    for c in _run(eng, GrammarSpec("json_schema", json.dumps(SCHEMA)), ignore_eos=True, temperature=0.7, seed=9):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.token_ids[-1] in eng.args.eos_ids(), "the output ends on the grammar's stop token"
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


def test_tokens_after_the_grammars_stop_token_are_not_output(engines: dict[str, LLMEngine]) -> None:
    eng = engines["target-only"]
    tok, eos = eng.tokenizer, eng.args.eos_ids()[0]
    grammar = eng._grammars("response_format").matcher(GrammarSpec("regex", "(yes|no)"))
    yes = tok.encode("yes", add_special_tokens=False)
    assert grammar.accept([*yes, eos, *tok.encode("no", add_special_tokens=False)]) == len(yes) + 1
    assert grammar.terminated
    refused = eng._grammars("response_format").matcher(GrammarSpec("regex", "(yes|no)"))
    assert refused.accept(tok.encode("maybe", add_special_tokens=False)) == 0 and refused.terminated
