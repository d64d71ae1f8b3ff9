"""A path typed with a trailing separator names a folder: `recipe copy quickstart newdir/` and `slurm -o jobs/`
wrote a FILE named newdir / jobs (pathlib drops the separator). Refused when no such folder exists, nothing written;
an existing folder still takes the copy."""

from __future__ import annotations

from conftest import run_in_process, user_error


def test_recipe_copy_into_a_folder_that_does_not_exist_is_refused(tmp_path):
    out = user_error("recipe", "copy", "quickstart", f"{tmp_path}/newdir/")
    assert f"{tmp_path}/newdir/: folder does not exist" in out and "mkdir -p" in out
    assert not (tmp_path / "newdir").exists()
    (tmp_path / "there").mkdir()
    run_in_process("recipe", "copy", "quickstart", f"{tmp_path}/there/", check=0)
    assert (tmp_path / "there" / "quickstart.yaml").is_file()


def test_recipe_copy_into_a_folder_that_is_a_file_names_the_file(tmp_path):
    """`mkdir -p` was the fix for a name a file holds, which it cannot create; the file stays as it was."""
    (tmp_path / "notes").write_text("mine")
    out = user_error("recipe", "copy", "quickstart", f"{tmp_path}/notes/", "--force")
    assert f"{tmp_path}/notes/: names a folder, and {tmp_path}/notes is a file" in out and "mkdir" not in out, out
    assert (tmp_path / "notes").read_text() == "mine"


def test_slurm_script_named_as_a_folder_is_refused(tmp_path):
    out = user_error("slurm", "quickstart", "--nodes", "1", "--gpus-per-node", "2", "-o", f"{tmp_path}/jobs/")
    assert f"{tmp_path}/jobs/: ends with a separator, so it names a folder" in out
    assert not (tmp_path / "jobs").exists()
