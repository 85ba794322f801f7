"""Every family against the references: transformers on its tiny random
checkpoints converted by `moe-pipe convert`, and llama.cpp on the same files
and on make-model's tiny preset. What each family is held to, and in which
tier, is its `FamilyOracle` in tests/oracle.py; its own test module checks
what only it has (docs/models.md § Checked against the references).
"""

from __future__ import annotations

import pytest

from moe_pipe.shared.family_registry import FAMILIES

from . import oracle_checks as checks
from .oracle import ORACLES, cases, checkpoint, families

pytestmark = pytest.mark.oracle


@pytest.fixture
def ck(family, config, tmp_path_factory):
    return checkpoint(family, config, tmp_path_factory)


def test_every_family_of_the_registry_has_an_oracle():
    assert set(ORACLES) == {f.name for f in FAMILIES}


# -- transformers ------------------------------------------------------------------


@pytest.mark.parametrize("family,config", cases())
def test_f32_logits_and_greedy_match_transformers(ck):
    checks.check_f32_logits_and_greedy(ck)


@pytest.mark.slow
@pytest.mark.parametrize("family,config", cases(lambda o, c: o.greedy_left_to_slow))
def test_f32_32_greedy_tokens_match_transformers_on_every_prompt(ck):
    checks.check_greedy_rest(ck)


@pytest.mark.parametrize("family,config", cases(slow=lambda o: o.q8_0.slow))
def test_q8_0_stays_close_to_transformers(ck, capsys):
    """q8_0 is lossy: the logit error is reported, and held to the family's bound."""
    report = checks.check_q8_0(ck)
    with capsys.disabled():
        print(f"\n{report}")


@pytest.mark.parametrize("family,config", cases(lambda o, c: o.hf_text))
def test_tokenizer_matches_transformers(ck):
    checks.check_tokenizer_matches_transformers(ck)


@pytest.mark.parametrize("family,config", cases(lambda o, c: o.hf_text))
def test_chat_template_matches_transformers(ck):
    checks.check_chat_template_matches_transformers(ck)


# -- llama.cpp -----------------------------------------------------------------------


@pytest.mark.parametrize("family,config", cases())
def test_llama_cpp_greedy_tokens_match_ours_on_converted_model(ck):
    checks.check_llama_cpp_greedy(ck)


@pytest.mark.parametrize("family", families(slow=lambda o: o.made.slow))
def test_llama_cpp_agrees_on_made_f32_model(family, tmp_path):
    checks.check_made_model(ORACLES[family], tmp_path)


@pytest.mark.parametrize("family", families(slow=lambda o: o.made.slow))
def test_llama_cpp_loads_made_model_in_its_quant_mix(family, tmp_path):
    checks.check_made_model_loads(ORACLES[family], tmp_path)
