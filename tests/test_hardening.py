"""ddpkit under faults, bad input and a hostile local user: every case here failed before it was
fixed (see Note [Shared-memory segment] in csrc/comm/shm/segment.h and Note [Collective checks] in
csrc/comm/core/communicator.h).

- A local user of another uid cannot feed a rank a segment, read or write one, whatever it writes
  into the store; data a rank reads from the segment is bounds-checked.
- Set-up: two fresh groups used from two threads in opposite orders never deadlock; a rank dying at
  any step of set-up is named by every survivor, and nothing is left anywhere.
- A call one rank rejects raises on every rank, and the next calls pair correctly.
- Creating and destroying groups holds threads, descriptors and memory flat.
- Errors name the culprit: the ranks that never arrived, the rank that died first, a non-member.
- max/min with NaN and signed zeros: one deliberate semantics, identical bits everywhere.
"""

import datetime
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import WorkerFailure, WorkerPool

from helpers import BACKEND_ONE_RANK_REJECTS, ONE_RANK_REJECTS, algorithms_for, call_each_then_all_reduce

REPO = Path(__file__).resolve().parent.parent
GROUP_TIMEOUT_S = 10.0
ATTACKER = "ddpkit-attacker"


def memfd_state() -> tuple:
    """(mappings, open descriptors) of ddpkit's shared-memory segments in this process."""
    maps = sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if "/memfd:ddpkit" in line)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += "memfd:ddpkit" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return maps, fds


def fresh_pool(world_size, **env) -> WorkerPool:
    return WorkerPool(world_size, timeout=120.0, group_timeout=GROUP_TIMEOUT_S, env=env)


def run_and_kill(pool: WorkerPool, fn, *args, **kwargs) -> list:
    """``pool.run(fn, *args)`` with every outcome returned (exceptions included); the pool is then
    killed, and no worker may be left alive."""
    try:
        return pool.run(fn, *args, return_exceptions=True, **kwargs)
    finally:
        processes = list(pool._processes)
        pool.kill()
        assert not any(p.is_alive() for p in processes), "worker processes were left behind"


# --- a hostile local user ------------------------------------------------------------------------

ATTACK = textwrap.dedent("""
    # Run as another uid, before the first collective of a fresh group: what the issue's probe did
    # against the store-based rendezvous, and every other way in it could think of.
    import errno, json, mmap, os, struct, sys, datetime
    import torch.distributed as dist
    port, group, pids = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    report = {"opened": [], "segment": None}
    # A 0666 segment whose header claims an absurd chunk offset, published under every key the old
    # rendezvous read (group name, instance 0, several store prefixes).
    path = "/dev/shm/ddpkit-attacker-segment"
    with open(path, "wb") as f:
        f.write(struct.pack("<4q", 7, 1 << 46, 1 << 46, 64) + b"\\x55" * (1 << 20))
    os.chmod(path, 0o666)
    report["segment"] = path
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    for prefix in ("", "default_pg/", "default_pg/0/", group + "/", "default_pg/0/" + group + "/"):
        for name in (group, "0", "default_pg"):
            base = f"{prefix}ddpkit/shm/{name}/0/"
            store.set(base + "name", "/ddpkit-attacker-segment")
            for rank in range(len(pids)):
                store.set(base + f"host/{rank}", f"{pids[rank]}@forged")
            store.add(base + "mapped", 100)
    # The ranks' own memory: descriptors, mappings, /proc/<pid>/mem.
    for pid in pids:
        for sub in ("fd", "map_files"):
            try:
                for entry in os.listdir(f"/proc/{pid}/{sub}"):
                    try:
                        os.close(os.open(f"/proc/{pid}/{sub}/{entry}", os.O_RDWR))
                        report["opened"].append(f"/proc/{pid}/{sub}/{entry}")
                    except OSError:
                        pass
            except OSError:
                pass
        try:
            os.close(os.open(f"/proc/{pid}/mem", os.O_RDWR))
            report["opened"].append(f"/proc/{pid}/mem")
        except OSError:
            pass
    print(json.dumps(report))
""")


def attacker_uid() -> int:
    try:
        return pwd.getpwnam(ATTACKER).pw_uid
    except KeyError:
        subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER], check=True, capture_output=True
        )
        return pwd.getpwnam(ATTACKER).pw_uid


