"""`tokenizer train --vocab-size N` on text with fewer merges than N: the smaller vocabulary is said, not left for the
user to find in the model's embedding."""

from __future__ import annotations

from conftest import run_in_process, tiny_recipe


def test_a_vocabulary_larger_than_the_text_allows_is_said(tmp_path, tiny_gpt2, stories):
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories)
    proc = run_in_process("tokenizer", "train", recipe, tmp_path / "tok", "--vocab-size", "1000000", check=0)
    assert "note: the text has merges for" in proc.stderr and "fewer than --vocab-size 1,000,000" in proc.stderr
    proc = run_in_process("tokenizer", "train", recipe, tmp_path / "small", "--vocab-size", "300", check=0)
    assert "wrote a byte-level BPE tokenizer of 300 tokens" in proc.stdout and "note:" not in proc.stderr
