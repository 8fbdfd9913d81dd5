"""The built-in ``python`` tool: a model's code run in posttrain's sandbox (``confine.run_python``), what it
printed returned to the model, with a line when the sandbox stopped it."""

from __future__ import annotations

from collections.abc import Callable

from posttrain.sandbox.confine import Limits, run_python


def python_tool(strict: bool = True) -> Callable[[str], str]:
    """The built-in ``python`` tool. ``strict`` False (the run's ``sandbox_accept_weaker``): it runs with what
    holds where the kernel makes no namespaces."""

    def python(code: str) -> str:
        """Run Python code in a sandbox and return what it prints.

        Args:
            code: the Python program to run
        """
        ran = run_python(code, strict=strict)
        text = ran.stdout + (ran.stderr if ran.stderr else "")
        if ran.timed_out:
            text += f"\n(stopped: it ran past {Limits().wall:g} s)"
        elif ran.returncode < 0:
            text += f"\n(killed by signal {-ran.returncode})"
        return text.strip() or "(no output)"

    return python
