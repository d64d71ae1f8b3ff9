"""A bare name is the shipped recipe or accelerate config, also where the current folder holds `<name>.yaml` (a copy
being edited): a note says which file is read, so an edit that seems to change nothing is explained."""

from __future__ import annotations

from accel_fsdp.config import shipped
from conftest import REPO, cli


def test_a_local_copy_named_like_a_shipped_recipe_is_named_in_a_note(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart.yaml").write_text((REPO / "recipes" / "quickstart.yaml").read_text())
    (tmp_path / "fsdp_cpu.yaml").write_text("")
    shipped._say_shadowed.cache_clear()
    code, out = cli("recipe", "validate", "quickstart", "--accelerate-config", "fsdp_cpu")
    assert code == 0, out
    assert ("note: quickstart is the shipped recipe; ./quickstart.yaml in this folder is not read (give "
            "./quickstart.yaml to use it)") in out
    assert "note: fsdp_cpu is the shipped accelerate config; ./fsdp_cpu.yaml in this folder is not read" in out
    shipped._say_shadowed.cache_clear()
    code, out = cli("recipe", "validate", "./quickstart.yaml")  # the user's path: read, nothing to say
    assert code == 0 and "note: quickstart is the shipped" not in out, out
