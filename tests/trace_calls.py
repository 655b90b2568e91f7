"""Run a script as `python SCRIPT ARGS` would, and record which of the repository's Python files
ran a function while it did: `python tests/trace_calls.py OUT.json SCRIPT ARGS...`.

OUT.json maps each such path, relative to the root of the checkout that `fastrl` was imported
from (e.g. "fastrl/ops.py", "benchmarks/_common.py"), to the sorted names of its functions that
ran. A function call counts, in any thread (`sys.setprofile` and `threading.setprofile`), from
the moment `fastrl` is imported (which it is before the script starts: the package's import
runs its modules' top levels and registers the ops, which the script's results do not hang
on); a module's or class's top level does not count. Child processes are not followed. Used by
the benchmarks' smoke tests to check that report.MEASURES names every library file a benchmark
executes (its staleness warning would miss a change to one it does not)."""

from __future__ import annotations

import inspect
import json
import os
import runpy
import sys
import threading

if __name__ == "__main__":
    out, script = sys.argv[1], os.path.abspath(sys.argv[2])
    called: set[tuple[str, str]] = set()

    def _profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_flags & inspect.CO_OPTIMIZED:  # a function, not a body
            called.add((code.co_filename, code.co_qualname))

    sys.argv = [script, *sys.argv[3:]]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` puts the script's folder
    import fastrl

    sys.setprofile(_profile)
    threading.setprofile(_profile)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        root = os.path.dirname(os.path.dirname(os.path.abspath(fastrl.__file__))) + os.sep
        files: dict[str, set[str]] = {}
        for path, function in called:
            if path.startswith(root):
                files.setdefault(os.path.relpath(path, root), set()).add(function)
        with open(out, "w") as fh:
            json.dump({f: sorted(files[f]) for f in sorted(files)}, fh, indent=1)
