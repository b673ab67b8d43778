"""The multi-process harness of ddpkit's tests and benchmarks.

``WorkerPool`` (``ddpkit.workers``'s, re-exported with its errors) keeps N worker processes with a live
process group and runs functions on all of them. ``HostPool`` is a WorkerPool whose ranks run on
simulated hosts: network and mount namespaces of this machine, each with a launcher of its own
(``python -m ddpkit.testing host``). ``time_engine_loop`` times the engine's layers in C++ loops; it
needs a testing build (below). ``import ddpkit`` does not load this module.

A testing build (``scripts/setup.sh``, the CMake option DDPKIT_TESTING) also carries the fault
points the tests arm with DDPKIT_TEST_FAULT and the host split of DDPKIT_TEST_HOSTS
(csrc/testing/faults.h); ``pip install .`` builds the release library without any of them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
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
from pathlib import Path

import torch
import torch.distributed as dist

from .workers import RemoteTraceback, WorkerFailure, WorkerPool, _die_with_parent, _worker_main

__all__ = ["HostPool", "RemoteTraceback", "WorkerFailure", "WorkerPool", "is_testing_build", "time_engine_loop"]


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
    host by host. Each host is a network namespace joined to the others through a bridge (a veth link
    each, named ``dkh`` inside, shaped with tc's tbf to ``rate`` such as "1gbit" when given) and a
    mount and UTS namespace with a private /dev/shm and hostname, and runs a launcher of its own
    (``python -m ddpkit.testing host``) that starts its ranks, with GLOO_SOCKET_IFNAME set to its link
    and host 0 holding the store. ``run`` is WorkerPool's. After ``close()``, ``leftovers[h]`` lists
    what host h's /dev/shm held once its ranks had exited. Needs root and iproute2:
    ``HostPool.unavailable()`` says why it cannot run here, or returns None.
    """

    SUBNET = "10.213.0"
    STORE_PORT = 29533

    def __init__(
        self,
        ranks_per_host: list,
        backend: str = "gloo",
        timeout: float = 180.0,
        group_timeout: float = 60.0,
        threads: int = 1,
        env: dict | None = None,
        rate: str | None = None,
    ):
        super().__init__(
            sum(ranks_per_host), backend=backend, timeout=timeout, group_timeout=group_timeout, threads=threads, env=env
        )
        self.ranks_per_host = list(ranks_per_host)
        self.rate = rate
        self.leftovers: dict = {}
        self._prefix = f"dk{os.getpid() % 100000}{secrets.token_hex(2)}"
        self._namespaces: list = []
        self._launchers: list = []
        self._tmp = None

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "simulated hosts need root (network and mount namespaces)"
        for tool in ("ip", "unshare"):
            if shutil.which(tool) is None:
                return f"simulated hosts need {tool} (iproute2, util-linux)"
        return None

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

    def _make_network(self) -> None:
        switch = f"{self._prefix}sw"
        subprocess.run(["ip", "netns", "add", switch], check=True, capture_output=True)
        self._namespaces.append(switch)
        self._ip("link", "add", "dkbr", "type", "bridge", namespace=switch)
        self._ip("link", "set", "dkbr", "up", namespace=switch)
        for host in range(len(self.ranks_per_host)):
            namespace = self._host_namespace(host)
            subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True)
            self._namespaces.append(namespace)
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
                subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        namespace,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        "dkh",
                        "root",
                        "tbf",
                        "rate",
                        self.rate,
                        "burst",
                        "1mbit",
                        "latency",
                        "50ms",
                    ],
                    check=True,
                    capture_output=True,
                )

    def start(self) -> None:
        if self._conns:
            return
        reason = self.unavailable()
        if reason:
            raise RuntimeError(f"ddpkit.testing.HostPool: {reason}")
        self._tmp = tempfile.mkdtemp(prefix="ddpkit-hosts-")
        address = os.path.join(self._tmp, "pool.sock")
        authkey = secrets.token_bytes(16)
        listener = multiprocessing.connection.Listener(address, family="AF_UNIX", authkey=authkey)
        try:
            self._make_network()
            first = 0
            for host, count in enumerate(self.ranks_per_host):
                spec = {
                    "address": address,
                    "authkey": authkey.hex(),
                    "ranks": list(range(first, first + count)),
                    "world_size": self.world_size,
                    "master_addr": f"{self.SUBNET}.1",
                    "port": self.STORE_PORT,
                    "store_host": host == 0,
                    "backend": self.backend,
                    "group_timeout": self.group_timeout,
                    "threads": self.threads,
                    "env": {**self.env, "GLOO_SOCKET_IFNAME": "dkh"},
                    "sys_path": sys.path,
                }
                first += count
                script = (
                    f"mount -t tmpfs tmpfs /dev/shm && hostname ddpkit-host{host} && exec "
                    f"{shlex.quote(sys.executable)} -m ddpkit.testing host {shlex.quote(json.dumps(spec))}"
                )
                self._launchers.append(
                    subprocess.Popen(
                        self._on_host(host, script),
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        start_new_session=True,
                    )
                )
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
        for launcher in self._launchers:
            if launcher.poll() is not None:
                out, err = launcher.communicate()
                text.append((err or "")[-2000:])
        return " | ".join(t for t in text if t) or "nothing"

    def close(self) -> None:
        self._ask_workers_to_exit()
        for host, launcher in enumerate(self._launchers):
            try:
                out, _ = launcher.communicate(timeout=30)
                lines = [line for line in out.splitlines() if line.startswith("{")]
                self.leftovers[host] = json.loads(lines[-1])["dev_shm"] if lines else None
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        for launcher in self._launchers:
            if launcher.poll() is None:
                try:
                    os.killpg(launcher.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            launcher.wait()
        for conn in self._conns:
            conn.close()
        self._conns, self._launchers = [], []
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
    folder: Path, hosts: int, host_of, rate: str | None = None, heartbeat_ms: int = 700, join_ms: int = 400
):
    """`hosts` simulated hosts (HostPool's network and namespaces, links shaped to `rate` where given)
    for torchft replica groups, a lighthouse on host 0 (heartbeat and join timeouts in ms: the tests'
    settings by default). Yields the `launch` of benchmarks/ft_replica.py's ReplicaGroups that runs
    replica r on host `host_of(r)`, with a private /dev/shm and hostname there, its store at that
    host's address and TORCHFT_LIGHTHOUSE set."""
    pool = HostPool([1] * hosts, rate=rate)
    lighthouse = None
    try:
        pool._make_network()
        namespaces = [pool._host_namespace(h) for h in range(hosts)]
        address = [f"{HostPool.SUBNET}.{h + 1}" for h in range(hosts)]
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


def _host_main(spec: dict) -> None:
    """One simulated host's launcher: its ranks, and the store on host 0; then what /dev/shm holds."""
    _die_with_parent()
    sys.path[:] = spec["sys_path"]
    store = None
    if spec["store_host"]:
        store = dist.TCPStore(
            spec["master_addr"],
            spec["port"],
            spec["world_size"],
            is_master=True,
            timeout=datetime.timedelta(seconds=spec["group_timeout"]),
            wait_for_workers=False,
        )
    ctx = mp.get_context("spawn")
    ranks = []
    for local_rank, rank in enumerate(spec["ranks"]):
        process = ctx.Process(target=_host_rank_main, args=(spec, rank, local_rank), daemon=True)
        process.start()
        ranks.append(process)
    for process in ranks:
        process.join()
    del store
    print(json.dumps({"dev_shm": sorted(os.listdir("/dev/shm"))}), flush=True)


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


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "host":
        _host_main(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: python -m ddpkit.testing host SPEC (HostPool starts it)")
