"""A process that has imported torch, forking one child per measurement (see :mod:`.child`).

``python -m jabascli.profiler.zygote`` reads one JSON request per line on
stdin (``module``, ``args``, ``log``, ``env``, ``cwd``), forks, and answers
``{"pid": N}``; when that child exits it answers ``{"pid": N, "exit": CODE}``
(negative: killed by that signal). It runs one child at a time, never runs a
model itself, ignores Ctrl-C (the profiler kills what it started), and exits
when its stdin closes or its parent dies.

The child sets itself up as a fresh process would be: parent-death signal,
default Ctrl-C, stdin from /dev/null, stdout and stderr to ``log``, the
requester's environment and working folder; then runs ``module.main(args)``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from typing import Any


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become the requested run, then exit without returning."""
    code = 1
    try:
        from jabascli.children import die_with_parent

        die_with_parent()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        import importlib

        module = importlib.import_module(request["module"])
        sys.argv = [request["module"], *request["args"]]
        code = int(module.main(request["args"]) or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from jabascli.children import die_with_parent

    die_with_parent()
    # The expensive imports, done once for every child (the first optimizer step or dispatch mode
    # pulls in torch._dynamo).
    import torch._dynamo

    import jabascli.profiler.trial
    import jabascli.workload

    del torch, jabascli
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        _reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _reply({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
