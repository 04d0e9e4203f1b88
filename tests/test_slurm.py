"""The SLURM job array that ``lnstab sweep --slurm`` prints, on a real SLURM (tests/slurm_cluster.py): an array runs
its runs to the right statuses; a run pre-empted by SIGUSR1 to every process of the job (DataLoader workers
included), or signalled before its time limit, is requeued by Lightning and resumes to the end, bitwise equal to an
uninterrupted run; a cancelled element is resumed by resubmitting the same script. On a two-node cluster (two
``slurmd`` on this machine), a ``--nodes 2`` job runs one rank per node, is pre-empted, requeued and resumed on both,
and ends with the weights of a one-node run of the same global batch.

A requeued job is held by SLURM for two minutes (its EligibleTime); the tests release it at once with ``scontrol
update StartTime=now``, as an administrator can.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from paced_runs import PACE_CALLBACK, pace_env, set_pace
from slurm_cluster import SlurmCluster, missing

from lnstab.rundir import read_summary

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.slow, pytest.mark.system]

def started(tmp_path_factory, nodes: int):
    why = missing()
    if why:
        if os.environ.get("LNSTAB_REQUIRE_SLURM"):
            pytest.fail(f"LNSTAB_REQUIRE_SLURM is set but {why}")
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp(f"slurm{nodes}"), nodes=nodes).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from started(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Nodes n1 and n2, one ``slurmd`` each, on this machine."""
    yield from started(tmp_path_factory, 2)


def job_env(cluster: SlurmCluster, tmp: Path, pace: float = 0.0) -> dict[str, str]:
    """What the jobs inherit from sbatch (--export=ALL): this venv first, offline, one thread (bitwise comparable
    with the reference runs), the Pace callback (tests/paced_runs.py) importable and paced."""
    return {**cluster.env, "PATH": f"{BIN}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **pace_env(tmp, pace)}


def paced_grid(tmp: Path, cases: dict[str, dict], **slurm) -> Path:
    """A grid over a 2-layer run of 300 steps on the synthetic stream, 2 loader workers, last.ckpt every 10 steps."""
    base = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 300, "precision": "32-true",
                    "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 1,
                    "val_check_interval": 100, "log_every_n_steps": 10, "callbacks": [PACE_CALLBACK]},
        "checkpoint": {"save_last": True, "every_n_train_steps": 10, "save_top_k": 0},
        "instruments": {"every_n_steps": 50, "jacobian_every_n_steps": 0},
        "evaluation": {"on_fit_end": False},
        "model": {"preset": "tiny", "vocab_size": 64, "block_size": 16, "warmup_steps": 1, "lr_decay_steps": 300,
                  "learning_rate": 3e-3, "min_lr": 3e-4},
        "data": {"class_path": "lnstab.datamodules.OpenWebTextDataModule",
                 "init_args": {"source": "synthetic", "batch_size": 4, "num_workers": 2, "val_tokens": 256,
                               "synthetic_tokens": 20_000, "synthetic_vocab_size": 64}},
    }
    (tmp / "base.yaml").write_text(yaml.safe_dump(base))
    grid = {"base": "base.yaml", "name": "g", "axes": {"case": {"values": cases}}, "slurm": slurm}
    path = tmp / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    return path