def attacker_command(home: str) -> tuple:
    """A Python the attacker may run with torch importable (this interpreter may sit in root's home,
    which other users cannot enter: then the system's of the same version), and its environment."""
    site = str(Path(torch.__file__).resolve().parent.parent)
    env = {"HOME": home, "PATH": "/usr/bin:/bin", "PYTHONPATH": site}
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (os.path.realpath(sys.executable), f"/usr/bin/{version}"):
        probe = subprocess.run(
            [shutil.which("runuser"), "-u", ATTACKER, "--", python, "-c", "import torch.distributed"],
            capture_output=True,
            env=env,
            cwd=home,
        )
        if probe.returncode == 0:
            return python, env
    pytest.skip(f"no Python that user {ATTACKER} may run imports torch (tried this one and /usr/bin/{version})")


def case_attacked_first_collective(script: str, python: str, env: dict):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world_size)))  # fresh: no segment yet
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    report = None
    if rank == 0:
        completed = subprocess.run(
            [
                shutil.which("runuser"),
                "-u",
                ATTACKER,
                "--",
                python,
                script,
                os.environ["MASTER_PORT"],
                group.group_name,
                json.dumps(pids),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=env["HOME"],
        )
        assert completed.returncode == 0, completed.stderr
        report = json.loads(completed.stdout.strip().splitlines()[-1])
    dist.barrier()
    tensor = torch.full((100_000,), float(rank + 1))
    ddpkit.all_reduce(tensor, group=group)
    moved = torch.full((300_000,), float(rank + 1))
    ddpkit.broadcast(moved, src=1, group=group)  # messages through the channels
    transport = ddpkit.comm.resolved_transport(group)
    dist.destroy_process_group(group)
    return report, tensor, moved, transport


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("runuser") is None or shutil.which("useradd") is None,
    reason="needs root, runuser and useradd to act as another local user",
)
def test_another_local_user_cannot_inject_read_or_crash():
    attacker_uid()
    # pytest's own tmp_path sits in a directory only root may enter
    tmp_path = Path(tempfile.mkdtemp(prefix="ddpkit-attack-"))
    tmp_path.chmod(0o755)
    script = tmp_path / "attack.py"
    script.write_text(ATTACK)
    home = tmp_path / "home"
    home.mkdir()
    shutil.chown(home, ATTACKER)
    python, env = attacker_command(str(home))
    segment = Path("/dev/shm/ddpkit-attacker-segment")
    try:
        with WorkerPool(2, timeout=180.0, group_timeout=30.0) as pool:
            outcomes = pool.run(case_attacked_first_collective, str(script), python, env)
        report = outcomes[0][0]
        assert report["segment"] == str(segment)
        assert report["opened"] == [], f"the attacker opened {report['opened']}"
        content = segment.read_bytes()
        assert content[32:] == b"\x55" * (1 << 20), "a rank wrote into the attacker's segment"
        for rank, (_, tensor, moved, transport) in enumerate(outcomes):
            assert transport == "shm"
            assert torch.equal(tensor, torch.full((100_000,), 3.0)), f"rank {rank} returned a wrong sum"
            assert torch.equal(moved, torch.full((300_000,), 2.0)), f"rank {rank} received a wrong broadcast"
    finally:
        segment.unlink(missing_ok=True)
        shutil.rmtree(tmp_path, ignore_errors=True)


def case_corrupt_chunk():
    rank = dist.get_rank()
    first = torch.full((100_000,), -1.0)
    if rank == 0:
        first.fill_(7.0)
    errors = []
    try:
        ddpkit.broadcast(first, src=0, transport="shm")
    except RuntimeError as exc:
        errors.append(str(exc))
    try:
        ddpkit.all_reduce(torch.ones(10), transport="shm")
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors, bool((first == -1.0).all() or (first == 7.0).all())


def test_a_corrupt_chunk_raises_on_every_rank_and_writes_nothing():
    """Rank 0's first message chunk claims to lie at offset 2^46 (as a forged segment could make
    it): the receiver raises naming rank 0 without writing, and every rank raises at its next
    collective instead of going on over a transport whose state is unknown."""
    outcomes = run_and_kill(fresh_pool(3, DDPKIT_TEST_FAULT="corrupt_chunk:0"), case_corrupt_chunk)
    corrupt = "rank 0's channel holds inconsistent data (a chunk of 400000 bytes at offset 70368744177664"
    assert any(corrupt in error for errors, _ in outcomes for error in errors), outcomes
    for rank, (errors, untouched) in enumerate(outcomes):
        assert errors, f"rank {rank} never raised"
        assert "failed" in errors[-1], f"rank {rank}: {errors[-1]}"
        assert untouched, f"rank {rank}'s tensor holds bytes from outside the message"


