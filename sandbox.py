"""Run a Python program confined (envs.python, the gsm8k_python task's tool): a fresh interpreter per call, started
by a small wrapper (confine.py) with the strongest of these the kernel allows here: as root a fresh uid per call
(taken from a count, never another call's); rlimits; a memory cgroup for the whole call; pid, network and mount
namespaces, the program's root being read-only system directories and a tmpfs of its own; Landlock; a seccomp
filter that refuses the kernel's keys (a uid's keys outlive its processes). sandbox_protections() is the one line that
says which hold (and "not a security boundary" where namespaces or Landlock are missing). A call returns once all it
started has ended: with namespaces the kernel ends the namespace's init last; without, its process group and (as root)
its uid are killed until none is left."""

import contextlib
import ctypes
import fcntl
import functools
import itertools
import marshal
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PY_TIMEOUT = 5.0  # wall seconds per call
PY_MEMORY = 1 << 30  # bytes for the whole call: a memory cgroup, else PY_FEW processes of PY_MEMORY / PY_FEW each
PY_FEW = 4
PY_LIMITS = {  # per process: a 10 GB list is a MemoryError, a fork bomb stops at 64 processes (its uid's)
    "RLIMIT_AS": 1 << 30,
    "RLIMIT_FSIZE": 16 << 20,
    "RLIMIT_NPROC": 64,
    "RLIMIT_NOFILE": 64,
    "RLIMIT_CORE": 0,
}
PY_READ = 64 << 10  # bytes read at most: past it the program is stopped
PY_SHOW = 400  # characters shown: a reply costs the row's tokens
PY_DISK = "32m"  # its directory is a tmpfs of this size where a mount namespace is made
# as root each call's uid is PY_UID + a count that only grows (PY_UIDS's size), so limits and kills reach that call
# alone and no later call finds what a uid left (a uid made from a pid would be shared by two pids, or a later run)
PY_UID = 2_000_000_000
PY_UIDS = "/run/grpo-python-uids"  # root's alone (as /run is); where /run is a tmpfs a boot resets both it and the uids
# the key syscalls (add_key, request_key, keyctl) and AUDIT_ARCH_* per machine: refused by a seccomp filter where known.
# Refused, not cleaned after: nothing is made, so nothing can be missed (a key linked into a persistent keyring, the
# quota's kernel memory while it runs) and a call needs no process of its uid after it; the filter is ten BPF
# instructions in confine.py rather than a dependency on libseccomp
KEY_SYSCALLS = {
    "x86_64": (0xC000003E, (248, 249, 250)),
    "aarch64": (0xC00000B7, (217, 218, 219)),
    "riscv64": (0xC00000F3, (217, 218, 219)),
}
PY_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
# a call's cgroup: those of these files it has are written (v2's, v1's: the swap limit after the memory one)
CGROUP_FILES = ["memory.max", "memory.swap.max", "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
CONFINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "confine.py")  # the wrapper
_calls = itertools.count()  # next() is atomic: threads get distinct numbers


def sandbox_protections():
    """One line: what confines a python call here (printed at start-up by a task that uses it)."""
    return _sandbox()[1]


def run_python(code, timeout=None):
    """Run `code` confined as sandbox_protections() says, for timeout seconds (PY_TIMEOUT when None) -> (text,
    status): status None when it exited 0, else one short line (exit code, signal, timeout, output cut); text its
    stdout and stderr as they came, decoded with U+FFFD for bytes that are not UTF-8, the head shown (after a failure
    its error, error_start's, whole or its head, which names it, and the tail before it). It returns once everything
    the call started has ended."""
    timeout = PY_TIMEOUT if timeout is None else timeout
    out, status = _run(_sandbox()[0], code, timeout)
    text = out.decode("utf-8", errors="replace")
    if len(text) > PY_SHOW and status is None:
        text = text[:PY_SHOW] + f" [cut: {len(out)} bytes]"
    if len(text) > PY_SHOW and status is not None:  # the error whole, or its head (its name); before it, the tail
        start = error_start(text)
        error = text[start:]
        if len(error) > PY_SHOW:
            error = error[:PY_SHOW] + " [cut]"
        room = max(0, PY_SHOW - len(error))
        frames = [m.start() for m in FRAMES.finditer(text, 0, start)]
        if frames:  # shown from a frame's start, or from the error: error_start finds it again in what is shown
            keep = min([i for i in frames if i >= start - room], default=start)
            text = f"[cut: {len(out)} bytes]\n" + text[keep:start] + error
        else:
            text = f"[cut: {len(out)} bytes] " + text[max(0, start - room) : start] + error
    return text, status


