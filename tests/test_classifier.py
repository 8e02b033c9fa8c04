"""Cold-start prompt classifier (§11)."""

from __future__ import annotations

import pytest

from gearbx_mlx.classifier import classify_prompt


def test_formula_terms():
    c = classify_prompt("Hello there, how are you?")
    assert c.n_math == 0 and c.n_code == 0
    assert c.score == pytest.approx(0.3 * 5 / 50)
    assert c.gear == "low"


def test_math_prompt_starts_high():
    c = classify_prompt("Solve 3x + 5 = 20, then compute 7 * 6 / 2.")
    assert c.n_math >= 4 and c.gear == "high"


def test_code_keywords_start_mid():
    c = classify_prompt("Write a python function that returns a list")
    assert c.n_code == 2  # function, list (return is "returns")
    assert c.score == pytest.approx(1.5 * 2 + 0.3 * 8 / 50)
    assert c.gear == "mid"


def test_long_words_and_hyphens():
    c = classify_prompt("Extraordinarily sophisticated architectural considerations")
    assert c.mean_word_length > 6.5 and c.score >= 1.5
    assert classify_prompt("a well-known state-of-the-art idea").n_math == 0
    assert classify_prompt("10 - 3").n_math == 1


def test_word_count_term_is_capped():
    c = classify_prompt("word " * 1000)
    assert c.score == pytest.approx(0.3 * 3)


def test_type_error():
    with pytest.raises(TypeError):
        classify_prompt(42)  # type: ignore[arg-type]