# --- set-up ------------------------------------------------------------------------------------------


def case_two_fresh_groups_two_threads(repetitions):
    """Each repetition: two fresh groups, first used from two threads, rank 0 starting on the first
    group and rank 1 on the second (DDP's bucket thread and SyncBatchNorm can do this)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = []
    for _ in range(repetitions):
        groups = [dist.new_group(list(range(world_size))) for _ in range(2)]
        out, errors = [None, None], []

        def use(index, delay):
            try:
                time.sleep(delay)
                tensor = torch.full((50_000,), float(rank + 1 + index))
                ddpkit.all_reduce(tensor, group=groups[index])
                out[index] = tensor[0].item()
            except Exception as exc:  # reported to the parent below
                errors.append(repr(exc))

        first = 0 if rank == 0 else 1
        threads = [
            threading.Thread(target=use, args=(first, 0.0)),
            threading.Thread(target=use, args=(1 - first, 0.05)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=4 * GROUP_TIMEOUT_S)
        assert not any(thread.is_alive() for thread in threads), "a set-up deadlocked"
        results.append((out, errors))
        for group in groups:
            dist.destroy_process_group(group)
    return results


def test_two_fresh_groups_from_two_threads_in_opposite_orders():
    with fresh_pool(2) as pool:
        outcomes = pool.run(case_two_fresh_groups_two_threads, 6)
    for per_rank in outcomes:
        for out, errors in per_rank:
            assert errors == []
            assert out == [3.0, 5.0]


def case_setup(transport):
    tensor = torch.full((1000,), float(dist.get_rank() + 1))
    ddpkit.all_reduce(tensor, transport=transport)
    return tensor[0].item()


@pytest.mark.parametrize(
    "fault, victim", [("die_at_hello", 1), ("die_at_offer", 0), ("die_at_map", 2), ("die_at_verdict", 0)]
)
def test_a_rank_dying_during_setup_is_named_and_leaves_nothing(fault, victim):
    pool = fresh_pool(3, DDPKIT_TEST_FAULT=f"{fault}:{victim}")
    outcomes = run_and_kill(pool, case_setup, "auto")
    assert isinstance(outcomes[victim], WorkerFailure) and "exit code -9" in str(outcomes[victim])
    for rank, outcome in enumerate(outcomes):
        if rank == victim:
            continue
        assert isinstance(outcome, RuntimeError), f"rank {rank}: {outcome!r}"
        assert f"rank {victim}" in str(outcome) and "set-up" in str(outcome), f"rank {rank}: {outcome}"


@pytest.mark.parametrize("setting", ["DDPKIT_SHM_SLOT_BYTES=2147483648", "DDPKIT_SHM_CHUNK_BYTES=1000"])
def test_shared_memory_settings_that_give_no_layout_fail_the_set_up_on_every_rank(setting):
    # Only the host's leader (rank 0) reads them: it once raised alone, and the others waited for its
    # offer until the group's timeout.
    name, value = setting.split("=")
    outcomes = run_and_kill(fresh_pool(3, **{name: value}), case_setup, "auto")
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RuntimeError), f"rank {rank}: {outcome!r}"
        assert "give no valid layout" in str(outcome), f"rank {rank}: {outcome}"


def case_setup_leaves_one_anonymous_mapping():
    group = dist.new_group(list(range(dist.get_world_size())))
    before = memfd_state()
    ddpkit.all_reduce(torch.ones(10), group=group)
    during = memfd_state()
    dist.destroy_process_group(group)
    del group
    ddpkit.all_reduce(torch.ones(10), group=dist.new_group(list(range(dist.get_world_size()))))  # frees the old engine
    return before, during, memfd_state()


def test_the_segment_is_an_anonymous_mapping_freed_with_its_group():
    """One anonymous mapping per group (a memfd, so no name in /dev/shm), no descriptor kept open, and
    a destroyed group's mapping released."""
    with fresh_pool(3) as pool:
        for (maps_before, fds_before), (maps_during, fds_during), (maps_after, fds_after) in pool.run(
            case_setup_leaves_one_anonymous_mapping
        ):
            assert fds_before == fds_during == fds_after == 0
            assert maps_during == maps_before + 1 and maps_after == maps_before + 1