# a traceback's frame, each with its source lines (or the line run_python puts where it cut frames): the error follows
FRAMES = re.compile(r'^(?:  File ".*|\[cut: \d+ bytes\])\n(?:(?!  File ")[ \t].*\n)*', re.MULTILINE)


def error_start(text):
    """Where a failed program's error starts in its output: the line after a traceback's last frame (the exception's
    name, its message, maybe several lines, and its notes), else the last line."""
    frames = list(FRAMES.finditer(text))
    if frames and text[frames[-1].end() :].strip():
        return frames[-1].end()
    return text.rstrip("\n").rfind("\n") + 1


@functools.cache
def _sandbox():
    """The strongest configuration whose interpreter starts here -> (config, line). As root the code runs as an
    unused uid or not at all."""
    abi = max(0, ctypes.CDLL(None).syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(1)))  # Landlock's
    root, cgroup = os.geteuid() == 0, _cgroup()
    landlocks, cgroups = sorted({abi, 0}, reverse=True), list(dict.fromkeys([cgroup, None]))  # the strongest first
    filters = [True, False] if os.uname().machine in KEY_SYSCALLS else [False]
    for ns, landlock, cg, seccomp in itertools.product((True, False), landlocks, cgroups, filters):
        conf = _config(PY_UID if root else None, ns, ns and not root, landlock, cg, seccomp)
        if _run(conf, "print(6 * 7)", 10.0) == (b"42\n", None):
            return conf, _describe(conf)
    why = "its interpreter does not start under rlimits"
    if root:
        why = f"as root it runs as another uid: that needs namespaces, or an interpreter others run (not {conf['exe']})"
    raise RuntimeError(f"python sandbox: no confined interpreter starts here; {why}")


def _cgroup():
    """This process's cgroup directory where a child cgroup with its own memory limit can be made (a cgroup v2 one
    whose children get the memory controller, else a v1 memory one), or None. Empty ones of ended callers removed."""
    mounts = {}  # "" (v2) or "memory" -> (mount point, root)
    with open("/proc/self/mountinfo") as f:
        for fields in map(str.split, f):
            kind, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3].split(",")
            if kind == "cgroup2" or kind == "cgroup" and "memory" in options:
                mounts.setdefault("memory" if kind == "cgroup" else "", (fields[4], fields[3]))
    with open("/proc/self/cgroup") as f:
        for _, controllers, path in (line.rstrip("\n").split(":", 2) for line in f):
            key = "memory" if "memory" in controllers.split(",") else controllers
            if key not in mounts:
                continue
            base = os.path.join(mounts[key][0], os.path.relpath(path, mounts[key][1]))
            for old in os.listdir(base):  # a caller killed mid-call leaves its cgroup, empty
                if old.startswith("grpo-python-") and not os.path.exists(f"/proc/{old.split('-')[2]}"):
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(base, old))
            try:
                if key == "memory" or "memory" in open(os.path.join(base, "cgroup.subtree_control")).read().split():
                    _make_cgroup(os.path.join(base, f"grpo-python-{os.getpid()}-probe"))
                    os.rmdir(os.path.join(base, f"grpo-python-{os.getpid()}-probe"))
                    return base
            except OSError:  # read-only, not ours
                pass
    return None


def _make_cgroup(path):
    os.mkdir(path)
    try:
        for name in filter(os.path.exists, [os.path.join(path, name) for name in CGROUP_FILES]):
            with open(name, "w") as f:
                f.write("0" if name.endswith(".swap.max") else str(PY_MEMORY))
    except OSError:
        os.rmdir(path)
        raise


