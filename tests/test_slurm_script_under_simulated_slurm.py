"""The sbatch script `accel-fsdp slurm` writes, run by bash under a model of SLURM: what each node's launcher is
given (machine rank, main address, cores), how the job ends (requeued on a preemption), and the message for a
cluster or a submission set up wrong. One process each: `srun`, `scontrol` and `accel-fsdp` itself are stand-ins
that record what they were asked, so no rank starts (the run under SLURM with real ranks is in test_multinode.py).

The srun stand-in behaves as srun(1) says: it starts --ntasks tasks (else the job's SLURM_NTASKS, what `sbatch
--ntasks-per-node` made it), --ntasks-per-node of them per node, with SLURM_NODEID and SLURM_PROCID; since SLURM
22.05 a task gets the job's --cpus-per-task only when srun is given it again; with --kill-on-bad-exit=1 (or the
cluster's KillOnBadExit=1 without the option) a task that exits non-zero has the others killed; srun's status is
the highest of its tasks', a killed task's 128 + signal; without --export, a task gets what SLURM_EXPORT_ENV says
(sbatch sets it from its own --export: NONE gives the tasks SLURM's variables alone)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_in_process

SRUN = r'''#!PYTHON
import json, os, signal, subprocess, sys, time
args, options = sys.argv[1:], {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    options[key] = value
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({"srun": options}) + "\n")
tasks = int(options.get("ntasks") or os.environ.get("SLURM_NTASKS") or os.environ["SLURM_JOB_NUM_NODES"])
per_node = int(options.get("ntasks-per-node") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)
kill = options.get("kill-on-bad-exit", os.environ.get("FAKE_KILL_ON_BAD_EXIT", "0")) == "1"
exported = options.get("export", os.environ.get("SLURM_EXPORT_ENV", "ALL"))
procs = []
for task in range(tasks):
    given = {k: v for k, v in os.environ.items() if exported == "ALL" or k.startswith(("SLURM_", "FAKE_"))}
    env = dict(given, SLURM_PROCID=str(task), SLURM_NODEID=str(task // per_node), SLURM_STEP_ID="0")
    env.setdefault("PATH", "/usr/bin:/bin")
    env.pop("SLURM_CPUS_PER_TASK", None)  # SLURM >= 22.05: not inherited from sbatch
    if "cpus-per-task" in options:
        env["SLURM_CPUS_PER_TASK"] = options["cpus-per-task"]
    procs.append(subprocess.Popen(args, env=env))
codes = {}
while len(codes) < len(procs):
    for task, proc in enumerate(procs):
        if task not in codes and proc.poll() is not None:
            codes[task] = proc.returncode
            if kill and proc.returncode != 0:
                for other in procs:
                    if other.poll() is None:
                        other.send_signal(signal.SIGKILL)
    time.sleep(0.01)
sys.exit(max(128 - c if c < 0 else c for c in codes.values()))
'''

SCONTROL = r'''#!PYTHON
import os, sys
if sys.argv[1:3] == ["show", "hostnames"]:
    names = os.environ["FAKE_HOSTNAMES"]  # or @file, for a list longer than one variable may hold
    print((open(names[1:]).read() if names.startswith("@") else names).replace(",", "\n"))
elif sys.argv[1] == "requeue":
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write('{"requeue": "%s"}\n' % sys.argv[2])
'''

ACCEL_FSDP = r'''#!PYTHON
import json, os, sys, time
node = os.environ.get("SLURM_NODEID", "batch")
keep = ("SLURM_NODEID", "SLURM_PROCID", "SLURM_CPUS_PER_TASK", "MAIN_ADDR", "RUN_DIR")
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({"accel-fsdp": sys.argv[1:], "env": {k: os.environ.get(k) for k in keep}}) + "\n")
if sys.argv[1:3] == ["recipe", "run"]:
    time.sleep(float(os.environ.get("FAKE_RUN_SECONDS_" + node, "0")))
    sys.exit(int(os.environ.get("FAKE_RUN_STATUS", "0")))
'''


def write_script(tmp_path: Path, *args: str, name: str = "job.sbatch") -> Path:
    script = tmp_path / name
    run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "4", "--cpus-per-node", "16",
                   "--output-dir", tmp_path / "run", *args, "-o", script, check=0)
    return script


def run_job(script: Path, tmp_path: Path, *, without: tuple[str, ...] = (), **env_values: str):
    """bash runs the script as sbatch would on the first node, with the stand-ins first on PATH (the script's own
    PATH line, the venv's bin folder, is pointed at them). Returns the exit status, stderr, and what each stand-in
    recorded, in order."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, text in (("srun", SRUN), ("scontrol", SCONTROL), ("accel-fsdp", ACCEL_FSDP)):
        if tool not in without:
            (bin_dir / tool).write_text(text.replace("PYTHON", sys.executable, 1))
            (bin_dir / tool).chmod(0o755)
    text = script.read_text()
    path_line = next(line for line in text.splitlines() if line.startswith("export PATH="))
    job = tmp_path / "as-submitted.sbatch"
    job.write_text(text.replace(path_line, f"export PATH={bin_dir}:/usr/bin:/bin"))
    log = tmp_path / "log.jsonl"
    log.unlink(missing_ok=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "FAKE_LOG": str(log), "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[01-02]", "FAKE_HOSTNAMES": "node01,node02",
           "SLURM_CPUS_PER_TASK": "16", "SLURM_NTASKS": "2", **env_values}
    for name in [name for name, value in env.items() if value is None]:
        del env[name]
    proc = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc.returncode, proc.stderr, records


def launches(records) -> list[dict]:
    return [r for r in records if r.get("accel-fsdp", [None, None])[:2] == ["recipe", "run"]]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_launcher_per_node_with_its_machine_rank_and_cores_whatever_sbatch_was_told(tmp_path):
    """`sbatch --ntasks-per-node=4 job.sbatch` (one task per GPU, as many scripts do) made srun start 4 launchers per
    node, each with the node's machine rank; since SLURM 22.05 srun gave each 1 core, not --cpus-per-task; and
    `sbatch --export=NONE` (which sites recommend) started each task without the script's variables."""
    script = write_script(tmp_path)
    code, err, records = run_job(script, tmp_path, SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4",
                                 SLURM_EXPORT_ENV="NONE")
    assert code == 0, err
    runs = launches(records)
    assert sorted(option(r["accel-fsdp"], "--machine-rank") for r in runs) == ["0", "1"], runs
    for run in runs:
        argv = run["accel-fsdp"]
        assert option(argv, "--main-process-ip") == "node01" and option(argv, "--num-machines") == "2"
        assert option(argv, "--num-processes") == "8" and run["env"]["SLURM_CPUS_PER_TASK"] == "16"
        assert run["env"]["MAIN_ADDR"] == "node01" and run["env"]["RUN_DIR"] == str((tmp_path / "run").resolve())
    (srun,) = [r["srun"] for r in records if "srun" in r]
    assert srun["ntasks-per-node"] == "1" and srun["nodes"] == srun["ntasks"] == "2"


@pytest.mark.parametrize("cluster_kills", ["0", "1"])
def test_a_preemption_is_requeued_when_the_nodes_end_one_after_the_other(tmp_path, cluster_kills):
    """Every node's launcher exits 75 after the checkpoint, not at the same instant: with --kill-on-bad-exit=1 the
    first 75 had srun kill the other node (137), and the script ended the job instead of requeueing it."""
    script = write_script(tmp_path)
    code, err, records = run_job(script, tmp_path, FAKE_RUN_STATUS="75", FAKE_RUN_SECONDS_1="0.5",
                                 FAKE_KILL_ON_BAD_EXIT=cluster_kills)
    assert code == 0, err
    assert [r["requeue"] for r in records if "requeue" in r] == ["4242"]
    code, err, records = run_job(script, tmp_path, FAKE_RUN_STATUS="2")  # a user's mistake: said, not requeued
    assert code == 2 and not [r for r in records if "requeue" in r]
    # The requeued job writes to the same log file (%j is the same job ID): appended to, not truncated, so the log
    # of the attempt that was preempted stays.
    assert "#SBATCH --output=%x-%j.out\n#SBATCH --open-mode=append\n" in script.read_text()


def test_the_main_port_is_the_jobs_own_and_below_the_ephemeral_ports(tmp_path):
    """20000 + job ID % 20000 reached 39999: in Linux's ephemeral range (32768-60999 by default), where an outgoing
    connection of the node may hold the port, and the main process then cannot bind it. A port set is kept."""
    script = write_script(tmp_path)
    for job, port in (("4242", "24242"), ("99999", "23999"), ("31999", "27999")):
        code, err, records = run_job(script, tmp_path, SLURM_JOB_ID=job)
        assert code == 0, err
        assert {option(r["accel-fsdp"], "--main-process-port") for r in launches(records)} == {port}
    code, err, records = run_job(script, tmp_path, MAIN_PORT="29500")
    assert {option(r["accel-fsdp"], "--main-process-port") for r in launches(records)} == {"29500"}


@pytest.mark.parametrize("nodelist,hostnames", [
    ({"SLURM_JOB_NODELIST": "node[01-04,07]"}, "node01,node02,node03,node04,node07"),
    ({"SLURM_JOB_NODELIST": "gpu-a[1-2],gpu-b3"}, "gpu-a1,gpu-a2,gpu-b3"),
    ({"SLURM_JOB_NODELIST": "n1.cluster.example"}, "n1.cluster.example"),
    # SLURM_NODELIST, the older name of the same list, where a site's environment has only it
    ({"SLURM_JOB_NODELIST": None, "SLURM_NODELIST": "node[01-02]"}, "node01,node02"),
    # a list longer than a pipe holds: scontrol must not be left writing into a closed pipe
    ({"SLURM_JOB_NODELIST": "node[00001-20000]"}, ",".join(f"node{i:05d}" for i in range(1, 20001))),
])
def test_the_main_process_is_the_first_node_of_the_list_as_scontrol_expands_it(tmp_path, nodelist, hostnames):
    script = write_script(tmp_path)
    (tmp_path / "hostnames").write_text(hostnames)
    code, err, records = run_job(script, tmp_path, FAKE_HOSTNAMES=f"@{tmp_path / 'hostnames'}", **nodelist)
    assert code == 0, err
    first = hostnames.split(",")[0]
    assert {option(r["accel-fsdp"], "--main-process-ip") for r in launches(records)} == {first}


@pytest.mark.parametrize("setup", [{"without": ("scontrol",)}, {"FAKE_HOSTNAMES": ""}, {"SLURM_JOB_NODELIST": None}])
def test_without_scontrols_answer_the_main_process_is_the_batch_node(tmp_path, setup):
    """scontrol missing (a container) or failing left MAIN_ADDR empty (`export X=$(...)` hides the failure), and every
    node launched towards an empty address. SLURM runs the batch script on the allocation's first node: its name."""
    import socket

    script = write_script(tmp_path)
    without = setup.pop("without", ())
    code, err, records = run_job(script, tmp_path, without=without, **setup)
    assert code == 0, err
    assert "'scontrol show hostnames' named no first node" in err and "the main process is this node" in err
    assert {option(r["accel-fsdp"], "--main-process-ip") for r in launches(records)} == {socket.gethostname()}


def test_outside_a_slurm_job_the_script_is_one_message(tmp_path):
    """Run by hand (bash job.sbatch), it stopped at the first unset SLURM variable, in bash's words."""
    code, err, records = run_job(write_script(tmp_path), tmp_path, SLURM_JOB_ID=None)
    assert code == 2 and "error: SLURM_JOB_ID is not set: this script runs inside a SLURM job" in err, err
    assert "fix: submit it with: sbatch" in err and not records


@pytest.mark.parametrize("gpus_on_node,works", [("4", True), ("8", True), (None, True), ("2", False)])
def test_fewer_gpus_per_node_than_the_script_starts_ranks_is_one_message(tmp_path, gpus_on_node, works):
    """`sbatch --gres=gpu:2 job.sbatch` on a script of 4 ranks per node: every node's launcher refused it, each with
    a fix about num_processes that does not apply to the script. More GPUs than ranks is a note (they stay idle)."""
    script = write_script(tmp_path)
    code, err, records = run_job(script, tmp_path, SLURM_GPUS_ON_NODE=gpus_on_node)
    if works:
        assert code == 0 and len(launches(records)) == 2, err
        return
    assert code == 2 and not launches(records)
    assert ("error: SLURM_GPUS_ON_NODE=2: this job has 2 GPU(s) per node, and the script starts 4 ranks per node, one "
            "per GPU\n    fix: submit it without changing its GPUs (--gres, --gpus-per-node), or write it again with "
            "accel-fsdp slurm --gpus-per-node 2") in err
    cpu = write_script(tmp_path, "--accelerate-config", "fsdp_cpu", name="cpu.sbatch")
    assert "SLURM_GPUS_ON_NODE" not in cpu.read_text()  # CPU ranks: GPUs the job may have are not theirs


@pytest.mark.parametrize("visible,said", [
    ("0,1", "CUDA_VISIBLE_DEVICES=0,1"),
    ("GPU-5d3f9a1e-1b2c-4d5e-8f90-123456789abc,GPU-6e4fab2f-2c3d-4e5f-9a01-23456789abcd",
     "CUDA_VISIBLE_DEVICES=GPU-5d3f9a1e-1b2c-4d5e-8f90-123456789abc,GPU-6e4fab2f"),  # UUIDs, as SLURM may give them
    ("", "CUDA_VISIBLE_DEVICES='' (empty: no GPU)"),  # was "CUDA_VISIBLE_DEVICES=)", as if cut off
    (None, "CUDA_VISIBLE_DEVICES unset"),
])
def test_a_node_showing_fewer_gpus_than_ranks_names_what_it_was_given(monkeypatch, visible, said):
    from accel_fsdp.config.accelerate import load_accelerate_config
    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.config.settings import gpu_count_problems, resolve_settings
    from accel_fsdp.config.shipped import resolve_recipe

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    settings = resolve_settings(load_recipe(resolve_recipe("quickstart")), load_accelerate_config("fsdp_multinode"),
                                cuda_available=True, num_processes=8, num_machines=2)
    (problem,) = gpu_count_problems(settings, 2 if visible else 0)
    assert f"4 processes per machine, but this machine shows {2 if visible else 0} GPU(s) ({said}" in problem.message


def test_a_config_that_picks_gpus_by_number_is_refused_for_a_slurm_job(tmp_path):
    """accelerate launch sets CUDA_VISIBLE_DEVICES from gpu_ids, replacing the GPUs SLURM gave the node: without a
    cgroup that hides the others, gpu_ids: 0,1 trains on GPUs 0 and 1 whichever job holds them."""
    import yaml

    from conftest import REPO

    values = yaml.safe_load((REPO / "accelerate_configs" / "fsdp_multinode.yaml").read_text())
    config = tmp_path / "picked.yaml"
    config.write_text(yaml.safe_dump({**values, "gpu_ids": "0,1"}))
    err = run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "2", "--accelerate-config", config,
                         "-o", tmp_path / "job.sbatch", check=2).stderr
    assert f"error: {config}: gpu_ids: 0,1 would replace the GPUs SLURM gives each node" in err
    assert "fix: set gpu_ids: all in a copy of the config" in err and not (tmp_path / "job.sbatch").exists()


