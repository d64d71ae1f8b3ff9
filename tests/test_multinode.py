"""Beyond one machine, proven on one box: two "machines" on loopback, hybrid sharding on 4 CPU ranks, the SLURM
script run under stand-in srun/scontrol, and the errors users hit when machines do not find each other."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import (
    WallClockBound,
    cli_process,
    cpu_config,
    free_port,
    read_metrics,
    run_cli,
    run_in_process,
    tiny_recipe,
)

from accel_fsdp.cli import main

pytestmark = pytest.mark.multiprocess


def two_machines(config: Path, *args) -> list[tuple[int, str, str]]:
    """Start machine 1 and machine 0 of a 2-machine job on this box; wait for both."""
    procs = [cli_process(*args, "--accelerate-config", config, "--machine-rank", rank) for rank in (1, 0)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        out.append((p.returncode, stdout, stderr))
    return out


@pytest.mark.slow
def test_two_machines_on_loopback_train_checkpoint_and_resume(tmp_path, tiny_gpt2, stories):
    config = cpu_config(tmp_path / "two.yaml", num_machines=2, num_processes=2, main_process_ip="127.0.0.1",
                        main_process_port=free_port(), rdzv_backend="static", same_network=True)
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories, training={"max_steps": 6},
                         checkpoint={"every_steps": 3})
    run = tmp_path / "run"
    for code, _, stderr in two_machines(config, "recipe", "run", recipe, "--output-dir", run):
        assert code == 0, stderr[-3000:]
    info = json.loads((run / "sharding.json").read_text())
    assert len(info["local_parameters"]) == 2 and info["strategy"] == "FULL_SHARD"  # one shard per machine
    assert (run / "checkpoints" / "step-000006" / "manifest.json").exists()
    manifest = json.loads((run / "checkpoints" / "step-000006" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and any(f.endswith("__1_0.distcp") for f in manifest["files"])

    # Resume on both machines with a longer schedule.
    results = two_machines(config, "recipe", "run", recipe, "--output-dir", run, "--resume",
                           "--set", "training.max_steps=9")
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    assert "continuing from" in results[1][1] and "at step 6" in results[1][1]
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"][-1] == 9


@pytest.mark.slow
def test_hybrid_sharding_on_4_ranks_replicates_across_and_shards_within(tmp_path, tiny_gpt2, stories):
    config = cpu_config(tmp_path / "hybrid.yaml", num_processes=4,
                        parallelism_config={"parallelism_config_dp_replicate_size": 2,
                                            "parallelism_config_dp_shard_size": 2})
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories, training={"max_steps": 4, "micro_batch_size": 2})
    run = tmp_path / "run"
    run_cli("recipe", "run", recipe, "--output-dir", run, "--accelerate-config", config,
            "--set", "fsdp.collective_timeout_minutes=10", check=0)
    info = json.loads((run / "sharding.json").read_text())
    assert info["strategy"] == "HYBRID_SHARD" and info["expected_shards"] == 2
    # Every group has the configured timeout, the mesh's replicate and shard groups included (init_device_mesh
    # creates them with torch's 30-minute default), and 10 minutes is not lost on the way (Accelerate's own default)
    timeouts = info["process_group"]["group_timeouts_s"]
    assert len(timeouts) >= 3 and set(timeouts.values()) == {600.0}, timeouts
    total = info["parameters"]
    for layout in (info["ranks"], info["ranks_after_training"]):
        by = {(r["replica"], r["shard"]): r for r in layout}
        assert sorted(by) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for shard in (0, 1):  # the two replicas of a shard hold the same values (also after training)
            # Bit for bit: both apply the same all-reduced gradient, and a checksum adds the same values in one order.
            assert by[(0, shard)]["checksum"] == by[(1, shard)]["checksum"]
        for replica in (0, 1):  # inside a replica, the ranks hold different pieces
            assert by[(replica, 0)]["checksum"] != by[(replica, 1)]["checksum"]
    for n in info["local_parameters"]:
        assert abs(n - total / 2) <= 0.01 * total  # each rank holds half: sharded over 2, not 4


def test_unreachable_main_process_fails_fast_naming_address_and_port(tmp_path):
    port = free_port()
    config = cpu_config(tmp_path / "two.yaml", num_machines=2, num_processes=2, main_process_ip="127.0.0.1",
                        main_process_port=port, rdzv_backend="static", same_network=True)
    bound = WallClockBound(60)  # the launcher's imports and 3 s of trying: 6 to 11 s here under the parallel suite
    proc = run_cli("recipe", "run", "quickstart", "--output-dir", tmp_path / "run", "--accelerate-config", config,
                   "--machine-rank", "1", "--rendezvous-timeout", "3", check=2)
    bound.check("giving up on an unreachable main process")
    assert f"127.0.0.1:{port}: cannot reach the main process (machine_rank 0) within 3s" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_main_machine_waiting_for_a_missing_machine_times_out_clearly(tmp_path):
    port = free_port()
    config = cpu_config(tmp_path / "two.yaml", num_machines=2, num_processes=2, main_process_ip="127.0.0.1",
                        main_process_port=port, rdzv_backend="static", same_network=True)
    proc = run_cli("recipe", "run", "quickstart", "--output-dir", tmp_path / "run", "--accelerate-config", config,
                   "--machine-rank", "0", "--rendezvous-timeout", "4", check=2)
    assert f"127.0.0.1:{port}: not all 2 machines joined within 4s" in proc.stderr
    assert "--machine-rank (0 to 1)" in proc.stderr and "Traceback" not in proc.stderr


def test_hybrid_group_larger_than_the_world_is_refused(tmp_path):
    config = cpu_config(tmp_path / "bad.yaml", num_processes=2,
                        parallelism_config={"parallelism_config_dp_replicate_size": 1,
                                            "parallelism_config_dp_shard_size": 4})
    result = CliRunner().invoke(main, ["recipe", "validate", "quickstart", "--accelerate-config", str(config)])
    assert result.exit_code == 2
    assert "dp_replicate_size x dp_shard_size = 1 x 4 = 4, but num_processes = 2" in result.output
    config = cpu_config(tmp_path / "one.yaml", num_processes=2)
    result = CliRunner().invoke(main, ["recipe", "validate", "quickstart", "--accelerate-config", str(config),
                                       "--set", "fsdp.sharding_strategy=HYBRID_SHARD", "--set",
                                       "training.micro_batch_size=1"])
    assert result.exit_code == 0, result.output  # one machine: the hybrid group is that machine's 2 ranks


def test_machine_count_that_does_not_match_the_hybrid_config_is_refused(tmp_path):
    proc = run_in_process("recipe", "run", "quickstart", "--accelerate-config", "fsdp_hybrid_multinode",
                          "--num-machines", "4", "--output-dir", tmp_path / "run", check=2)
    assert "the hybrid shard group of 8 ranks does not match the 4 ranks of each machine" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_slurm_script_checks_batch_and_layout_when_generated(tmp_path):
    result = CliRunner().invoke(main, ["slurm", "gpt2-xl", "--nodes", "3", "--gpus-per-node", "8", "-o",
                                       str(tmp_path / "job.sbatch")])
    assert result.exit_code == 2
    assert "64 is not divisible by micro_batch_size x GPUs = 4 x 3 x 8 = 96" in result.output
    assert not (tmp_path / "job.sbatch").exists()
    result = CliRunner().invoke(main, ["slurm", "gpt2-xl", "--nodes", "4", "--gpus-per-node", "8",
                                       "--accelerate-config", "fsdp_hybrid_multinode", "--global-batch-size", "128",
                                       "--time", "1 day", "-o", str(tmp_path / "job.sbatch")])
    assert result.exit_code == 2
    assert "hybrid layout 2 replicas x 8 GPUs does not match --nodes 4 x --gpus-per-node 8" in result.output
    assert "'1 day' is not a SLURM time" in result.output


def test_a_slurm_job_of_cpu_ranks_asks_for_no_gpus_and_says_cpu_ranks(tmp_path):
    """The CPU config's job: no --gres line, and the summary counts CPU ranks (it said "GPUs" where there are none)."""
    for config, ranks in (("fsdp_cpu", "CPU ranks"), ("fsdp_2gpu", "GPUs")):
        script = tmp_path / f"{config}.sbatch"
        out = run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "2", "--accelerate-config",
                             config, "--output-dir", tmp_path / "run", "-o", script, check=0).stdout
        assert f"2 node(s) x 2 {ranks}, global batch 32 = micro 4 x 4 {ranks} x 2 accumulation steps" in out, out
        assert ("#SBATCH --gres=gpu:2" in script.read_text()) == (ranks == "GPUs")
        kind = "CPU" if ranks == "CPU ranks" else "GPU"  # what the job says when it starts
        assert f'echo "nodes:         $NODES x $GPUS_PER_NODE {kind} ranks = $TOTAL_GPUS ranks;' in script.read_text()