# --- one rank rejects, every rank raises, the next call pairs ----------------------------------------


def case_one_rank_rejects(kinds):
    return call_each_then_all_reduce({**ONE_RANK_REJECTS, **BACKEND_ONE_RANK_REJECTS}, kinds)


@pytest.mark.parametrize("transport", ["shm", "process_group"])
def test_one_rank_rejecting_its_arguments_raises_everywhere_and_the_next_call_pairs(transport):
    with fresh_pool(2, DDPKIT_TRANSPORT=transport) as pool:
        outcomes = pool.run(case_one_rank_rejects, sorted(ONE_RANK_REJECTS))
    for rank, out in enumerate(outcomes):
        for kind, (error, after) in out.items():
            assert error is not None, f"rank {rank} did not raise for {kind}"
            if rank == 0:
                assert (
                    "rank 1 passed tensor on the meta device" in error
                    if kind == "meta"
                    else "rank 1 rejected its arguments" in error
                ), f"{kind}: {error}"
            assert after == 11.0, f"rank {rank}, {kind}: the next all-reduce paired wrongly ({after})"


def test_backend_argument_checks_raise_everywhere_and_the_next_call_pairs():
    with WorkerPool(2, backend="ddpkit", timeout=120.0, group_timeout=GROUP_TIMEOUT_S) as pool:
        outcomes = pool.run(case_one_rank_rejects, sorted(BACKEND_ONE_RANK_REJECTS))
    for rank, out in enumerate(outcomes):
        for kind, (error, after) in out.items():
            assert error is not None, f"rank {rank} did not raise for {kind}"
            if rank == 0:
                assert "rank 1 rejected its arguments" in error, f"{kind}: {error}"
            assert after == 11.0, f"rank {rank}, {kind}: the next all-reduce paired wrongly ({after})"


def case_unchecked_rejection():
    rank = dist.get_rank()
    ddpkit.all_reduce(torch.ones(4), transport="shm")  # set up with checks on
    ddpkit.set_collective_checks(False)
    errors, results = [], []
    for call in range(2):
        tensor = torch.full((8,), 10.0**rank)
        try:
            ddpkit.all_reduce(tensor, op="prod" if rank == 1 and call == 0 else "sum", transport="shm")
            results.append(tensor[0].item())
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors, results


def test_with_checks_off_a_rejection_stops_the_group_instead_of_pairing_wrongly():
    outcomes = run_and_kill(fresh_pool(2), case_unchecked_rejection)
    for rank, (errors, results) in enumerate(outcomes):
        assert results == [], f"rank {rank} returned {results} from calls that could not pair"
        assert len(errors) == 2, errors


def case_skipped_collective():
    rank = dist.get_rank()
    try:
        if rank == 0:
            ddpkit.all_reduce(torch.ones(100))  # rank 1 skips this one
        ddpkit.all_reduce(torch.ones(200))
    except RuntimeError as exc:
        return str(exc)
    return None


def test_a_skipped_collective_of_another_shape_raises_on_every_rank(pool):
    for error in pool(2).run(case_skipped_collective):
        assert error is not None and "rank 1 passed elements 200, rank 0 passed elements 100" in error, error


# --- lifecycles --------------------------------------------------------------------------------------


def process_counts() -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {
        "threads": int(status["Threads"]),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
    }