def test_accelerate_launch_sets_the_visible_gpus_from_gpu_ids():
    """What the refusal above relies on (accelerate/utils/launch.py, prepare_multi_gpu_env; accelerate 1.15)."""
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--gpu_ids", "0,1", "--main_process_port",
         "29500", "--mixed_precision", "no", "--dynamo_backend", "no", "train.py"])
    assert prepare_multi_gpu_env(args)["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.parametrize("where,named", [
    (["--output-dir", "{shm}/accel-fsdp-run"], "the run folder {shm}/accel-fsdp-run is"),
    (["--output-dir", "{tmp}/run"], "the run folder {tmp}/run is"),  # TMPDIR
    (["--set", "checkpoint.dir={var_tmp}/accel-fsdp-ckpt"], "checkpoint.dir {var_tmp}/accel-fsdp-ckpt is"),
    (["--output-dir", "{shared}"], None),
])
def test_a_run_folder_on_each_nodes_own_disk_is_said_when_the_script_is_written(tmp_path, monkeypatch, where, named):
    """Every node writes its shards into the run's checkpoints, and a requeued job may run on other nodes: on /tmp
    (or /dev/shm, /var/tmp, TMPDIR) neither sees the others', and the requeued job started the run again, silently.
    The node-local folders stand in under tmp_path: pytest's own tmp_path lies under TMPDIR, /tmp or /var/tmp as the
    machine has it, and "shared" must be outside them all on every machine."""
    from accel_fsdp.launch.slurm import NODE_LOCAL

    assert {"/tmp", "/var/tmp", "/dev/shm"} <= set(NODE_LOCAL)
    paths = {"tmp": tmp_path / "node-tmp", "shared": tmp_path / "shared", "shm": tmp_path / "dev-shm",
             "var_tmp": tmp_path / "var-tmp"}
    monkeypatch.setenv("TMPDIR", str(paths["tmp"]))
    monkeypatch.setattr("accel_fsdp.launch.slurm.NODE_LOCAL", (str(paths["var_tmp"]), str(paths["shm"])))
    err = run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "2",
                         *[w.format(**paths) for w in where], "-o", tmp_path / "job.sbatch", check=0).stderr
    if named is None:
        assert "note:" not in err, err
        return
    assert f"note: {named.format(**paths)} usually each node's own disk" in err, err
    assert "a job requeued onto other nodes would start again" in err


