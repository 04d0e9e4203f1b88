"""A real single-node SLURM cluster for the tests, from Debian's packages, started in a private directory.

``munged`` (a fresh key, its own socket), ``slurmctld`` and ``slurmd`` (``auth/munge``, ``proctrack/linuxproc``,
``task/none``, one node with this machine's CPUs, free ports) run as root under a temporary directory and are stopped
afterwards; clients reach them through ``SLURM_CONF``. Nothing outside that directory is touched, so a system SLURM on
the same machine is not disturbed. Needs root (``slurmd`` starts jobs as their user) and the packages
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

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
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


class SlurmCluster:
    """``slurmctld`` + ``slurmd`` + ``munged`` under ``root``; :attr:`env` is what a client needs."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge.sock"
        subprocess.run([_binary("munged"), "--force", f"--key-file={key}", f"--socket={sock}",
                        f"--pid-file={r / 'munged.pid'}", f"--log-file={r / 'munged.log'}",
                        f"--seed-file={r / 'munged.seed'}"], check=True, capture_output=True)
        memory = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemTotal")) ) // 1024 * 8 // 10  # MB, leaving the rest to the OS
        self.conf.write_text("\n".join([
            "ClusterName=lnstabtest", f"SlurmctldHost={self.node}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={sock}", "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "SchedulerType=sched/backfill", "MpiDefault=none", "JobRequeue=1",
            "ReturnToService=2", "KillWait=30", "MinJobAge=600", "InactiveLimit=0",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            f"NodeName={self.node} CPUs={os.cpu_count()} RealMemory={memory} State=UNKNOWN",
            f"PartitionName=cpu Nodes={self.node} Default=YES MaxTime=INFINITE State=UP", ""]))
        subprocess.run([_binary("slurmctld"), "-f", str(self.conf)], env=self.env, check=True, capture_output=True)
        subprocess.run([_binary("slurmd"), "-f", str(self.conf)], env=self.env, check=True, capture_output=True)
        deadline = time.monotonic() + timeout
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if state.returncode == 0 and state.stdout.strip() == "idle":
                return self
            if time.monotonic() > deadline:
                logs = "".join((r / "log" / n).read_text()[-2000:] for n in ("slurmctld.log", "slurmd.log")
                               if (r / "log" / n).exists())
                self.stop()
                raise RuntimeError(f"the SLURM node never became idle ({state.stdout!r} {state.stderr!r}):\n{logs}")
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
        for name in ("slurmd", "slurmctld", "munged"):
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
