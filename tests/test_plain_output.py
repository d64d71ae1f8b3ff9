"""Output that is not a live terminal (a log file, a pipe, TERM=dumb, NO_COLOR): no progress bar redrawn with carriage
returns into a log, no colour codes; the numbers the bar showed are plain lines instead."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from accel_fsdp.quiet import colour_allowed, live_terminal
from accel_fsdp.train import observe


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        super().isatty()  # a closed stream raises ValueError, as a real one does
        return True


def test_a_log_file_gets_a_line_per_logged_step_and_no_bar(monkeypatch, capsys):
    monkeypatch.setattr(observe.sys, "stderr", io.StringIO())  # `recipe run ... > log 2>&1`
    terminal = observe.Terminal(SimpleNamespace(is_main_process=True))
    terminal.open_bar(total=4, initial=0)
    assert terminal.bar is None
    terminal.advance()
    terminal.advance(loss="4.5446", tok_s="6,408")
    terminal.say("eval @ step 2")
    out = capsys.readouterr().out
    assert out == "step 2/4: loss 4.5446, tok_s 6,408\neval @ step 2\n"
    assert "\r" not in observe.sys.stderr.getvalue()


def test_a_resumed_run_counts_its_steps_from_where_it_resumed(monkeypatch, capsys):
    monkeypatch.setattr(observe.sys, "stderr", io.StringIO())
    terminal = observe.Terminal(SimpleNamespace(is_main_process=True))
    terminal.open_bar(total=10, initial=6)
    terminal.advance(loss="1.0")
    assert capsys.readouterr().out == "step 7/10: loss 1.0\n"
    other_rank = observe.Terminal(SimpleNamespace(is_main_process=False))
    other_rank.open_bar(total=10, initial=6)
    other_rank.advance(loss="1.0")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("term,no_color,live,colour", [("xterm", "", True, True), ("dumb", "", False, False),
                                                       ("xterm", "1", True, False)])
def test_term_dumb_is_no_live_terminal_and_no_color_turns_colour_off(monkeypatch, term, no_color, live, colour):
    monkeypatch.setenv("TERM", term)
    monkeypatch.setenv("NO_COLOR", no_color)
    assert live_terminal(FakeTty()) is live and colour_allowed(FakeTty()) is colour
    assert not live_terminal(io.StringIO()) and not colour_allowed(io.StringIO())
    closed = FakeTty()
    closed.close()
    assert not live_terminal(closed)
