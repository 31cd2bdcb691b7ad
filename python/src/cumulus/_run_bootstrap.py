"""The first code a rank of :meth:`cumulus.Client.run` runs (copied into the job's packed
working directory as ``_cumulus_run/bootstrap.py``; the job's command is ``python3
_cumulus_run/bootstrap.py``).

It checks that this interpreter's ``major.minor`` is the client's, since a function
pickled by one Python cannot be loaded by another: on a mismatch it writes the error
file into ``$CUMULUS_OUTPUT_DIR`` and exits with ``EXIT_CANNOT_RUN`` (78: the job fails
at once and spends no restart). Otherwise it puts the copies of ``cumulus`` and
``cloudpickle`` the client sent first on ``sys.path``, then the working directory (the
modules of an uploaded directory), and hands over to
:func:`cumulus._run_rank.main`.

It uses the standard library only and syntax every Python 3 reads, so the check runs
(and says what is wrong) on any interpreter; the values it needs (file names, exit code)
come from ``meta.json`` beside it.
"""

import json
import os
import sys
from typing import Any


def _write_error(meta: dict[str, Any], error: dict[str, Any]) -> None:
    out = os.environ.get(meta["output_dir_env"])
    if not out:
        return
    path = os.path.join(out, meta["error_file"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(error, f)
    os.replace(tmp, path)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "meta.json")) as f:
        meta = json.load(f)
    want = meta["python"]
    have = "%d.%d" % tuple(sys.version_info[:2])
    if have != want:
        message = (
            "this function was pickled by Python %s on the client, but the rank runs "
            "Python %s (%s): a pickled function only loads in the same major.minor. Run "
            "it with requirements=[...] (the environment is built with the client's "
            "Python) or from a client of Python %s" % (want, have, sys.executable, have)
        )
        _write_error(
            meta,
            {
                "kind": "python_version_mismatch",
                "type": "cumulus.errors.PythonVersionMismatch",
                "message": message,
                "traceback": "",
                "client_python": want,
                "remote_python": have,
            },
        )
        sys.stderr.write("cumulus: %s\n" % message)
        sys.stderr.flush()
        sys.exit(int(meta["exit_cannot_run"]))
    # The copies the client sent first, then the working directory (an uploaded
    # directory's modules), instead of this script's own directory.
    sys.path[0:1] = [os.path.join(here, "lib"), os.getcwd()]
    from cumulus import _run_rank

    sys.exit(_run_rank.main(here, meta, "--gather" in sys.argv[1:]))


if __name__ == "__main__":
    main()