@pytest.mark.parametrize("text,seconds", [
    ("30", 1800), ("30:00", 1800), ("90:30", 5430), ("2:00:00", 7200), ("100:00:00", 360000), ("1-0", 86400),
    ("1-12", 129600), ("1-12:30", 131400), ("7-00:00:00", 604800), (" 12:00:00 ", 43200),
    ("12:99:99", None), ("1-24", None), ("1-12:60", None), ("30:60", None), ("1 day", None), ("-5", None), ("", None),
])
def test_every_form_of_time_limit_sbatch_takes(text, seconds):
    """sbatch(1): minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes and
    days-hours:minutes:seconds. `--time 30:00` (half an hour) was refused as "not a SLURM time"."""
    from accel_fsdp.launch.slurm import time_seconds

    assert time_seconds(text) == seconds


def test_a_time_limit_of_minutes_and_seconds_is_written_and_an_unlimited_one_refused(tmp_path):
    script = write_script(tmp_path, "--time", "30:00")
    assert "#SBATCH --time=30:00\n" in script.read_text()
    err = run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "2", "--time", "UNLIMITED", "-o",
                         tmp_path / "other.sbatch", check=2).stderr
    assert ("error: --time: UNLIMITED: a job without a time limit gets no warning signal to checkpoint on before it "
            "ends\n    fix: give a limit, e.g. 7-00:00:00") in err
    err = run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "2", "--time", "0", "-o",
                         tmp_path / "other.sbatch", check=2).stderr  # sbatch(1): a time limit of zero is none
    assert ("error: --time: 0: a job without a time limit (sbatch reads a limit of 0 as none) gets no warning signal "
            "to checkpoint on before it ends") in err, err


