"""`attnlens ARGS` run in this process, through the console script's own function (`attnlens.cli.main`), with what it
prints and its exit status kept as a subprocess's would be.

The command-line tests run their commands here, where torch, transformers and the model code are already imported:
a subprocess spends about 6 s importing them before it starts (twice that on a loaded machine). The entry point
itself, `python -m attnlens` in a process of its own, is run as a user runs it by tests/test_cli.py.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path
from unittest import mock


def attnlens(*args: str, stdin: str | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """The run of `attnlens ARGS` (reading `stdin`, in the folder `cwd`): its exit status, stdout and stderr."""
    from attnlens import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        if cwd is not None:
            stack.enter_context(contextlib.chdir(cwd))
        if stdin is not None:
            stack.enter_context(mock.patch.object(sys, "stdin", io.StringIO(stdin)))
        try:
            status = cli.main(list(args))
        except SystemExit as exit_:  # argparse's usage errors (2) and --help (0)
            status = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(
        [sys.executable, "-m", "attnlens", *args], status, out.getvalue(), err.getvalue()
    )
