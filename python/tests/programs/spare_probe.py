"""A rank that writes what it sees of its process to ``<out>/attempt-<A>.json`` (for
test_warm_spares: a rank run by a warm spare must see what a freshly started one sees),
prints to stdout and stderr, and ends: attempt 0 reports progress (so that its agent
starts the job's spares), waits for ``<out>/go``, then exits 3; later attempts exit 0."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from cumulus import runtime


def main() -> None:
    out = Path(sys.argv[1])
    attempt = int(os.environ["CUMULUS_ATTEMPT"])
    umask = os.umask(0o077)
    os.umask(umask)
    view = {
        "argv": sys.argv,
        "name": __name__,
        "file": __file__,
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "env": dict(os.environ),
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "ppid": os.getppid(),
        "uid": os.getuid(),
        "gid": os.getgid(),
        "groups": sorted(os.getgroups()),
        "umask": umask,
        "stdin": os.readlink("/proc/self/fd/0"),
        "executable": sys.executable,
        "main_is_this": sys.modules["__main__"].__dict__.get("main") is main,
    }
    (out / f"attempt-{attempt}.json").write_text(json.dumps(view))
    print(f"stdout of attempt {attempt}", flush=True)
    print(f"stderr of attempt {attempt}", file=sys.stderr, flush=True)
    if attempt == 0:
        runtime.report(1, total_steps=2)
        deadline = time.monotonic() + 300
        while not (out / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(3)
    runtime.report(2, total_steps=2)


if __name__ == "__main__":
    main()
