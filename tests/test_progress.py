"""chemtrain.progress: bars only on a terminal (or when asked for), so a
log file gets no carriage-return fragments."""
import io

from chemtrain import progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_bars_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("CHEMTRAIN_PROGRESS", raising=False)
    log, tty = io.StringIO(), _Tty()
    assert not progress.interactive(log) and progress.interactive(tty)
    bar = progress.progress_bar(range(3), file=log)
    assert list(bar) == [0, 1, 2] and bar.disable and log.getvalue() == ""
    bar = progress.progress_bar(range(3), file=tty, mininterval=0)
    assert not bar.disable and list(bar) == [0, 1, 2]
    assert "3/3" in tty.getvalue()
    monkeypatch.setenv("CHEMTRAIN_PROGRESS", "0")
    assert not progress.interactive(tty)
    monkeypatch.setenv("CHEMTRAIN_PROGRESS", "1")
    assert progress.interactive(log)
