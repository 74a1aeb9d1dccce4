"""The ``python`` tool: runs model-written code in a limited subprocess.

What the sandbox does, per run:

* a fresh temporary directory is the working directory; it is deleted afterwards;
* the interpreter starts isolated (``python -I -S``: no user site, no ``PYTHON*`` variables, no
  site-packages, not the current directory on ``sys.path``) with an empty environment;
* before the code runs, it lowers its own limits (kernel-enforced): CPU seconds (``RLIMIT_CPU``),
  address space (``RLIMIT_AS``), size of written files (``RLIMIT_FSIZE``), no new processes
  (``RLIMIT_NPROC`` 0: ``fork`` / ``exec`` fail), no core files;
* a Python audit hook (``sys.addaudithook``, which cannot be removed) refuses opening, listing,
  changing or deleting paths outside the temporary directory (reads of the standard library
  excepted), sockets, subprocesses, ``os.system`` / ``exec*`` / ``fork``, ``ctypes``, and importing
  ``socket``, ``ctypes``, ``subprocess``, ``multiprocessing`` and their C parts;
* where the kernel allows unprivileged user namespaces (``unshare -rn`` works), the process runs
  in a network namespace of its own with no interfaces: no network at the kernel level;
* the process group is killed at the wall-clock limit or once it writes more than the output cap.

What it does not guarantee: the audit hook is an in-process guard, not a security boundary. It
stops accidental and ordinary access (the model reading the run directory, opening a socket) but
code that corrupts the interpreter's memory could get around it, and without user namespaces the
network guard is the audit hook alone. For adversarial code, run the tool in a container or a VM
(gVisor, Firecracker, nsjail) behind a custom tool class.
"""

from __future__ import annotations

import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Union

from hyflow.agent.tools import Tool, ToolConfigError, ToolFailure, ToolResult, function_schema

# Runs in the sandboxed interpreter: limits, then the audit hook, then the code. argv: code file,
# CPU seconds, address space bytes, file size bytes.
_BOOT = r'''
import os, resource, sys, traceback
code_path, cpu, mem, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
                        (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NPROC, 0, 0),
                        (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(res, (soft, hard))
with open(code_path, encoding="utf-8") as f:
    source = f.read()
home = os.path.realpath(os.getcwd())
readable = [home] + [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)]
deny_modules = {"socket", "_socket", "ssl", "_ssl", "ctypes", "_ctypes", "subprocess", "_posixsubprocess",
                "multiprocessing", "_multiprocessing", "pty", "asyncio", "selectors", "select", "mmap"}
read_events = {"os.listdir", "os.scandir"}
path_events = {"os.chdir": 0, "os.mkdir": 0, "os.rmdir": 0, "os.remove": 0,
               "os.rename": 0, "os.replace": 0, "os.chmod": 0, "os.chown": 0, "os.link": 0, "os.symlink": 0,
               "os.truncate": 0, "os.utime": 0, "shutil.rmtree": 0, "shutil.copyfile": 0, "shutil.move": 0,
               "os.chflags": 0, "os.setxattr": 0, "os.removexattr": 0, "os.getxattr": 0, "os.listxattr": 0}
denied_events = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                 "os.forkpty", "pty.spawn", "os.kill", "os.killpg", "os.startfile", "ctypes.", "socket.",
                 "sys.remote_exec", "resource.setrlimit", "os.putenv", "os.unsetenv")
realpath, sep = os.path.realpath, os.sep

def inside(path, roots):
    if isinstance(path, int):
        return True  # an already open descriptor
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    real = realpath(path)
    return any(real == r or real.startswith(r + sep) for r in roots)

def guard(event, args):
    if event == "open":
        path, mode, flags = args
        if path is None:
            return
        write = (mode and any(c in mode for c in "wax+")) or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if not inside(path, [home] if write else readable):
            raise PermissionError(f"sandbox: {path} is outside the sandbox's directory")
    elif event in read_events:
        if args and isinstance(args[0], (str, bytes, os.PathLike)) and not inside(os.fspath(args[0]), readable):
            raise PermissionError(f"sandbox: {args[0]} is outside the sandbox's directory")
    elif event in path_events:
        for value in args[:2]:
            if isinstance(value, (str, bytes, os.PathLike)) and not inside(os.fspath(value), [home]):
                raise PermissionError(f"sandbox: {value} is outside the sandbox's directory")
    elif event == "import":
        if args[0].split(".")[0] in deny_modules:
            raise ImportError(f"sandbox: importing {args[0]} is not allowed")
    elif event.startswith(denied_events):
        raise PermissionError(f"sandbox: {event} is not allowed")

sys.addaudithook(guard)
del os.environ  # nothing to read there, and no way back to os.putenv
globs = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(source, "<tool>", "exec"), globs)
except SystemExit:
    raise
except BaseException as exc:  # the model's traceback, without this bootstrap's frame
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
'''


