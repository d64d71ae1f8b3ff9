"""A hub id whose copy in this machine's hub cache is damaged, or newer than transformers: named as the cache's copy,
with the command that clears it, where `recipe validate` said "not on this machine" and ok (exit 0) and the launch
then stopped on transformers' KeyError, or a ValueError traceback. Subprocesses: huggingface_hub reads the cache's
folder from HF_HOME when it is imported."""

from __future__ import annotations

import pytest
from conftest import run_cli, save_tiny_model

DAMAGE = {
    "tokenizer.json": ('{"version": "1.0", "model": {"type": "BPE"}}',
                       "model.name_or_path: the hub cache's copy of 'org/tiny' is not a tokenizer transformers can "
                       "read (KeyError"),
    "config.json": ('{"model_type": "gpt2", "n_layer": ',
                    "model.name_or_path: the hub cache's copy of 'org/tiny' cannot be read (It looks like the config "
                    "file at"),
    "config.json:newer": ('{"model_type": "gpt9"}',
                          "model.name_or_path: transformers cannot read the config of 'org/tiny': The checkpoint you "
                          "are trying to load has model type `gpt9`"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_hub_cache_copy_transformers_cannot_read_is_named(tmp_path, damage):
    """Offline, as every test runs (a launch reads the hub id online, and falls back on the same copy when the hub is
    out of reach: the same function, model/build.py `_hub_config`). The tokenizer is the hub id's own only where the
    tokenizer is damaged: the config is read first otherwise."""
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny"
    save_tiny_model(snapshot / "snapshots" / "abc", "gpt2")
    (snapshot / "refs").mkdir()
    (snapshot / "refs" / "main").write_text("abc")
    text, said_expected = DAMAGE[damage]
    (snapshot / "snapshots" / "abc" / damage.split(":")[0]).write_text(text)
    tokenizer = "null" if damage == "tokenizer.json" else "builtin:quickstart"
    proc = run_cli("recipe", "validate", "quickstart", "--set", "model.architecture=null", "--set",
                   f"model.tokenizer={tokenizer}", "--set", "model.config_overrides={}",
                   "--set", "model.name_or_path=org/tiny", cwd=tmp_path,
                   env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said
    assert said_expected in said and "Traceback" not in said and "not on this machine" not in said, said
    assert "hf cache rm model/org/tiny" in said, said  # the command of the installed hub CLI