def slurm_stand_ins(tmp_path: Path) -> tuple[dict, Path]:
    """srun and scontrol for one node with 2 CPU ranks; scontrol records requeues."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    requeues = tmp_path / "requeues.txt"
    (bin_dir / "scontrol").write_text('#!/bin/bash\nif [ "$1" = requeue ]; then echo "$2" >> ' + str(requeues) +
                                      '; else echo localhost; fi\n')
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                  'export SLURM_NODEID=0\nexec "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="localhost",
               SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="1", SLURM_CPUS_PER_TASK="2", MAIN_PORT=str(free_port()),
               PYTHONUNBUFFERED="1")
    return env, requeues


@pytest.mark.slow
def test_slurm_script_resumes_after_a_crash_and_requeues_itself_at_the_warning_signal(tmp_path, tiny_gpt2, stories):
    """The generated sbatch script, run by bash with stand-ins for srun and scontrol (one node, 2 CPU ranks), as one
    job started three times (three starts, not two jobs of two): it checks and prints the recipe on the allocation
    and trains until a crash, which is not requeued; run again, it resumes, and at SLURM's SIGUSR1 before the time
    limit (here sent to the launcher by a rank) the ranks checkpoint, the run exits 75 and the script requeues the
    job; the requeued job resumes and finishes. With the checkpoints outside the run folder (scratch), as in the
    requeue that used to delete them: nothing is deleted."""
    scratch = tmp_path / "scratch"
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories, training={"max_steps": 8},
                         checkpoint={"every_steps": 3, "dir": str(scratch)})
    script = tmp_path / "job.sbatch"
    run = tmp_path / "run"
    run_in_process("slurm", recipe, "--nodes", "1", "--gpus-per-node", "2", "--accelerate-config", "fsdp_cpu",
            "--output-dir", run, "--set", "logging.sample_prompt=alice has a", "-o", script, check=0)
    env, requeues = slurm_stand_ins(tmp_path)
    crashed = subprocess.run(["bash", str(script)], env=dict(env, ACCEL_FSDP_FAULT="kill:5"), capture_output=True,
                             text=True, timeout=600)
    assert crashed.returncode != 0
    assert "batch: global 8 = micro 4 x 2 processes x 1 accumulation steps" in crashed.stdout
    assert (scratch / "step-000003" / "manifest.json").exists() and not (run / "checkpoints").exists()
    assert not requeues.exists()  # a crash is not a preemption
    kept = {p: p.stat().st_mtime_ns for p in (scratch / "step-000003").rglob("*")}

    warned = subprocess.run(["bash", str(script)], env=dict(env, SLURM_RESTART_COUNT="1",
                                                            ACCEL_FSDP_FAULT="sigusr1-launcher:4"),
                            capture_output=True, text=True, timeout=600)
    assert warned.returncode == 0, warned.stderr[-3000:]
    assert "(restart 1)" in warned.stdout and "continuing from" in warned.stdout and "at step 3" in warned.stdout
    assert "preempted: the run wrote a checkpoint; requeueing job 4242" in warned.stdout
    assert requeues.read_text().split() == ["4242"]
    # step 3 untouched by the requeued start (its checkpoints: 3 and the preemption's; kept by rotation: 2)
    assert {p: p.stat().st_mtime_ns for p in kept if p.exists()} == kept
    step = json.loads((run / "preempted.json").read_text())["step"]

    requeued = subprocess.run(["bash", str(script)], env=dict(env, SLURM_RESTART_COUNT="2"), capture_output=True,
                              text=True, timeout=600)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"at step {step}" in requeued.stdout and "sample: 'alice has a' -> " in requeued.stdout
    assert (run / "final" / "model.safetensors").exists() and requeues.read_text().split() == ["4242"]
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"][-1] == 8


@pytest.mark.slow
def test_two_machines_receive_a_streamed_4bit_base_from_global_rank_0(tmp_path, tiny_llama, stories):
    """Streaming loading across machines: global rank 0 (machine 0) reads and quantizes, and sends machine 1's rank
    the rows of its shards over the network; the base, each rank's half of its 4-bit bytes and the losses are those
    of the same 2 ranks on one machine."""
    streamed = {"fsdp_cpu_ram_efficient_loading": True}
    two = cpu_config(tmp_path / "two.yaml", streamed, num_machines=2, num_processes=2, main_process_ip="127.0.0.1",
                     main_process_port=free_port(), rdzv_backend="static", same_network=True)
    one = cpu_config(tmp_path / "one.yaml", streamed, num_processes=2)
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_llama, stories, training={"max_steps": 2},
                         model={"quantize": "nf4", "lora": {"enabled": True, "target_modules": ["q_proj", "v_proj"]}})
    for code, _, stderr in two_machines(two, "recipe", "run", recipe, "--output-dir", tmp_path / "two"):
        assert code == 0, stderr[-3000:]
    run_cli("recipe", "run", recipe, "--accelerate-config", one, "--output-dir", tmp_path / "one", check=0)
    across, within = (json.loads((tmp_path / name / "sharding.json").read_text()) for name in ("two", "one"))
    assert across["rank0_only_loading"] and within["rank0_only_loading"]
    assert across["quantized_base"] == within["quantized_base"]
    half, other_half = across["quantized_bytes"]
    assert half == other_half and half + other_half == across["quantized_whole_bytes"]
    # the same 2 ranks adding the same numbers in the same order: only the machine ranks differ
    losses = [[r["loss"] for r in read_metrics(tmp_path / name) if r["kind"] == "train"] for name in ("two", "one")]
    assert losses[0] == losses[1] and len(losses[0]) == 2
