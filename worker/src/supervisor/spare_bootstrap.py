# A warm spare's first code (`python -c`, from worker/src/supervisor/spares.rs): import
# the job's modules (with torch, also torch._dynamo, which PyTorch imports lazily on a
# training's first steps), wait on stdin for an assignment, then become the rank: its
# environment, argv, working directory and sys.path[0] exactly as a fresh
# `python SCRIPT ARGS...` (or `python -m MODULE ARGS...`) would have them, and its script
# run as __main__ in this process. argv: -c CODE IMPORTS SCRIPT_DIR (IMPORTS
# comma-separated, SCRIPT_DIR the directory of an absolute script path or "").
#
# The assignment is NUL-terminated fields: b"cumulus-spare-1", the working directory,
# the argument count, the arguments (after the interpreter), the variable count, then
# each variable as NAME=VALUE. EOF without one (the agent dropped the spare): exit 0.
def _cumulus_spare():
    import os
    import sys

    imports = [m for m in sys.argv[1].split(",") if m]
    script_dir = sys.argv[2]
    safe_path = getattr(sys.flags, "safe_path", False)
    if script_dir and not safe_path:
        sys.path[0] = script_dir
    import importlib

    for name in imports:
        importlib.import_module(name)
    torch = sys.modules.get("torch")
    if torch is not None:
        # PyTorch imports torch._dynamo (and with it torch._inductor and sympy) lazily,
        # when the first DistributedDataParallel model is made or an optimizer first
        # steps: 1.5 s of CPU on an idle 2-core machine, several loaded, that a rank
        # taking this spare would spend while its peers wait in DDP's first broadcast.
        # Only a head start: a PyTorch without it still runs the rank.
        try:
            importlib.import_module("torch._dynamo")
        except Exception:
            pass
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        sys.stderr.write(
            "cumulus warm spare: importing %s initialized CUDA before the spare had a rank; "
            "warm imports must not touch a GPU\n" % ",".join(imports)
        )
        sys.stderr.flush()
        os._exit(70)
    sys.stdout.flush()
    sys.stderr.flush()
    data = sys.stdin.buffer.read()
    if not data:
        os._exit(0)
    fields = data.split(b"\0")
    if fields[0] != b"cumulus-spare-1":
        sys.stderr.write("cumulus warm spare: unknown assignment\n")
        os._exit(70)
    cwd = fields[1]
    argc = int(fields[2])
    args = [os.fsdecode(a) for a in fields[3 : 3 + argc]]
    envc = int(fields[3 + argc])
    env = fields[4 + argc : 4 + argc + envc]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    for item in env:
        name, _, value = item.partition(b"=")
        os.environb[name] = value
    os.chdir(cwd)
    # cumulus.runtime installs its exception report on import, from the rank
    # environment: imported early, it does so now.
    failure = sys.modules.get("cumulus.runtime._failure")
    if failure is not None:
        failure.install_from_env()
    import runpy

    if args[0] == "-m":
        sys.argv = [args[1]] + args[2:]
        if not safe_path:
            sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        if not safe_path:
            sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


_cumulus_spare()
