"""Under a locale whose encoding is not UTF-8 (LANG=C with PYTHONUTF8=0, a Latin-1 locale), recipes, paths and data
in UTF-8 still work: the program starts itself again in Python's UTF-8 mode (cli/main.py, reexec_in_utf8_mode)."""

from __future__ import annotations

from conftest import REPO, run_cli


def test_a_unicode_recipe_at_a_unicode_path_validates_under_an_ascii_locale(tmp_path):
    folder = tmp_path / "données ü"
    folder.mkdir()
    recipe = folder / "récipe.yaml"
    text = (REPO / "recipes" / "quickstart.yaml").read_text(encoding="utf-8")
    recipe.write_text("# Geschichten für café — 日本\n" + text, encoding="utf-8")
    result = run_cli("recipe", "validate", recipe, env={"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}, check=0)
    assert f"ok: {recipe}" in result.stdout
