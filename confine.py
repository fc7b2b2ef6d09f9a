"""The sandbox's wrapper, run by sandbox.py as `python -I -S -B confine.py CALLER_PID CONFIG` (marshal in hex: no
import to read it) with the program on stdin; a wrapper, as a preexec_fn is unsafe in a process with threads (the
rollout's). It confines itself and becomes the program. With namespaces it stays outside them and waits; its first
child, the namespace's init, builds the program's root and forks the program, which runs as another uid in another
process group and session: nothing inside can signal or stop the wrapper or the init, and the init's end (the
program's, a SIGKILL from the caller, or the parent-death signals when the caller dies) ends all in the namespace
before the wrapper exits."""

import ctypes
import errno
import marshal
import os
import resource
import select
import signal
import struct
import sys

ppid, conf = int(sys.argv[1]), marshal.loads(bytes.fromhex(sys.argv[2]))
code = sys.stdin.buffer.read()  # the program; its own stdin is /dev/null
os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
NEWNS, NEWCGROUP, NEWUTS, NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000  # clone(2) flags
NEWUSER, NEWPID, NEWNET = 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, REMOUNT, BIND, MOVE, REC, PRIVATE = 1, 2, 4, 32, 4096, 8192, 16384, 1 << 18  # mount(2) flags
TOP = "/tmp"  # where its root is built, in its own mount namespace
uid = conf["uid"]
owner, group = (os.getuid(), os.getgid()) if uid is None else (uid, uid)


def ok(ret, what):
    if ret < 0:
        raise OSError(ctypes.get_errno(), what)
    return ret


def mount(src, dst, fstype, flags, data=None):
    args = src and src.encode(), dst.encode(), fstype and fstype.encode(), L(flags), data and data.encode()
    ok(libc.mount(*args), dst)


def die_with_parent(alive):  # set after the last change of credentials, which clears it; then is it still there?
    ok(libc.prctl(1, L(signal.SIGKILL)), "pdeathsig")
    if not alive():
        os._exit(126)


def join_cgroup():  # the call's memory: all its processes' together
    if conf["cgroup"]:
        with open(conf["cgroup"] + "/cgroup.procs", "w") as f:
            f.write("0")


def write_program(path):
    with open(path, "wb") as f:
        f.write(code)
    os.chown(path, owner, group)


def new_root():  # the system's directories read-only, two devices, a tmpfs /tmp as its cwd: no /proc, no host files
    mount(None, "/", None, REC | PRIVATE)  # nothing mounted here shows outside
    mount("tmpfs", TOP, "tmpfs", NOSUID | NODEV, "size=1m,mode=0755")
    for path in sorted(set(conf["read"])):  # a shorter path first: one under it exists in its bind
        dst = TOP + path
        if not os.path.lexists(path):
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(path):  # /bin -> usr/bin
            os.symlink(os.readlink(path), dst)
            continue
        if os.path.isdir(path):
            os.makedirs(dst, exist_ok=True)
        else:
            open(dst, "a").close()
        mount(path, dst, None, BIND | REC)
        locked = os.statvfs(dst).f_flag & (8 | 1024 | 2048)  # noexec, noatime, nodiratime: kept in a user namespace
        mount(None, dst, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV | locked)
    os.mkdir(TOP + "/dev")
    for dev in "/dev/null", "/dev/urandom":
        open(TOP + dev, "x").close()
        mount(dev, TOP + dev, None, BIND)
    os.mkdir(TOP + "/tmp")
    disk = "size=%s,mode=0700,uid=%d,gid=%d" % (conf["disk"], owner, group)
    mount("tmpfs", TOP + "/tmp", "tmpfs", NOSUID | NODEV, disk)
    write_program(TOP + "/tmp/main.py")
    os.chdir(TOP)  # as switch_root does: the built tree moved onto /, then chroot into it
    mount(".", "/", None, MOVE)
    os.chroot(".")
    mount(None, "/", None, REMOUNT | BIND | RDONLY | NOSUID | NODEV)
    os.chdir("/tmp")


