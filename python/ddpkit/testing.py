"""The multi-process harness of ddpkit's tests and benchmarks.

``WorkerPool`` (``ddpkit.workers``'s, re-exported with its errors) keeps N worker processes with a live
process group and runs functions on all of them. ``HostPool`` is a WorkerPool whose ranks run on
simulated hosts: network and mount namespaces of this machine, each with a launcher of its own.
``time_engine_loop`` times the engine's layers in C++ loops; it needs a testing build (below).
``import ddpkit`` does not load this module.

A testing build (``scripts/setup.sh``, the CMake option DDPKIT_TESTING) also carries the fault
points the tests arm with DDPKIT_TEST_FAULT and the host split of DDPKIT_TEST_HOSTS
(csrc/testing/faults.h); ``pip install .`` builds the release library without any of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .workers import RemoteTraceback, WorkerFailure, WorkerPool, _die_with_parent, _worker_main

__all__ = [
    "HostPool",
    "RemoteTraceback",
    "WorkerFailure",
    "WorkerPool",
    "is_testing_build",
    "parse_link",
    "time_engine_loop",
]


def is_testing_build() -> bool:
    """Whether the installed extension carries the test hooks (the CMake option DDPKIT_TESTING)."""
    from . import _C  # noqa: F401  (registers the op libraries)

    return hasattr(torch.ops.ddpkit_testing, "time_engine_loop")


def time_engine_loop(numel: int, iterations: int, stage: str, group: dist.ProcessGroup | None = None) -> float:
    """Seconds per call of ``stage`` ("lookup", "engine", "all_reduce", "all_reduce_unchecked") looped in C++
    with no Python or dispatcher between calls: a benchmark of the engine's layers
    (csrc/testing/engine_loop.cpp); a collective, so every rank calls it with the same arguments."""
    if not is_testing_build():
        raise RuntimeError(
            "ddpkit.testing.time_engine_loop needs a testing build of ddpkit (scripts/setup.sh, "
            "or pip install -C cmake.define.DDPKIT_TESTING=ON --no-build-isolation .)"
        )
    from .comm import group_name

    return torch.ops.ddpkit_testing.time_engine_loop(numel, iterations, stage, group_name(group))


# --- simulated hosts -----------------------------------------------------------------------------


class HostPool(WorkerPool):
    """A WorkerPool whose ranks run on simulated hosts: ``ranks_per_host[h]`` ranks on host h, numbered
    host by host. Each host is a network namespace with one veth link, named ``dkh`` inside and shaped
    with tc's tbf to ``rate`` such as "1gbit" when given, and a mount and UTS namespace with a private
    /dev/shm and hostname, and runs a launcher of its own (Note [Entering a simulated host]) that
    forks its ranks, with GLOO_SOCKET_IFNAME set to its link and host 0 holding the store. The links
    meet in a bridge; with ``round_trip_ms``, a wide-area link: each host on a subnet of its own behind
    a router namespace that holds every packet between two hosts for half the round trip on its way
    (ddpkit_tun_delay, a testing build's program: this kernel has no netem), the router's port to each
    host shaped to ``rate`` too. ``run`` is WorkerPool's. After ``close()``, ``leftovers[h]`` lists
    what host h's /dev/shm held once its ranks had exited. Needs root and iproute2:
    ``HostPool.unavailable()`` says why it cannot run here, or returns None.
    """

    SUBNET = "10.213.0"
    ROUTED_PREFIX = "10.214"  # host h of a delayed pool: 10.214.(h+1).2, its router port .1
    STORE_PORT = 29533
    ROUTED_MTU = 9000  # fewer packets for the delayer to carry

    def __init__(
        self,
        ranks_per_host: list,
        backend: str = "gloo",
        timeout: float = 180.0,
        group_timeout: float = 60.0,
        threads: int = 1,
        env: dict | None = None,
        rate: str | None = None,
        round_trip_ms: float | None = None,
        congestion_control: str | None = None,
    ):
        super().__init__(
            sum(ranks_per_host), backend=backend, timeout=timeout, group_timeout=group_timeout, threads=threads, env=env
        )
        self.ranks_per_host = list(ranks_per_host)
        self.rate = rate
        self.round_trip_ms = round_trip_ms
        self.congestion_control = congestion_control
        self.leftovers: dict = {}
        self._prefix = f"dk{os.getpid() % 100000}{secrets.token_hex(2)}"
        self._namespaces: list = []
        self._launchers: list = []
        self._delayer = None
        self._tmp = None

    @staticmethod
    def unavailable(delayed: bool = False) -> str | None:
        """Why simulated hosts (with ``delayed``, behind a delaying router) cannot run here, or None."""
        if os.geteuid() != 0:
            return "simulated hosts need root (network and mount namespaces)"
        for tool in ("ip", "unshare") + (("tc",) if delayed else ()):
            if shutil.which(tool) is None:
                return f"simulated hosts need {tool} (iproute2, util-linux)"
        if delayed and not delayer_path().is_file():
            return "delayed links need a testing build of ddpkit (its ddpkit_tun_delay program; scripts/setup.sh)"
        if delayed and not os.path.exists("/dev/net/tun"):
            return "delayed links need /dev/net/tun"
        return None

    def host_address(self, host: int) -> str:
        """The address of host ``host``'s link, where its ranks listen and host 0 keeps the store."""
        if self.round_trip_ms is None:
            return f"{self.SUBNET}.{host + 1}"
        return f"{self.ROUTED_PREFIX}.{host + 1}.2"

    def _host_namespace(self, host: int) -> str:
        return f"{self._prefix}h{host}"

    def _on_host(self, host: int, script: str) -> list[str]:
        """The command that runs the shell `script` on simulated host `host`: in its network
        namespace, with mount and hostname namespaces of its own (so its /dev/shm and name too)."""
        return ["ip", "netns", "exec", self._host_namespace(host)] + [
            "unshare",
            "-m",
            "-u",
            "--fork",
            "--kill-child",
            "sh",
            "-c",
            script,
        ]

    def _ip(self, *args: str, namespace: str | None = None) -> None:
        command = ["ip"] + (["-n", namespace] if namespace else []) + list(args)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ddpkit.testing.HostPool: {shlex.join(command)} failed: {done.stderr.strip()}")

    def _set_congestion_control(self, namespace: str) -> None:
        # Before any socket of the host exists: TCP's congestion control is chosen as a socket is made.
        if self.congestion_control is None:
            return
        setting = f"net.ipv4.tcp_congestion_control={self.congestion_control}"
        done = subprocess.run(
            ["ip", "netns", "exec", namespace, "sysctl", "-qw", setting], capture_output=True, text=True
        )
        if done.returncode != 0:
            with open("/proc/sys/net/ipv4/tcp_allowed_congestion_control") as f:
                allowed = f.read().strip()
            raise RuntimeError(
                f"ddpkit.testing.HostPool: congestion control {self.congestion_control!r} refused in a host's "
                f"namespace (net.ipv4.tcp_allowed_congestion_control: {allowed}): {done.stderr.strip()}"
            )

    def _tc(self, namespace: str, device: str, rate: str) -> None:
        # tbf's queue holds 50 ms at the rate, and a round trip more where the path is delayed.
        latency = 50 + (self.round_trip_ms or 0)
        command = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf"]
        command += ["rate", rate, "burst", "1mbit", "latency", f"{latency:g}ms"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ddpkit.testing.HostPool: {shlex.join(command)} failed: {done.stderr.strip()}")

    def _make_network(self) -> None:
        if self.round_trip_ms is not None:
            self._make_routed_network()
            return
        switch = f"{self._prefix}sw"
        subprocess.run(["ip", "netns", "add", switch], check=True, capture_output=True)
        self._namespaces.append(switch)
        self._ip("link", "add", "dkbr", "type", "bridge", namespace=switch)
        self._ip("link", "set", "dkbr", "up", namespace=switch)
        for host in range(len(self.ranks_per_host)):
            namespace = self._host_namespace(host)
            subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True)
            self._namespaces.append(namespace)
            self._set_congestion_control(namespace)
            outer, inner = f"{self._prefix}o{host}", f"{self._prefix}i{host}"
            self._ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            self._ip("link", "set", inner, "netns", namespace)
            self._ip("link", "set", outer, "netns", switch)
            self._ip("link", "set", inner, "name", "dkh", namespace=namespace)
            self._ip("addr", "add", f"{self.SUBNET}.{host + 1}/24", "dev", "dkh", namespace=namespace)
            self._ip("link", "set", "dkh", "up", namespace=namespace)
            self._ip("link", "set", "lo", "up", namespace=namespace)
            self._ip("link", "set", outer, "master", "dkbr", namespace=switch)
            self._ip("link", "set", outer, "up", namespace=switch)
            if self.rate:
                self._tc(namespace, "dkh", self.rate)

    def set_round_trip(self, round_trip_ms: float) -> None:
        """Delays every packet between two hosts from now on by half ``round_trip_ms`` (a pool made
        with a round trip): a path that grows longer after the links were made."""
        assert self._delayer is not None, "HostPool.set_round_trip: the pool was made without a round trip"
        self._delayer.stdin.write(f"{round(round_trip_ms * 500)}\n")
        self._delayer.stdin.flush()
        answer = self._delayer.stdout.readline().strip()
        if answer != "ok":
            raise RuntimeError(f"ddpkit.testing.HostPool: ddpkit_tun_delay answered {answer!r}")
        self.round_trip_ms = round_trip_ms

    def _make_routed_network(self) -> None:
        """Each host on a subnet of its own, its link to a port of a router namespace whose policy
        routes send every packet that enters from a host through a TUN device, where ddpkit_tun_delay
        holds it half the round trip before the main table forwards it to its host."""
        router = f"{self._prefix}rt"
        subprocess.run(["ip", "netns", "add", router], check=True, capture_output=True)
        self._namespaces.append(router)
        sysctls = ["net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"]
        subprocess.run(["ip", "netns", "exec", router, "sysctl", "-qw", *sysctls], check=True, capture_output=True)
        self._delayer = subprocess.Popen(
            ["ip", "netns", "exec", router, str(delayer_path()), "dkwan", str(round(self.round_trip_ms * 500))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        if self._delayer.stdout.readline().strip() != "ready":
            raise RuntimeError(f"ddpkit.testing.HostPool: ddpkit_tun_delay failed: {self._delayer.stderr.read()}")
        self._ip("link", "set", "dkwan", "mtu", str(self.ROUTED_MTU), "up", namespace=router)
        self._ip("route", "add", "default", "dev", "dkwan", "table", "100", namespace=router)
        for host in range(len(self.ranks_per_host)):
            namespace = self._host_namespace(host)
            subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True)
            self._namespaces.append(namespace)
            self._set_congestion_control(namespace)
            outer, inner, port = f"{self._prefix}o{host}", f"{self._prefix}i{host}", f"dkr{host}"
            # Both ends at the routed MTU: a veth drops an arriving packet longer than its own MTU
            # unless it is a segmentation-offload burst, so a lone segment between the two MTUs (a
            # small collective's message) would be lost on every retransmission while bulk transfers
            # passed.
            mtu = str(self.ROUTED_MTU)
            self._ip("link", "add", inner, "mtu", mtu, "type", "veth", "peer", "name", outer, "mtu", mtu)
            self._ip("link", "set", inner, "netns", namespace)
            self._ip("link", "set", outer, "netns", router)
            self._ip("link", "set", inner, "name", "dkh", namespace=namespace)
            self._ip("link", "set", outer, "name", port, namespace=router)
            subnet = f"{self.ROUTED_PREFIX}.{host + 1}"
            self._ip("addr", "add", f"{subnet}.2/24", "dev", "dkh", namespace=namespace)
            self._ip("link", "set", "dkh", "up", namespace=namespace)
            self._ip("link", "set", "lo", "up", namespace=namespace)
            self._ip("route", "add", "default", "via", f"{subnet}.1", namespace=namespace)
            self._ip("addr", "add", f"{subnet}.1/24", "dev", port, namespace=router)
            subprocess.run(
                ["ip", "netns", "exec", router, "sysctl", "-qw", f"net.ipv4.conf.{port}.rp_filter=0"],
                check=True,
                capture_output=True,
            )
            self._ip("link", "set", port, "up", namespace=router)
            self._ip("rule", "add", "iif", port, "lookup", "100", namespace=router)
            if self.rate:
                self._tc(namespace, "dkh", self.rate)
                self._tc(router, port, self.rate)

    def start(self) -> None:
        if self._conns:
            return
        reason = self.unavailable(delayed=self.round_trip_ms is not None)
        if reason:
            raise RuntimeError(f"ddpkit.testing.HostPool: {reason}")
        self._tmp = tempfile.mkdtemp(prefix="ddpkit-hosts-")
        address = os.path.join(self._tmp, "pool.sock")
        authkey = secrets.token_bytes(16)
        listener = multiprocessing.connection.Listener(address, family="AF_UNIX", authkey=authkey)
        try:
            self._make_network()
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["torch", "ddpkit"])  # WorkerPool's: one forkserver serves both
            first = 0
            for host, count in enumerate(self.ranks_per_host):
                spec = {
                    "address": address,
                    "authkey": authkey.hex(),
                    "ranks": list(range(first, first + count)),
                    "world_size": self.world_size,
                    "master_addr": self.host_address(0),
                    "port": self.STORE_PORT,
                    "store_host": host == 0,
                    "backend": self.backend,
                    "group_timeout": self.group_timeout,
                    "threads": self.threads,
                    "env": {**self.env, "GLOO_SOCKET_IFNAME": "dkh"},
                    "sys_path": sys.path,
                    "namespace": self._host_namespace(host),
                    "hostname": f"ddpkit-host{host}",
                    "log": os.path.join(self._tmp, f"host{host}.log"),
                }
                first += count
                report, child_report = ctx.Pipe(duplex=False)
                launcher = ctx.Process(
                    target=_host_main, args=(spec, child_report), daemon=True, name=f"ddpkit-host{host}"
                )
                launcher.start()
                child_report.close()
                self._launchers.append((launcher, report))
            conns: dict = {}
            accepting = threading.Thread(target=lambda: conns.update(self._accept(listener)), daemon=True)
            accepting.start()
            accepting.join(max(self.timeout, 60.0))
            if len(conns) != self.world_size:
                raise TimeoutError(
                    f"ddpkit.testing.HostPool: only ranks {sorted(conns)} of {self.world_size} "
                    f"connected; launchers said: {self._launcher_output()}"
                )
            listener.close()
            self._conns = [conns[rank] for rank in range(self.world_size)]
            self._collect(time.monotonic() + max(self.timeout, 60.0))
        except BaseException:
            try:
                listener.close()
            except OSError:
                pass
            self.kill()
            raise

    def _accept(self, listener) -> dict:
        conns = {}
        while len(conns) < self.world_size:
            conn = _PlainConnection(listener.accept())
            _, rank = conn.recv()
            conns[rank] = conn
        return conns

    def _sentinel(self, rank: int):
        return None  # a remote rank's end shows as its connection closing

    def _fate(self, rank: int) -> str:
        return "its connection closed"

    def _launcher_output(self) -> str:
        text = []
        for host, (launcher, report) in enumerate(self._launchers):
            if launcher.is_alive():
                continue
            try:
                kind, value = report.recv() if report.poll() else (None, None)
            except (EOFError, OSError):
                kind, value = None, None
            log = Path(self._tmp, f"host{host}.log")
            said = (log.read_text(errors="replace") if log.is_file() else "") + (value if kind == "error" else "")
            text.append(f"host {host} (exit code {launcher.exitcode}): {said[-2000:]}")
        return " | ".join(text) or "nothing"

    def close(self) -> None:
        self._ask_workers_to_exit()
        for host, (_, report) in enumerate(self._launchers):
            try:
                kind, value = report.recv() if report.poll(30) else (None, None)
            except (EOFError, OSError):
                kind, value = None, None
            self.leftovers[host] = value if kind == "dev_shm" else None
        self.kill()

    def kill(self) -> None:
        for launcher, report in self._launchers:
            if launcher.is_alive():
                try:
                    os.killpg(launcher.pid, signal.SIGKILL)  # its session: the launcher and its ranks
                except ProcessLookupError:  # not yet its own session, so no ranks yet
                    launcher.kill()
            launcher.join()
            report.close()
        for conn in self._conns:
            conn.close()
        self._conns, self._launchers = [], []
        if self._delayer is not None:
            try:
                os.killpg(self._delayer.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._delayer.communicate()
            self._delayer = None
        for namespace in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._namespaces = []
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


# --- torchft replica groups on simulated hosts ----------------------------------------------------------

_LIGHTHOUSE = """
import sys
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms={join_ms}, quorum_tick_ms=20,
                          heartbeat_timeout_ms={heartbeat_ms})
print(server.address().rsplit(":", 1)[1], flush=True)
sys.stdin.read()
server.shutdown()
"""


@contextlib.contextmanager
def torchft_hosts(
    folder: Path,
    hosts: int,
    host_of,
    rate: str | None = None,
    heartbeat_ms: int = 700,
    join_ms: int = 400,
    round_trip_ms: float | None = None,
    congestion_control: str | None = None,
):
    """`hosts` simulated hosts (HostPool's network and namespaces, links shaped to `rate` and delayed
    by `round_trip_ms` where given, the hosts' TCP taking `congestion_control`) for torchft replica groups, a lighthouse on host 0 (heartbeat and
    join timeouts in ms: the tests' settings by default). Yields the `launch` of
    benchmarks/ft_replica.py's ReplicaGroups that runs replica r on host `host_of(r)`, with a private
    /dev/shm and hostname there, its store at that host's address and TORCHFT_LIGHTHOUSE set."""
    pool = HostPool([1] * hosts, rate=rate, round_trip_ms=round_trip_ms, congestion_control=congestion_control)
    lighthouse = None
    try:
        pool._make_network()
        namespaces = [pool._host_namespace(h) for h in range(hosts)]
        address = [pool.host_address(h) for h in range(hosts)]
        lighthouse = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                namespaces[0],
                sys.executable,
                "-c",
                _LIGHTHOUSE.format(join_ms=join_ms, heartbeat_ms=heartbeat_ms),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        port = int(lighthouse.stdout.readline())
        # torchft's checkpoint server names itself by the host's name: each host resolves every name.
        names = folder / "hosts"
        names.write_text("127.0.0.1 localhost\n" + "".join(f"{a} ft-host{h}\n" for h, a in enumerate(address)))
        # No name server is reachable from a simulated host: a lookup must fail at once, not time out.
        resolv = folder / "resolv.conf"
        resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

        def on_host(replica: int, argv: list, env: dict) -> tuple:
            host = host_of(replica)
            env = {
                **env,
                "MASTER_ADDR": address[host],
                "FT_HOSTNAME": address[host],
                "GLOO_SOCKET_IFNAME": "dkh",
                "TORCHFT_LIGHTHOUSE": f"http://{address[0]}:{port}",
            }
            script = (
                f"mount -t tmpfs tmpfs /dev/shm && mount --bind {shlex.quote(str(names))} /etc/hosts && "
                f"mount --bind {shlex.quote(str(resolv))} /etc/resolv.conf && "
                f"hostname ft-host{host} && exec {shlex.join(argv)}"
            )
            return pool._on_host(host, script), env

        yield on_host
    finally:
        if lighthouse is not None:
            os.killpg(lighthouse.pid, signal.SIGKILL)
            lighthouse.wait()
        pool.kill()


def delayer_path() -> Path:
    """ddpkit_tun_delay, the delayed links' program, which a testing build installs beside the library;
    DDPKIT_TUN_DELAY names another (a testing build's, for benchmarks of a release build)."""
    if os.environ.get("DDPKIT_TUN_DELAY"):
        return Path(os.environ["DDPKIT_TUN_DELAY"])
    from . import _C

    return Path(_C.__file__).parent / "ddpkit_tun_delay"


def parse_link(link: str) -> dict:
    """HostPool's link settings for a link named as the benchmarks take them: "unshaped", a tc rate
    such as "1gbit", or a rate and a round trip such as "1gbit-10ms" ("unshaped-10ms": delayed only),
    either followed by the hosts' TCP congestion control where it is not this machine's default, such
    as "1gbit-10ms-reno"."""
    rate, *rest = link.split("-")
    settings = {"rate": None if rate == "unshaped" else rate, "round_trip_ms": None, "congestion_control": None}
    if rest and rest[0][:1].isdigit():
        delay = rest.pop(0)
        if not delay.endswith("ms"):
            raise ValueError(f"a link's round trip is in ms, such as 1gbit-10ms, got {link!r}")
        settings["round_trip_ms"] = float(delay[:-2])
    if len(rest) > 1:
        raise ValueError(f"a link is RATE, RATE-ROUNDTRIPms or either with -CONGESTION_CONTROL, got {link!r}")
    if rest:
        settings["congestion_control"] = rest[0]
    return settings


class _PlainConnection:
    """A Connection whose messages are plain pickles. A HostPool's ranks are not the parent's children,
    so they cannot take file descriptors from it through multiprocessing's resource sharer, which the
    default pickling of tensors over a Connection (torch.multiprocessing's shared memory) relies on."""

    def __init__(self, conn):
        self._conn = conn

    def send(self, obj) -> None:
        self._conn.send_bytes(pickle.dumps(obj))

    def recv(self):
        return pickle.loads(self._conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self._conn.poll(timeout)

    def fileno(self) -> int:
        return self._conn.fileno()

    def close(self) -> None:
        self._conn.close()


# Note [Entering a simulated host]
# A simulated host's launcher is a child of the forkserver that WorkerPool's ranks come from, with torch
# and ddpkit already imported, and forks its ranks: no process of a pool imports torch again (an import
# costs more CPU than most of tests/test_multihost.py's cases, and a pool's start and close made up
# most of their time when each host was `python -m` of its own). It enters its host as
# `ip netns exec NS unshare -m -u sh -c 'mount -t tmpfs tmpfs /dev/shm && hostname NAME'` would: setns
# into the network namespace, then a mount and a UTS namespace of its own (unshare needs a process of
# one thread, which a forkserver's child is), its mounts private, a tmpfs on /dev/shm and the hostname;
# its ranks share all three. It calls setsid, so that HostPool.kill ends the launcher and its ranks at
# once; its ranks die with it (PR_SET_PDEATHSIG), and it dies with the forkserver.

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000  # <sched.h>
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000  # <sys/mount.h>


def _enter_host(namespace: str, hostname: str) -> None:
    """Moves this process, of one thread, onto the simulated host of network namespace ``namespace``
    with a private /dev/shm and ``hostname`` (Note [Entering a simulated host])."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            number = ctypes.get_errno()
            raise OSError(number, f"ddpkit.testing.HostPool: {what}: {os.strerror(number)}")

    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), f"setns into {namespace}")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWUTS), "unshare")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "making / private")
    check(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, None), "mounting a tmpfs on /dev/shm")
    name = hostname.encode()
    check(libc.sethostname(name, len(name)), "sethostname")


def _host_main(spec: dict, report) -> None:
    """One simulated host's launcher: its ranks, and the store on host 0; then it reports what /dev/shm
    holds, or why it failed."""
    os.setsid()
    _die_with_parent()
    sys.path[:] = spec["sys_path"]
    with open(spec["log"], "ab", buffering=0) as log:  # what the host and its ranks print, as a host's console
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        _enter_host(spec["namespace"], spec["hostname"])
        ranks = []
        for local_rank, rank in enumerate(spec["ranks"]):
            pid = os.fork()
            if pid == 0:
                report.close()
                code = 1
                try:
                    _host_rank_main(spec, rank, local_rank)
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
            ranks.append(pid)
        store = None
        if spec["store_host"]:  # after the forks: the store's thread stays in this process
            store = dist.TCPStore(
                spec["master_addr"],
                spec["port"],
                spec["world_size"],
                is_master=True,
                timeout=datetime.timedelta(seconds=spec["group_timeout"]),
                wait_for_workers=False,
            )
        for pid in ranks:
            os.waitpid(pid, 0)
        del store
        report.send(("dev_shm", sorted(os.listdir("/dev/shm"))))
    except BaseException:
        report.send(("error", traceback.format_exc()))


def _host_rank_main(spec: dict, rank: int, local_rank: int) -> None:
    conn = _PlainConnection(
        multiprocessing.connection.Client(spec["address"], family="AF_UNIX", authkey=bytes.fromhex(spec["authkey"]))
    )
    conn.send(("hello", rank))
    _worker_main(
        rank,
        spec["world_size"],
        spec["port"],
        spec["backend"],
        spec["group_timeout"],
        spec["threads"],
        spec["env"],
        conn,
        master_addr=spec["master_addr"],
        local=(local_rank, len(spec["ranks"])),
    )