@functools.lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """``unshare`` arguments that give a process no network, when the kernel lets this user do it."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        ok = subprocess.run([unshare, "--user", "--map-root-user", "--net", "true"], capture_output=True,
                            timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (unshare, "--user", "--map-root-user", "--net", "--") if ok else ()


def run_python(code: str, *, cpu_seconds: int = 5, memory_mb: int = 512, wall_seconds: float = 10.0,
               max_output_bytes: int = 65536, max_file_bytes: int = 1 << 20) -> ToolResult:
    """Run ``code`` in the sandbox; its stdout and stderr (merged) are the result's text."""
    workdir = tempfile.mkdtemp(prefix="hyflow-sandbox-")
    try:
        code_path = os.path.join(workdir, "main.py")
        with open(code_path, "w", encoding="utf-8") as f:
            f.write(code)
        argv = list(network_namespace_prefix()) + [
            sys.executable, "-I", "-S", "-c", _BOOT, code_path, str(cpu_seconds), str(memory_mb << 20),
            str(max_file_bytes)]
        try:
            proc = subprocess.Popen(argv, cwd=workdir, env={"LC_ALL": "C.UTF-8"}, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            raise ToolFailure(f"cannot start the sandbox's interpreter: {exc}") from exc
        output, reason = _collect(proc, wall_seconds, max_output_bytes)
        text = output.decode("utf-8", errors="replace")
        if reason == "timeout":
            return ToolResult(_join(text, f"Error: the code ran longer than {wall_seconds:g} s and was stopped"),
                              error=True, timeout=True)
        if reason == "output":
            return ToolResult(_join(text, f"Error: the code wrote more than {max_output_bytes} bytes and was "
                                          "stopped"), error=True)
        code_ = proc.returncode
        if code_ < 0:
            name = signal.Signals(-code_).name if -code_ in signal.valid_signals() else str(-code_)
            hint = " (CPU time limit)" if name in ("SIGXCPU", "SIGKILL") else ""
            return ToolResult(_join(text, f"Error: the code was killed by {name}{hint}"), error=True)
        return ToolResult(text, error=code_ != 0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _join(text: str, note: str) -> str:
    return f"{text.rstrip()}\n{note}" if text.strip() else note


def _collect(proc: subprocess.Popen, wall_seconds: float, cap: int) -> tuple[bytes, Optional[str]]:
    """Read the process's output until it exits; kill its group at the deadline or past ``cap`` bytes."""
    deadline = time.monotonic() + wall_seconds
    chunks, size, reason = [], 0, None
    fd = proc.stdout.fileno()
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                reason = "timeout"
                break
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if not ready:
                continue
            data = os.read(fd, 65536)
            if not data:
                break
            keep = max(0, min(len(data), cap - size))
            chunks.append(data[:keep])
            size += len(data)
            if size > cap:
                reason = "output"
                break
    finally:
        if reason is not None or proc.poll() is None:
            _kill_group(proc)
        proc.stdout.close()
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
    return b"".join(chunks), reason


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class PythonTool(Tool):
    """``python(code)``: runs the code in the sandbox; what it prints is the result. Limits come
    from the tool's ``config`` (the keys of :class:`hyflow.agent.config.SandboxConfig`)."""

    LIMITS = ("cpu_seconds", "memory_mb", "wall_seconds", "max_output_bytes", "max_file_bytes")

    def __init__(self, config: Optional[dict] = None, tool_schema: Optional[dict] = None) -> None:
        super().__init__(config, tool_schema)
        unknown = set(self.config) - set(self.LIMITS)
        if unknown:
            raise ToolConfigError(f"python tool: unknown config key(s) {sorted(unknown)} (known: {self.LIMITS})")

    @classmethod
    def default_schema(cls) -> dict:
        return function_schema("python", "Run Python code in a sandbox and return what it prints.",
                               {"code": {"type": "string", "description": "Python source; print the results"}},
                               ["code"])

    def execute(self, arguments: dict[str, Any]) -> Union[str, ToolResult]:
        return run_python(str(arguments["code"]), **self.config)