def landlock(abi):  # writes only in cwd, reads of system and interpreter files only, no TCP, no signals out
    fs = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1
    attr = struct.pack("QQQ", fs, 3, 3)[: {1: 8, 2: 8, 3: 8, 4: 16, 5: 16}.get(abi, 24)]
    ruleset = ok(libc.syscall(L(444), attr, L(len(attr)), L(0)), "landlock ruleset")
    rules = [(p, 13 if os.path.isdir(p) else 5) for p in conf["read"]]  # execute, read files (and dirs)
    rules += [("/dev/null", 6), ("/dev/urandom", 4), (".", fs)]
    for path, rights in rules:
        if os.path.exists(path):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            ok(libc.syscall(L(445), L(ruleset), L(1), struct.pack("=Qi", rights & fs, fd), L(0)), path)
            os.close(fd)
    ok(libc.syscall(L(446), L(ruleset), L(0)), "landlock restrict")


def seccomp(arch, numbers):  # the key syscalls refused (EPERM: told no, not killed, as by Docker's default), x32's too
    n = len(numbers)  # seccomp_data: nr at 0, arch at 4; x32's nr >= 2**30; another arch's call (int 0x80) kills
    code = [(0x20, 0, 0, 4), (0x15, 0, n + 4, arch), (0x20, 0, 0, 0), (0x35, n + 1, 0, 1 << 30)]  # ld, jeq, ld, jge
    code += [(0x15, n - i, 0, nr) for i, nr in enumerate(numbers)]
    code += [(6, 0, 0, 0x7FFF0000), (6, 0, 0, 0x50000 | errno.EPERM), (6, 0, 0, 0x80000000)]  # allow, errno, kill
    prog = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in code))
    ok(libc.prctl(22, L(2), struct.pack("HP", len(code), ctypes.addressof(prog))), "seccomp")


def confine(parent):  # this process becomes the program
    for name, value in conf["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    die_with_parent(lambda: os.getppid() == parent)
    if conf["keys"]:  # a new session keyring: its caller's keys are not its, even to the kernel acting for it
        libc.syscall(L(conf["keys"][1][2]), L(1), None)
    ok(libc.prctl(38, L(1), L(0), L(0), L(0)), "no_new_privs")
    if conf["abi"]:
        landlock(conf["abi"])
    if conf["seccomp"]:
        seccomp(*conf["keys"])
    # without namespaces by the cwd's link: the dir's path may pass a directory its uid cannot enter (a 0700 $TMPDIR)
    script = "main.py" if conf["ns"] else "/proc/self/cwd/main.py"
    os.execv(conf["exe"], [conf["exe"], "-I", "-S", "-B", "-X", "utf8", script])


def exit_as(status):  # the wrapper ends as the program did
    if os.WIFSIGNALED(status):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.WTERMSIG(status) not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) % 256)


if not conf["ns"]:  # it becomes the program: the caller kills its group and uid after
    die_with_parent(lambda: os.getppid() == ppid)
    join_cgroup()
    write_program("main.py")
    confine(ppid)
ok(libc.unshare(L(NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWPID | NEWNET | NEWUSER * conf["userns"])), "unshare")
if conf["userns"]:
    maps = ("setgroups", "deny"), ("uid_map", "%d %d 1" % (owner, owner)), ("gid_map", "%d %d 1" % (group, group))
    for name, text in maps:  # the same ids inside: files it makes are its own
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
die_with_parent(lambda: os.getppid() == ppid)
alive_r, alive_w = os.pipe()  # open while this process lives: its child reads EOF once it is gone
status_r, status_w = os.pipe()  # the program's wait status, from the init
init = os.fork()
if init:  # outside the namespaces, waiting: the kernel ends an init only once all else in its namespace has ended
    os.close(status_w)
    status = os.waitpid(init, 0)[1]
    exit_as(int(os.read(status_r, 32) or status))
os.close(alive_w)
die_with_parent(lambda: not select.select([alive_r], [], [], 0)[0])
join_cgroup()
new_root()
os.setsid()  # the program's process group and session are the init's, not the wrapper's
libc.prctl(4, L(0))  # not dumpable: a program of the same uid (user namespace) cannot ptrace it
signal.signal(signal.SIGINT, signal.SIG_DFL)  # an init ignores signals from inside it that it has no handler for
program = os.fork()
if program == 0:
    confine(1)
while True:  # reap what is re-parented here; the program's end is the init's, which kills all that is left
    pid, status = os.wait()
    if pid == program:
        os.write(status_w, b"%d" % status)
        os._exit(0)