HOSTILE = ["a b", "$(touch INJECTED)", "`touch INJECTED`", "it's", 'say "hi"', "back\\slash", "ünïcode ✓",
           "two\nlines; touch INJECTED"]


def test_every_value_reaches_the_nodes_as_given_and_none_runs_as_a_command(tmp_path, monkeypatch):
    """Values with blanks, quotes, `$(...)`, backslashes, unicode and newlines, in --set, the run folder, the recipe's
    name and the script's own name: each arrives byte for byte, nothing is executed, and the header's comments stay
    comments (a newline in -o or in the command line ended the comment: the rest ran as a command)."""
    folder = tmp_path / "runs with 'quotes' $(touch INJECTED) ✓"
    name = "job $(touch INJECTED)\ntouch INJECTED\n.sbatch"
    args = ["--set", "logging.sample_prompt=" + " | ".join(HOSTILE), "--set", 'name=my run "x" $(touch INJECTED)']
    monkeypatch.setattr(sys, "argv", ["accel-fsdp", "slurm", "quickstart", *args, "-o", name])
    script = tmp_path / name
    run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "4", "--output-dir", folder, *args,
                   "-o", script, check=0)
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            assert len(line.split()) == 2, line  # sbatch reads one option per line, split at blanks
    assert "#SBATCH --job-name=accel-fsdp-my_run__x____touch_INJECTED_" in text
    code, err, records = run_job(script, tmp_path)
    assert code == 0, err
    assert not list(tmp_path.rglob("INJECTED")), "a value ran as a command"
    calls = [r["accel-fsdp"] for r in records if "accel-fsdp" in r]
    assert len(calls) == 3  # recipe validate on the first node, recipe run on both
    for argv in calls:
        assert [argv[i + 1] for i, a in enumerate(argv) if a == "--set"] == args[1::2]
        assert option(argv, "--output-dir") == str(folder.resolve())