def array_script(grid: Path, root: Path, env: dict[str, str], time_limit: str = "10:00") -> str:
    done = subprocess.run([str(BIN / "lnstab"), "sweep", str(grid), "--slurm", "--gpus-per-node", "0",
                           "--cpus-per-task", "1", "--time", time_limit, "--root", str(root)],
                          env=env, cwd=root.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def submit(cluster: SlurmCluster, script: str, env: dict[str, str], cwd: Path) -> str:
    return cluster.run("sbatch", "--parsable", input=script, env=env, cwd=cwd).stdout.strip().split(";")[0]


def wait_for(what: str, check, timeout: float = 300.0, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def gone(cluster: SlurmCluster, job: str, element: int | None = None) -> bool:
    prefix = f"{job}_{element}" if element is not None else f"{job}_"
    return not [j for j, _ in cluster.jobs() if j == prefix or j.startswith(prefix) or j == job]


def element_of(script: str, run: str) -> int:
    """The array index of ``run`` in an array script (``  3) RUN=name``)."""
    return next(int(line.split(")")[0]) for line in script.splitlines() if line.strip().endswith(f") RUN={run}"))


def log_of(root: Path, job: str, element: int) -> str:
    path = root / "g" / ".sweep" / "slurm" / f"{job}_{element}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def processes_of(run: Path) -> list[int]:
    """Pids whose command line names ``run`` (a training process and its forked DataLoader workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(run).encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def requeued_and_released(cluster: SlurmCluster, element: str, pace_file: Path, **update: str) -> None:
    """Wait until SLURM has requeued ``element`` (pending after a restart), then let it start now, at full speed."""

    def pending_again() -> bool:
        info = cluster.run("scontrol", "show", "job", element).stdout
        return "JobState=PENDING" in info and "Restarts=0" not in info

    wait_for(f"{element} to be requeued", pending_again, timeout=120)
    set_pace(pace_file.parent, 0)
    cluster.run("scontrol", "update", f"JobId={element}", "StartTime=now", *(f"{k}={v}" for k, v in update.items()))


def assert_bitwise_equal_to_an_uninterrupted_run(tmp: Path, run: Path, env: dict[str, str], *args: str) -> None:
    ref = tmp / "reference"
    done = subprocess.run([str(BIN / "lnstab"), "fit", "--config", str(tmp / "base.yaml"), "--run_dir", str(ref),
                           *args], env={**env, "LNSTAB_TEST_PACE_FILE": ""}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    a = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(ref / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 300
    for key, value in b["state_dict"].items():
        torch.testing.assert_close(a["state_dict"][key], value, rtol=0, atol=0, msg=key)


def test_a_cpu_array_runs_each_run_to_its_status(cluster, tmp_path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    env = job_env(cluster, tmp_path)
    grid = ROOT / "experiments" / "grids" / "mini-smoke.yaml"
    done = subprocess.run([str(BIN / "lnstab"), "sweep", str(grid), "--slurm", "--gpus-per-node", "0",
                           "--cpus-per-task", "1", "--time", "10:00", "--root", str(root)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    script = done.stdout
    assert "#SBATCH --ntasks-per-node=1\n" in script and "--gpus-per-node" not in script  # a CPU job
    assert script.count("--trainer.accelerator cpu --trainer.num_nodes 1 --trainer.devices 1") == 3
    job = submit(cluster, script, env, tmp_path)
    wait_for(f"array {job} to end", lambda: gone(cluster, job), timeout=600)
    runs = root / "mini-smoke"
    statuses = {name: read_summary(runs / name).get("status") for name in ("none_lr10", "pre", "peri")}
    assert statuses == {"none_lr10": "diverged", "pre": "completed", "peri": "completed"}, [
        (runs / ".sweep" / "slurm" / f"{job}_{i}.out").read_text()[-2000:] for i in range(3)]
    assert read_summary(runs / "pre")["final_step"] == 16


def test_sigusr1_to_every_process_of_the_job_requeues_and_resumes_bitwise(cluster, tmp_path) -> None:
    """Before: the DataLoader workers ran Lightning's inherited SLURM handler and died, the run ended ``failed`` at
    its step, and the requeued element printed 'finished already' for ever."""
    env = job_env(cluster, tmp_path, pace=0.1)
    grid = paced_grid(tmp_path, {"peri": {"model.norm_placement": "peri"}})
    root = tmp_path / "runs"
    run = root / "g" / "peri"
    job = submit(cluster, array_script(grid, root, env), env, tmp_path)
    wait_for("a checkpoint", lambda: (run / "checkpoints" / "last.ckpt").exists(), timeout=300)
    assert len(wait_for("the loader workers", lambda: len(processes_of(run)) >= 3 and processes_of(run))) >= 3
    cluster.run("scancel", "--signal=USR1", "--full", job)  # batch shell, srun, the run and its workers
    requeued_and_released(cluster, f"{job}_0", tmp_path / "pace")
    wait_for(f"{job} to end", lambda: gone(cluster, job), timeout=600)
    log = log_of(root, job, 0)
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["final_step"] == 300, log[-3000:]
    assert "received SIGUSR1" in log and "Requeued SLURM job" in log and "Restored all states" in log
    assert "exited unexpectedly" not in log and "Traceback" not in log, log[-3000:]
    assert_bitwise_equal_to_an_uninterrupted_run(tmp_path, run, env, "--model.norm_placement", "peri")


def test_the_time_limit_signal_requeues_and_resumes_bitwise(cluster, tmp_path) -> None:
    """``--signal=SIGUSR1@55``: SLURM signals the step (the run and its workers) when under 55 s remain."""
    env = job_env(cluster, tmp_path, pace=0.2)
    grid = paced_grid(tmp_path, {"pre": {"model.norm_placement": "pre"}}, signal_s=55)
    root = tmp_path / "runs"
    run = root / "g" / "pre"
    script = array_script(grid, root, env)
    assert "#SBATCH --signal=SIGUSR1@55\n" in script
    job = submit(cluster, script, env, tmp_path)
    wait_for("a checkpoint", lambda: (run / "checkpoints" / "last.ckpt").exists(), timeout=300)
    # the limit comes close: under 55 s left, so slurmctld signals at its next time check (every 30 s)
    cluster.run("scontrol", "update", f"JobId={job}_0", "TimeLimit=1")
    requeued_and_released(cluster, f"{job}_0", tmp_path / "pace", TimeLimit="10")
    wait_for(f"{job} to end", lambda: gone(cluster, job), timeout=600)
    log = log_of(root, job, 0)
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["final_step"] == 300, log[-3000:]
    assert "received SIGUSR1" in log and "Requeued SLURM job" in log and "Traceback" not in log, log[-3000:]
    assert_bitwise_equal_to_an_uninterrupted_run(tmp_path, run, env, "--model.norm_placement", "pre")


def test_a_cancelled_element_is_resumed_by_resubmitting_the_same_script(cluster, tmp_path) -> None:
    env = job_env(cluster, tmp_path, pace=0.1)
    grid = paced_grid(tmp_path, {"quick": {"trainer.max_steps": 20}, "long": {"model.norm_placement": "peri"}})
    root = tmp_path / "runs"
    long_run = root / "g" / "long"
    script = array_script(grid, root, env)
    quick, long = element_of(script, "quick"), element_of(script, "long")
    job = submit(cluster, script, env, tmp_path)
    wait_for("the quick element", lambda: read_summary(root / "g" / "quick").get("status") == "completed"
             if (root / "g" / "quick" / "summary.json").exists() else False, timeout=300)
    wait_for("a checkpoint", lambda: (long_run / "checkpoints" / "last.ckpt").exists(), timeout=300)
    cluster.run("scancel", f"{job}_{long}")  # SIGTERM to its steps; the element ends CANCELLED (not requeued)
    wait_for(f"{job} to end", lambda: gone(cluster, job), timeout=300)
    summary = read_summary(long_run)
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM", log_of(root, job, long)[-3000:]
    step = summary["interrupted_step"]
    assert torch.load(long_run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == step
    set_pace(tmp_path, 0)
    again = submit(cluster, script, env, tmp_path)
    wait_for(f"{again} to end", lambda: gone(cluster, again), timeout=600)
    assert "quick: finished already, nothing to do" in log_of(root, again, quick)
    assert read_summary(long_run)["status"] == "completed", log_of(root, again, long)[-3000:]
    assert "Restored all states" in log_of(root, again, long)
    assert_bitwise_equal_to_an_uninterrupted_run(tmp_path, long_run, env, "--model.norm_placement", "peri")


def ranks_of(run: Path) -> set[tuple[str, str, str]]:
    """``{(node, rank, restart), …}`` of the running ``lnstab fit`` ranks of ``run`` (from their environment)."""
    found = set()
    for pid in processes_of(run):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        except OSError:
            continue
        if b"python" in args[0] and b"fit" in args and "SLURM_PROCID" in env:
            found.add((env.get("SLURMD_NODENAME", "?"), env["SLURM_PROCID"], env.get("SLURM_RESTART_COUNT", "0")))
    return found


def test_a_two_node_job_is_preempted_resumed_on_both_nodes_and_equals_one_node_of_the_same_global_batch(
        two_nodes, tmp_path) -> None:
    """``lnstab sweep --slurm --nodes 2 --gpus-per-node 0``: rank 0 on n1 and rank 1 on n2 (gloo over TCP), SIGUSR1
    to the whole job after a checkpoint, requeued by Lightning, resumed on both nodes to the end, and then equal bit
    for bit to two uninterrupted ranks on one node (the same global batch).

    Against one process training on the doubled batch (the same windows: with one reader per rank, rank r's batch k
    is windows 2kb+r, 2kb+2+r, … of the pass's permutation, the one-process batch k windows 2kb … 2kb+2b-1) the
    weights differ by rounding only, which Adam amplifies where a gradient is near zero: 2.8e-4 at most after these
    50 steps, measured once (docs/sweeps.md); a test tolerance for that would be a guess, so it is not asserted."""
    env = job_env(two_nodes, tmp_path, pace=0.3)
    steps = 50
    grid = paced_grid(tmp_path, {"ddp": {"model.norm_placement": "pre"}})
    base = yaml.safe_load((tmp_path / "base.yaml").read_text())
    base["trainer"]["max_steps"] = base["model"]["lr_decay_steps"] = steps
    base["trainer"]["val_check_interval"] = 25
    base["data"]["init_args"].update(batch_size=2, num_workers=0)  # per rank
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    root = tmp_path / "runs"
    run = root / "g" / "ddp"
    done = subprocess.run([str(BIN / "lnstab"), "sweep", str(grid), "--slurm", "--nodes", "2", "--gpus-per-node", "0",
                           "--cpus-per-task", "1", "--time", "10:00", "--root", str(root)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    script = done.stdout
    assert "#SBATCH --nodes=2\n" in script and "--trainer.num_nodes 2 --trainer.devices 1" in script
    job = submit(two_nodes, script, env, tmp_path)
    before = wait_for("a rank on each node", lambda: r if len(r := ranks_of(run)) == 2 else None, timeout=300)
    assert before == {("n1", "0", "0"), ("n2", "1", "0")}
    wait_for("a checkpoint", lambda: (run / "checkpoints" / "last.ckpt").exists(), timeout=300)
    two_nodes.run("scancel", "--signal=USR1", "--full", job)  # the batch shell, srun and both ranks
    requeued_and_released(two_nodes, f"{job}_0", tmp_path / "pace")
    after: set[tuple[str, str, str]] = set()  # the requeued job's ranks, as each is seen

    def resumed_ranks_seen() -> bool:
        after.update(r for r in ranks_of(run) if r[2] == "1")
        return len(after) == 2 or gone(two_nodes, job)

    wait_for("the resumed ranks", resumed_ranks_seen, timeout=300)
    wait_for(f"{job} to end", lambda: gone(two_nodes, job), timeout=300)
    log = log_of(root, job, 0)
    assert after == {("n1", "0", "1"), ("n2", "1", "1")}, log[-3000:]  # not gone before it was seen
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["final_step"] == steps, log[-3000:]
    assert "received SIGUSR1" in log and "Requeued SLURM job" in log and "Restored all states" in log, log[-3000:]
    assert log.count("Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2") == 2, log[-3000:]
    assert "Traceback" not in log and "terminate called" not in log, log[-3000:]

    # The same global batch on one node: two processes (Lightning's subprocess launcher, gloo over loopback), not
    # pre-empted. Equal bit for bit: the ranks read the same windows and start from the same weights, and an
    # all-reduce of two ranks adds two numbers, which floating point does exactly alike in either order, then halves
    # the sum exactly; what is left to differ is the node boundary and the pre-emption, which must change nothing.
    one = tmp_path / "one_node"
    done = subprocess.run([str(BIN / "lnstab"), "fit", "--config", str(tmp_path / "base.yaml"), "--run_dir", str(one),
                           "--model.norm_placement", "pre", "--trainer.devices", "2", "--trainer.strategy", "ddp"],
                          env={**env, "LNSTAB_TEST_PACE_FILE": ""}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(one / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == steps
    for key, value in b["state_dict"].items():
        torch.testing.assert_close(a["state_dict"][key], value, rtol=0, atol=0, msg=key)
    for key, value in b["optimizer_states"][0]["state"].items():
        torch.testing.assert_close(a["optimizer_states"][0]["state"][key], value, rtol=0, atol=0, msg=str(key))
