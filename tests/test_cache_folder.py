"""The project's cache folder as the environment chooses it: a variable that names a file, a relative or `~` path, an
empty XDG_CACHE_HOME; and a generated file in it that a disk or a person damaged since."""

from __future__ import annotations

import pytest

from accel_fsdp.errors import UserError
from accel_fsdp.layout import cache_dir, compile_cache_dir
from conftest import user_error


@pytest.mark.parametrize("below", ["", "sub/deeper"])
def test_a_cache_variable_naming_a_file_is_one_message_naming_the_variable(tmp_path, monkeypatch, below):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    value = str(a_file / below) if below else str(a_file)
    monkeypatch.setenv("ACCEL_FSDP_CACHE", value)
    out = user_error("data", "prepare", "quickstart")
    shown = f"{value!r} is" if not below else f"{value!r}: {a_file} is"
    assert f"ACCEL_FSDP_CACHE: {shown} a file, not a folder" in out
    assert "fix: export ACCEL_FSDP_CACHE=<a folder>" in out
    assert a_file.read_text() == "x"  # nothing the user had is changed


def test_the_compile_cache_variable_is_checked_like_the_cache(tmp_path, monkeypatch):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "link"))
    with pytest.raises(UserError, match="TORCHINDUCTOR_CACHE_DIR: .*link' is a link that leads nowhere, not a folder"):
        compile_cache_dir()


def test_relative_home_and_empty_values_give_an_absolute_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCEL_FSDP_CACHE", "relative/cache")
    assert cache_dir() == tmp_path / "relative" / "cache"  # read where the command started; the ranks share it
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ACCEL_FSDP_CACHE", "~/cache")  # quoted in a shell: no `~` folder in the current one
    assert cache_dir() == tmp_path / "home" / "cache"
    monkeypatch.setenv("ACCEL_FSDP_CACHE", "")  # as unset
    for xdg in ("", "relative"):  # the XDG spec: ignored, not a folder `accel_fsdp` wherever the command runs
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert cache_dir() == tmp_path / "home" / ".cache" / "accel_fsdp"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "accel_fsdp"


def test_a_damaged_built_in_data_file_is_generated_again_not_blamed_on_data_path(tmp_path, monkeypatch):
    from accel_fsdp.data.synthetic import write_builtin

    monkeypatch.setenv("ACCEL_FSDP_CACHE", str(tmp_path))
    path = write_builtin("quickstart", rows=200)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # cut mid-line: a disk, a copy cut short
    assert write_builtin("quickstart", rows=200).read_bytes() == whole
    path.with_name(path.name + ".crc32").unlink()  # a cache from before the checksum: generated once more
    path.write_bytes(b"")
    assert write_builtin("quickstart", rows=200).read_bytes() == whole


def test_a_damaged_cached_tokenizer_is_trained_again(tmp_path, monkeypatch):
    from accel_fsdp.config.recipe import recipe_from_text
    from accel_fsdp.model.tokenizer import _bpe_cache_folder, trained_tokenizer

    monkeypatch.setenv("ACCEL_FSDP_CACHE", str(tmp_path))
    recipe = recipe_from_text('model: {architecture: gpt2, tokenizer: "bpe:300"}\n'
                              'data: {path: "builtin:quickstart", seq_len: 64}\n', source="r.yaml")
    words = trained_tokenizer(recipe).tokenize("alice has a red cat .")
    saved = _bpe_cache_folder(recipe, 300) / "tokenizer.json"
    saved.write_text(saved.read_text()[:20])
    assert trained_tokenizer(recipe).tokenize("alice has a red cat .") == words


def test_a_hugging_face_cache_variable_naming_a_file_is_named_not_taken_for_a_network_failure(tmp_path, monkeypatch):
    """The hub libraries said "Not a directory: .../token", which the check of the hub answered with "the hub cannot be
    reached ... fix the network"."""
    a_file = tmp_path / "hf"
    a_file.write_text("x")
    monkeypatch.setenv("HF_HOME", str(a_file))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(a_file / "datasets"))
    out = user_error("recipe", "run", "gpt2", "--cpu", "--output-dir", tmp_path / "run")
    assert f"HF_HOME: '{a_file}' is a file, not a folder" in out
    assert f"HF_DATASETS_CACHE: '{a_file / 'datasets'}': {a_file} is a file, not a folder" in out
    assert "fix: export HF_HOME=<a folder> (it is created if missing), or unset it" in out
    assert not (tmp_path / "run").exists() and a_file.read_text() == "x"