def test_an_existing_script_is_replaced_only_when_nothing_of_the_users_is_lost(tmp_path):
    """A script `accel-fsdp slurm` wrote was silently replaced, the user's edits to it (the header invites them:
    module loads, containers) included. Now: replaced with a note when unedited; else one message, and it stays."""
    script = write_script(tmp_path)
    out = run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "2", "-o", script, check=0)
    assert f"note: {script} was replaced: an earlier script of `accel-fsdp slurm`, not edited since" in out.stderr
    edited = script.read_text().replace("# The Python environment", "module load cuda/12.4\n# The Python environment")
    script.write_text(edited)
    err = run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "4", "-o", script, check=2).stderr
    assert (f"error: {script}: was edited since `accel-fsdp slurm` wrote it: replacing it would lose the edits\n"
            "    fix: give another -o, or move it away first (nothing was changed)") in err
    assert script.read_text() == edited
    lines = edited.split("\n")
    older = "\n".join([lines[0], lines[1].split(";")[0] + ":", *lines[2:]])  # as accel-fsdp wrote it before
    script.write_text(older)
    err = run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "4", "-o", script, check=2).stderr
    assert "was written by an older `accel-fsdp slurm`, which kept no checksum: edits to it cannot be told" in err
    assert script.read_text() == older and "Traceback" not in err


