"""The one check of a CLI mistake: ``hybrid`` exits 2 with exactly one line on stderr and no traceback."""

from __future__ import annotations

import pytest

from hybrid.cli import main


def one_line_exit(capsys, argv) -> str:
    """Run ``hybrid argv`` in-process; assert it exits 2 with one stderr line, no traceback; return that line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err
