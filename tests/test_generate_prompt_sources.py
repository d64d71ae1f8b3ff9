"""`generate --prompt` from where prompts live: `-` reads standard input and `@FILE` a UTF-8 text file (without the
line break that ends it); `@@` starts a text with @. A file that is missing, a folder or not text is one message
naming it. (Before, `--prompt -` continued the text "-".)"""

from __future__ import annotations

from click.testing import CliRunner
from conftest import run_in_process, user_error

from accel_fsdp.cli import main


def continued(tiny_gpt2, *prompt, stdin=None) -> str:
    result = CliRunner().invoke(main, ["generate", str(tiny_gpt2), "--max-new-tokens", "4", *prompt], input=stdin)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_a_prompt_from_a_file_or_standard_input_is_the_prompt_typed(tmp_path, tiny_gpt2):
    typed = continued(tiny_gpt2, "--prompt", "alice has a")
    (tmp_path / "prompt.txt").write_text("alice has a\n")
    assert continued(tiny_gpt2, "--prompt", f"@{tmp_path / 'prompt.txt'}") == typed
    assert continued(tiny_gpt2, "--prompt", "-", stdin="alice has a\n") == typed
    assert continued(tiny_gpt2, "--prompt", "@@alice").startswith("@alice ")


def test_a_prompt_file_that_cannot_be_read_is_named(tmp_path):
    for name, make, said in [("missing.txt", None, "does not exist"), ("folder", "mkdir", "is a folder"),
                             ("binary.txt", b"\xff\xfe\x00", "is not UTF-8 text")]:
        path = tmp_path / name
        if make == "mkdir":
            path.mkdir()
        elif make is not None:
            path.write_bytes(make)
        out = user_error("generate", tmp_path, "--prompt", f"@{path}")
        assert f"error: --prompt @{path}: {path} {said}" in out, out
    (tmp_path / "empty.txt").write_text("\n")
    assert "--prompt: is empty" in run_in_process("generate", tmp_path, "--prompt", f"@{tmp_path / 'empty.txt'}",
                                                  check=2).stderr