# ------------------------------------------------------- `recipe run` in a job step the user's own script started

STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2"}


@pytest.mark.parametrize("step,args,expected", [
    # srun -N 2 --ntasks-per-node=4 accel-fsdp recipe run ...: one task per GPU, as for a program that is its own rank
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_NODEID": "0"}, ["--machine-rank", "0"],
     "error: SLURM_STEP_NUM_TASKS=8: srun started 8 tasks on 2 node(s), and each `accel-fsdp recipe run` launches all "
     "of its machine's ranks itself"),
    # one task per node, the machine rank left to the config (0 on every node)
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "1"}, [],
     "machine_rank 0: runs on node 1 of the 2 of this SLURM step (SLURM_NODEID=1): each node needs its own machine "
     "rank"),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "1"}, ["--machine-rank", "0"], "error: --machine-rank 0: runs on "
     "node 1"),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "1"}, ["--machine-rank", "1"], None),  # as the script does it
    # a step on 2 of the job's 4 nodes: SLURM_NODEID may count the job's nodes, so it is not compared there
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "3", "SLURM_JOB_NUM_NODES": "4"}, ["--machine-rank", "1"], None),
    # a sweep: each task a run of one machine (srun -n 8 --gpus-per-task=1), placed by the user
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_NODEID": "1"}, ["--num-machines", "1"], None),
])
def test_recipe_run_as_a_task_of_the_users_own_srun_step(tmp_path, monkeypatch, step, args, expected):
    """Several launchers on one node (each starting every rank of the node), or two nodes claiming one machine rank
    (a rendezvous that never completes): refused before anything is checked or launched, naming the variable."""
    from conftest import cli

    launched = []
    monkeypatch.setattr("accel_fsdp.launch.launcher.launch", lambda config, argv, **k: launched.append(argv) or 0)
    monkeypatch.setattr("accel_fsdp.launch.launcher.wait_for_main", lambda *a, **k: None)
    for name, value in {**STEP, **step}.items():
        monkeypatch.setenv(name, value)
    code, out = cli("recipe", "run", "quickstart", "--accelerate-config", "fsdp_multinode", "--num-machines", "2",
                    "--num-processes", "4", "--main-process-ip", "127.0.0.1", "--cpu", "--output-dir",
                    tmp_path / "run", *args)
    if expected is None:
        assert code == 0 and len(launched) == 1, out
        return
    assert code == 2 and expected in out and "fix: " in out and "Traceback" not in out, out
    assert not launched and not (tmp_path / "run").exists()
