"""The addition task, its verifier, and the generic text rewards."""

from __future__ import annotations

import pytest

from gyremedia.config import asset_path
from gyremedia.options import validate
from gyremedia.rollout import Media
from gyremedia_rewards.text import FormatOptions, FormatReward, LengthPenalty, LengthPenaltyOptions
from gyremedia_text.reward import AdditionVerifier, AdditionVerifierOptions, digits_in_place
from gyremedia_text.task import answer, extract_answer, is_heldout, make_problems, parse_prompt


def test_prompts_answers_and_their_errors():
    assert parse_prompt("47+385=") == (47, 385) and answer("47+385=") == "432"
    with pytest.raises(ValueError, match="expected decimal operands as 'A\\+B='"):
        parse_prompt("47 plus 385")
    assert extract_answer(" 432<eos>") == "432" and extract_answer("x1") is None


def test_the_shipped_prompt_files_are_disjoint_splits():
    train = open(asset_path("addition/train_prompts.txt")).read().split()
    heldout = open(asset_path("addition/heldout_prompts.txt")).read().split()
    assert len(heldout) == 256 and not set(train) & set(heldout)
    assert all(is_heldout(*parse_prompt(p)) for p in heldout) and not any(is_heldout(*parse_prompt(p)) for p in train)
    assert make_problems(5, seed=3) == make_problems(5, seed=3)


def test_the_verifier_scores_exact_matches_and_digit_credit():
    media = Media("text", ["432", "431", "", "4321"])
    prompts = ["47+385="] * 4
    exact = AdditionVerifier(AdditionVerifierOptions())(media, prompts)
    assert exact["score"].tolist() == [1.0, 0.0, 0.0, 0.0] and exact["answered"].tolist() == [1.0, 1.0, 0.0, 1.0]
    partial = AdditionVerifier(AdditionVerifierOptions(partial_credit=True))(media, prompts)["score"]
    assert partial.tolist() == pytest.approx([1.0, 2 / 3, 0.0, 0.0])
    assert digits_in_place("432", "32") == pytest.approx(2 / 3)


def test_format_and_length_penalty():
    media = Media("text", ["123", "12a", "x" * 100, "x" * 200])
    assert FormatReward(FormatOptions())(media, ["p"] * 4).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert FormatReward(FormatOptions(mode="search"))(media, ["p"] * 4).tolist() == [1.0, 1.0, 0.0, 0.0]
    penalty = LengthPenalty(LengthPenaltyOptions(max_length=150, cache=100))(media, ["p"] * 4)
    assert penalty["score"].tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert validate(LengthPenaltyOptions(max_length=10, cache=20)) == ["cache=20: must not exceed max_length=10"]
    assert "not a regular expression" in validate(FormatOptions(pattern="("))[0]


def test_the_verifier_takes_the_answer_from_the_record_when_it_has_one():
    from gyremedia.data import Prompt

    reward = AdditionVerifier(AdditionVerifierOptions())
    completions = Media("text", ["3", "3"])
    scores = reward(completions, ["1+2=", Prompt("1+2=", {"answer": 4})])["correct"]  # a record may say otherwise
    assert scores.tolist() == [1.0, 0.0]