def _config(uid, ns, userns, abi, cgroup, seccomp):
    prefix = os.path.realpath(sys.base_prefix)
    limits = dict(PY_LIMITS)
    if cgroup is None:  # no cgroup bounds the call: memory per process, and the product
        limits.update(RLIMIT_AS=PY_MEMORY // PY_FEW, RLIMIT_NPROC=PY_FEW)
    if uid is None and not userns:  # RLIMIT_NPROC counts all the user's processes, not this call's
        del limits["RLIMIT_NPROC"]
    return {
        "uid": uid,
        "exe": os.path.realpath(sys.executable),
        "ns": ns,
        "userns": userns,
        "abi": abi,
        "cgroup": cgroup,
        "keys": KEY_SYSCALLS.get(os.uname().machine),  # keyctl's number gives it a session keyring of its own
        "seccomp": seccomp,
        "limits": limits,
        "disk": PY_DISK,
        "read": ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", prefix],
    }


def _describe(conf):
    limits, ns, abi = conf["limits"], conf["ns"], conf["abi"]
    who = "your uid" if conf["uid"] is None else "a fresh uid per call"
    memory = f"{limits['RLIMIT_AS'] >> 20} MiB memory per process (no memory cgroup here)"
    if conf["cgroup"]:
        memory = f"{PY_MEMORY >> 20} MiB memory for the whole call (a cgroup)"
    parts = [
        f"python sandbox: a fresh interpreter as {who}, scrubbed env, rlimits (cpu, {limits['RLIMIT_FSIZE'] >> 20} "
        f"MiB files, processes {limits.get('RLIMIT_NPROC', 'NOT bounded')}), {memory}"
    ]
    if ns:
        parts.append(
            "namespaces: no network, own pids (all it starts dies with the call or its caller), a root of read-only "
            f"system dirs and a {conf['disk']} tmpfs dir: no /proc, no host files or sockets"
        )
    if abi:  # TCP rules from ABI 4, scopes from 6
        parts.append(
            f"Landlock: writes only in its dir, reads of system files only{', no TCP' * (abi >= 4)}"
            f"{', no signals or abstract sockets out' * (abi >= 6)}"
        )
    if conf["seccomp"]:
        parts.append("seccomp: no kernel keys (add_key, keyctl, request_key refused): none outlives the call")
    if not conf["seccomp"]:
        parts.append("kernel keys NOT refused (no seccomp filter here): keys a call adds outlive it")
    if not ns:
        parts.append("network NOT cut, host socket files reachable, what it starts may outlive a killed caller")
    if not ns and conf["uid"] is None:  # only its process group is killed
        parts.append("a process that leaves its process group may outlive the call")
    if not (ns or abi):
        parts.append("host files and /proc readable, writes NOT confined beyond file permissions")
    if not (ns and abi):
        parts.append("not a security boundary")
    return "; ".join(parts)


def _run(conf, code, timeout):
    """One call: its uid, its cgroup, the wrapper; everything it started killed and its cgroup and dir removed after,
    whatever happened -> (output bytes, status)."""
    n, uid = next(_calls), conf["uid"]
    if uid is not None:
        uid = _next_uid()
    cpu = math.ceil(timeout) + 1  # CPU seconds: a busy loop ends here even if the wall clock check were missed
    cgroup = conf["cgroup"] and os.path.join(conf["cgroup"], f"grpo-python-{os.getpid()}-{n}")
    conf = {**conf, "uid": uid, "cgroup": cgroup, "limits": {**conf["limits"], "RLIMIT_CPU": cpu}}
    workdir = None  # with namespaces the dir is a tmpfs of its own: none on the host (a private $TMPDIR works)
    if not conf["ns"]:  # entered before the uid changes: a $TMPDIR others cannot enter works too
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="grpo-python-"))
    try:
        if cgroup:
            _make_cgroup(cgroup)
        if workdir and uid is not None:
            os.chown(workdir, uid, uid)
        argv = [
            conf["exe"],
            "-I",
            "-S",
            "-B",
            CONFINE,
            str(os.getpid()),
            marshal.dumps(conf).hex(),
        ]  # marshal: no import
        pipe = subprocess.PIPE
        proc = subprocess.Popen(
            argv,
            cwd=workdir or "/",
            env=PY_ENV,
            stdin=pipe,
            stdout=pipe,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            try:
                with proc.stdin:
                    proc.stdin.write(code.encode("utf-8", errors="surrogatepass"))
            except BrokenPipeError:  # the wrapper ended at once: its output says why
                pass
            out, status = _read(proc, timeout)
        finally:
            _kill(proc, conf)
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        if cgroup and os.path.isdir(cgroup):
            os.rmdir(cgroup)
    if workdir:  # the same program gives the same output: no random path in a traceback
        out = out.replace(workdir.encode() + b"/", b"")
    return out, status


def _next_uid():
    """As root, a uid no other call on this machine has had: PY_UID + a count kept as PY_UIDS's size (one ftruncate,
    never a torn write) under flock, which the kernel releases when its holder dies (never a stale lock). A call
    killed midway leaves its uid taken; the count wraps only after 2.3e9 calls."""
    try:
        fd = os.open(PY_UIDS, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise RuntimeError(f"python sandbox: as root a call's uid is counted in {PY_UIDS}, which fails: {e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # DDP ranks, runs and threads side by side each get the next
        n = os.fstat(fd).st_size
        os.ftruncate(fd, n + 1)
    finally:
        os.close(fd)
    return PY_UID + n % (2**32 - 1 - PY_UID)  # 2**32 - 1 is no uid (-1)


def _read(proc, timeout):
    """Its output until it exits, up to PY_READ bytes and the timeout -> (bytes, status); it is not reaped here, so
    its pid (its group's id) stays its own until everything is killed."""
    deadline = time.monotonic() + timeout
    out = bytearray()
    eof = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(out), f"timed out after {timeout:g} s"
        if len(out) > PY_READ:
            return bytes(out), f"stopped after {PY_READ} bytes of output"
        if not eof and select.select([proc.stdout], [], [], min(left, 0.05))[0]:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            out += chunk
            eof = not chunk
            continue
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return bytes(out), _status(info)
        if eof:
            time.sleep(min(left, 0.01))


def _status(info):
    if info.si_code == os.CLD_EXITED and info.si_status == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return f"exit {info.si_status}"
    name = signal.Signals(info.si_status).name
    if info.si_status == signal.SIGXCPU:
        name += " (CPU limit)"
    return f"killed by {name}"


def _kill(proc, conf):
    """Everything the call started, ended before the reply. With namespaces: its init SIGKILLed (stopped or not),
    then the wrapper, which waits for it, reaped: nothing inside can stop the wrapper, and its init ends only once
    everything else in its namespace has. Without: its process group, then, as root, every process of its uid until
    none is left."""
    inits = []
    if conf["ns"]:
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                inits = [int(pid) for pid in f.read().split()]
        except OSError:  # the wrapper is gone
            pass
    for pid in inits:
        _signal(os.kill, pid)
    if not inits:  # no init (yet, or any more), or no namespaces: the wrapper's group; not reaped, so still its own
        _signal(os.killpg, proc.pid)
    uid = conf["uid"]
    for _ in range(100):  # as root, without namespaces: every process of its uid, none of anyone else's
        pids = []
        if uid is not None and not conf["ns"]:
            pids = _uid_pids(uid)
        if not pids:
            break
        for pid in pids:
            _signal(os.kill, pid)
        time.sleep(0.01)
    proc.wait()
    proc.stdout.close()


def _signal(kill, pid):
    try:
        kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _uid_pids(uid):
    """Pids of the live processes (zombies aside) whose real, effective or saved uid is uid."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status", errors="replace") as f:  # a process's Name may be any bytes
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # ended meanwhile
            continue
        if str(uid) in fields.get("Uid", "").split()[:3] and not fields.get("State", "").strip().startswith("Z"):
            pids.append(int(pid))
    return pids
