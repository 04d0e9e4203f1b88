"""A real SLURM cluster for the tests, from Debian's packages, started in a private directory: one node, or several
nodes on this one machine.

``munged`` (a fresh key, its own socket), ``slurmctld`` and ``slurmd`` (``auth/munge``, ``proctrack/linuxproc``,
``task/none``, free ports) run as root under a temporary directory and are stopped afterwards; clients reach them
through ``SLURM_CONF``. One node is this machine (its CPUs, its host name). ``SlurmCluster(root, nodes=2)`` gives two
nodes ``n1`` and ``n2``: one ``slurmd -N n1`` and one ``slurmd -N n2`` from the same ``slurm.conf``, each node with its
own ``Port=`` and ``NodeAddr=127.0.0.1`` (Debian's slurm-wlm 22.05 accepts this), so ``srun -N2`` and a two-node job's
ranks really run under two slurmd daemons; the names resolve through ``/etc/hosts``, to which a line
``127.0.0.1 n1 n2`` is added once (the only file outside the directory touched; a system SLURM on the same machine is
not disturbed). Needs root (``slurmd`` starts jobs as their user, and ``/etc/hosts``) and the packages
``slurmctld slurmd slurm-client munge``; ``.ci/run`` installs them where they are absent.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
PACKAGES = "slurmctld slurmd slurm-client munge"


def missing() -> str | None:
    """Why a cluster cannot start here (``None`` when it can)."""
    if os.geteuid() != 0:
        return "the SLURM tests need root (slurmd starts jobs as their user)"
    absent = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing): apt-get install {PACKAGES}"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HOSTS = Path("/etc/hosts")


def resolve_names_locally(names: list[str]) -> None:
    """Make each of ``names`` resolve to 127.0.0.1 through ``/etc/hosts`` (a line is appended for those that do not;
    idempotent)."""
    absent = []
    for name in names:
        try:
            if socket.gethostbyname(name) == "127.0.0.1":
                continue
        except OSError:
            pass
        absent.append(name)
    if absent:
        with HOSTS.open("a") as hosts:
            hosts.write(f"127.0.0.1 {' '.join(absent)}  # lnstab tests: SLURM nodes on this machine\n")


class SlurmCluster:
    """``slurmctld`` + one ``slurmd`` per node + ``munged`` under ``root``; :attr:`env` is what a client needs.

    Args:
        root: The private directory (state, spool, logs, key, socket, ``slurm.conf``).
        nodes: 1: one node, this machine under its host name; more: nodes ``n1`` … ``nN`` on this machine, one
            ``slurmd -N nI`` each, on their own ports at 127.0.0.1.
    """

    def __init__(self, root: Path, nodes: int = 1) -> None:
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.nodes = [self.node] if nodes == 1 else [f"n{i}" for i in range(1, nodes + 1)]
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def multi(self) -> bool:
        return len(self.nodes) > 1

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        if self.multi:
            resolve_names_locally(self.nodes)
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge.sock"
        subprocess.run([_binary("munged"), "--force", f"--key-file={key}", f"--socket={sock}",
                        f"--pid-file={r / 'munged.pid'}", f"--log-file={r / 'munged.log'}",
                        f"--seed-file={r / 'munged.seed'}"], check=True, capture_output=True)
        memory = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemTotal")) ) // 1024 * 8 // 10 // len(self.nodes)  # MB, rest to the OS
        if self.multi:  # %n: each slurmd its own spool, pid and log file
            nodes = [f"NodeName={n} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={os.cpu_count()} "
                     f"RealMemory={memory} State=UNKNOWN" for n in self.nodes]
            per_node = [f"SlurmdSpoolDir={r / 'spool' / '%n'}", f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
                        f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}"]
        else:
            nodes = [f"NodeName={self.node} CPUs={os.cpu_count()} RealMemory={memory} State=UNKNOWN"]
            per_node = [f"SlurmdSpoolDir={r / 'spool'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
                        f"SlurmdLogFile={r / 'log' / 'slurmd.log'}", f"SlurmdPort={_free_port()}"]
        self.conf.write_text("\n".join([
            "ClusterName=lnstabtest", f"SlurmctldHost={self.node}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={sock}", "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "SchedulerType=sched/backfill", "MpiDefault=none", "JobRequeue=1",
            "ReturnToService=2", "KillWait=30", "MinJobAge=600", "InactiveLimit=0",
            f"StateSaveLocation={r / 'state'}", f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmctldPort={_free_port()}", *per_node, *nodes,
            f"PartitionName=cpu Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP", ""]))
        subprocess.run([_binary("slurmctld"), "-f", str(self.conf)], env=self.env, check=True, capture_output=True)
        for node in self.nodes:
            subprocess.run([_binary("slurmd"), "-f", str(self.conf), *(["-N", node] if self.multi else [])],
                           env=self.env, check=True, capture_output=True)
        deadline = time.monotonic() + timeout
        while True:
            state = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True)
            states = dict(line.split()[:2] for line in state.stdout.splitlines() if len(line.split()) >= 2)
            if state.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return self
            if time.monotonic() > deadline:
                logs = "".join(p.read_text()[-2000:] for p in sorted((r / "log").glob("*.log")))
                self.stop()
                raise RuntimeError(f"the SLURM nodes never became idle ({state.stdout!r} {state.stderr!r}):\n{logs}")
            time.sleep(0.3)

    def run(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster (``check=True``)."""
        return subprocess.run(list(args), env=kwargs.pop("env", self.env), check=True, capture_output=True,
                              text=True, **kwargs)

    def jobs(self) -> list[tuple[str, str]]:
        """``[(job id, state), …]`` of the jobs squeue shows (array elements one by one)."""
        out = self.run("squeue", "-h", "-r", "-o", "%i %T").stdout
        return [tuple(line.split()[:2]) for line in out.splitlines() if line.strip()]

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True)
        slurmds = [f"slurmd-{n}" for n in self.nodes] if self.multi else ["slurmd"]
        for name in (*slurmds, "slurmctld", "munged"):
            pid_file = self.root / f"{name}.pid"
            if not pid_file.exists():
                continue
            try:
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    os.kill(pid, 0)
                    time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, ValueError, IndexError):
                pass