def case_group_cycles(cycles, backend):
    samples = {}
    for cycle in range(cycles):
        group = dist.new_group(backend=backend)
        tensor = torch.ones(100_000)
        ddpkit.all_reduce(tensor, group=group)
        if backend == "ddpkit":
            dist.all_reduce(tensor, group=group)
        dist.destroy_process_group(group)
        del group
        if cycle in (cycles // 10, cycles - 1):
            samples[cycle] = process_counts()
    return samples


# Hundreds of cycles of a "ddpkit" group (its engine, segment and threads), and of ddpkit's collectives
# on a gloo group, which keep only per-group state on ddpkit's side: a leak of a thread, a descriptor or
# a segment per group shows within them.
@pytest.mark.parametrize("backend,cycles", [("gloo", 300), ("ddpkit", 400)])
def test_group_cycles_hold_threads_fds_and_memory_flat(backend, cycles):
    with fresh_pool(2) as pool:
        outcomes = pool.run(case_group_cycles, cycles, backend, timeout=600)
    for samples in outcomes:
        early, late = samples[cycles // 10], samples[cycles - 1]
        assert late["threads"] <= early["threads"], samples
        assert late["fds"] <= early["fds"], samples
        assert late["rss_mb"] - early["rss_mb"] < 64, samples


# --- errors that name the culprit --------------------------------------------------------------------

# The group's timeout where a test waits it out: short, since every rank is set up before the wait.
STAY_AWAY_TIMEOUT_S = 5.0


def case_one_rank_stays_away(how, transport):
    rank = dist.get_rank()
    ddpkit.all_reduce(torch.ones(4), transport=transport)  # set up while everyone is here
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if rank == 2:
        if how == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 resumes it once it has raised
        # "late": it returns at once and never comes, alive and idle in its pool (as absent as asleep in the
        # task, without the test waiting on it)
        return None
    try:
        ddpkit.all_reduce(torch.ones(1000), transport=transport)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    if rank == 0 and how == "stopped":
        os.kill(pids[2], signal.SIGCONT)
    return error


@pytest.mark.parametrize("how", ["stopped", "late"])
@pytest.mark.parametrize("transport", ["shm", "process_group"])
def test_a_timeout_names_the_rank_that_never_arrived(how, transport):
    pool = WorkerPool(3, timeout=120.0, group_timeout=STAY_AWAY_TIMEOUT_S)
    outcomes = run_and_kill(pool, case_one_rank_stays_away, how, transport)
    for rank in (0, 1):
        error = outcomes[rank]
        assert isinstance(error, str), f"rank {rank}: {error!r}"
        if transport == "shm" or rank == 0:
            assert "waiting for rank 2 (pid" in error or "receiving from rank 2 failed" in error, (
                f"rank {rank}: {error}"
            )
            if transport == "shm" and how == "stopped":
                assert "stopped)" in error, error
        else:
            # gloo closes every connection once a wait times out, so rank 0 cannot tell rank 1 whom it
            # waited for; rank 1's error says where that is named.
            assert "rank 0 gathers every rank's header" in error, f"rank {rank}: {error}"


def case_blame_after_a_survivor_exits():
    """Rank 2 dies; rank 1 raises and exits at once; rank 3 arrives late, when rank 1 is gone too."""
    rank = dist.get_rank()
    for iteration in range(40):
        if iteration == 20:
            if rank == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 3:
                time.sleep(1.0)
        try:
            ddpkit.all_reduce(torch.ones(10_000), transport="shm")
        except RuntimeError as exc:
            if rank == 1:
                os._exit(3)
            return str(exc)
    return None


def test_the_rank_named_dead_is_the_one_that_died():
    outcomes = run_and_kill(fresh_pool(4), case_blame_after_a_survivor_exits)
    for rank in (0, 3):
        assert isinstance(outcomes[rank], str), f"rank {rank}: {outcomes[rank]!r}"
        assert "rank 2 (pid" in outcomes[rank] and "died" in outcomes[rank], f"rank {rank}: {outcomes[rank]}"


def case_non_member():
    group = dist.new_group([0])
    if dist.get_rank() == 0:
        return ddpkit.all_reduce(torch.ones(3), group=group)[0].item()
    try:
        ddpkit.all_reduce(torch.ones(3), group=group)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_non_member_of_a_subgroup_gets_a_clear_error(pool):
    member, outsider = pool(2).run(case_non_member)
    assert member == 1.0
    assert "this rank is not a member of the group" in outsider


# --- reduction semantics -----------------------------------------------------------------------------

NAN = float("nan")


def expected_special(n, op, dtype):
    """Note [Reductions]: NaN anywhere gives the canonical NaN (max/min); max(+0, -0) = +0, min = -0."""
    per_rank = torch.stack([_special_values_for(r, n, dtype) for r in range(n)])
    if op == "sum":
        return None  # only identical bits across ranks are promised for NaN payloads
    reduced = per_rank.amax(0) if op == "max" else per_rank.amin(0)
    nan = per_rank.isnan().any(0)
    reduced[nan] = NAN
    zeros = (per_rank == 0).all(0)
    if op == "max":
        reduced[zeros & (~torch.signbit(per_rank)).any(0)] = 0.0
        reduced[zeros & torch.signbit(per_rank).all(0)] = -0.0
    else:
        reduced[zeros & torch.signbit(per_rank).any(0)] = -0.0
        reduced[zeros & (~torch.signbit(per_rank)).all(0)] = 0.0
    return reduced


def _special_values_for(rank, n, dtype):
    """Rank `rank`'s values: a NaN held by one rank (each rank in turn), signed zeros in every mix,
    ordinary values, and a NaN whose payload differs on every rank."""
    values = [NAN if rank == holder else float(rank) for holder in range(n)]
    values += [0.0 if rank == 0 else -0.0, -0.0 if rank == 0 else 0.0, -0.0, 0.0, float(rank) - 1.0]
    tensor = torch.tensor(values, dtype=dtype)
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int64
    payload = torch.tensor(
        [0x7FC00001 + rank] if dtype == torch.float32 else [0x7FF8000000000001 + rank], dtype=int_dtype
    ).view(dtype)
    return torch.cat([tensor, payload])


def case_special_values(transport):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in (torch.float32, torch.float64):
        int_dtype = torch.int32 if dtype == torch.float32 else torch.int64
        for algorithm in algorithms_for(transport):
            if algorithm == "process_group":
                continue  # gloo's own max/min (Note [Reductions] says how they differ)
            for op in ("max", "min", "sum"):
                tensor = _special_values_for(rank, n, dtype)
                ddpkit.all_reduce(tensor, op=op, algorithm=algorithm, transport=transport)
                out[("all_reduce", str(dtype), algorithm, op)] = tensor.view(int_dtype)
        for algorithm in ("auto", "ring") + (("halving_doubling",) if n & (n - 1) == 0 else ()):
            for op in ("max", "min"):
                block = _special_values_for(rank, n, dtype).numel()
                stacked = torch.cat([_special_values_for(rank, n, dtype)] * n)
                output = torch.empty(block, dtype=dtype)
                ddpkit.reduce_scatter_tensor(output, stacked, op=op, algorithm=algorithm, transport=transport)
                out[("reduce_scatter", str(dtype), algorithm, op)] = output.view(int_dtype)
    return out


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("transport", ["shm", "process_group"])
def test_nan_and_signed_zeros_reduce_alike_on_every_algorithm(pool, world_size, transport):
    per_rank = pool(world_size).run(case_special_values, transport)
    for key, bits in per_rank[0].items():
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank][key], bits), f"{key}: rank {rank}'s bits differ from rank 0's"
        kind, dtype_name, algorithm, op = key
        dtype = torch.float32 if dtype_name == str(torch.float32) else torch.float64
        expected = expected_special(world_size, op, dtype)
        if expected is None:
            assert bits.view(dtype)[:world_size].isnan().all(), key
            continue
        int_dtype = torch.int32 if dtype == torch.float32 else torch.int64
        canonical = torch.tensor([NAN], dtype=dtype).view(int_dtype)
        expected_bits = expected.view(int_dtype).clone()
        expected_bits[expected.isnan()] = canonical
        assert torch.equal(bits, expected_bits), f"{key}: {bits.view(dtype)} vs {expected}"


# --- the group's timeout from its first collective ----------------------------------------------------


def case_first_collective_alone(backend):
    group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() == 1:
        return None  # never enters the barrier: idle in its pool, as absent as asleep in the task
    try:
        if backend == "ddpkit":
            dist.barrier(group=group)
        else:
            ddpkit.barrier(group=group)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("backend", ["gloo", "ddpkit"])
def test_the_first_collective_of_a_group_waits_the_group_timeout_and_names_what_it_waited_for(backend):
    """The shared-memory set-up of a group's first collective runs over the group's own messages, so
    the group's 2-second timeout bounds it (not the store's, longer one), and its error
    names the collective, the group and the rank that never came."""
    outcomes = run_and_kill(fresh_pool(2), case_first_collective_alone, backend)
    error = outcomes[0]
    assert isinstance(error, str), error
    assert "barrier's shared-memory set-up (rank 0 of 2 in group '" in error, error
    assert "receiving from rank 1 failed" in error and "Timed out waiting 2000ms" in error, error
