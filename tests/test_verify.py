"""`accel-fsdp verify` on 2 CPU ranks: the shipped quick recipes pass, and every check fails when the property it
proves is broken on purpose (ACCEL_FSDP_BREAK, accel_fsdp/train/hooks.py), so no check can pass vacuously."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, run_in_process

pytestmark = pytest.mark.multiprocess


def report_of(folder) -> dict:
    return json.loads((folder / "report.json").read_text())


@pytest.mark.slow
def test_verify_quickstart_passes_every_check(tmp_path):
    out = tmp_path / "verify"
    proc = run_cli("verify", "quickstart", "--output-dir", out, check=0)
    report = report_of(out)
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {"sharding": "PASS", "precision": "PASS", "equivalence": "PASS", "resume": "PASS",
                      "packing": "PASS", "data": "PASS", "activation-checkpointing": "PASS",
                      "chunked-loss": "PASS", "compile": "SKIP", "activation-offload": "SKIP", "fp8": "SKIP",
                      "quantize": "SKIP", "memory": "PASS", "throughput": "INFO"}
    assert report["passed"] and set(report["probes"]) == {"reference", "split", "fewer-ranks", "resume", "ac-on",
                                                          "ac-off", "chunked-loss-on", "chunked-loss-off"}
    assert "9 passed, 0 failed" in proc.stdout
    data = next(c for c in report["checks"] if c["name"] == "data")
    assert data["data"]["ranks_compared"] == [1, 2] and "1 rank and 2 ranks read the same sequences" in data["measured"]
    equivalence = next(c for c in report["checks"] if c["name"] == "equivalence")
    assert set(equivalence["data"]) == {"split", "fewer-ranks"}  # two other splits, one of them on 1 rank
    # verify keeps to its folder: a second verify replaces the first, a folder of something else is refused
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    msg = run_in_process("verify", "quickstart", "--output-dir", tmp_path / "mine", check=2).stderr
    assert "exists and is not an earlier verify folder" in msg


@pytest.mark.slow
def test_verify_quickstart_llama_passes(tmp_path):
    out = tmp_path / "verify"
    run_cli("verify", "quickstart-llama", "--quick", "--output-dir", out, check=0)
    report = report_of(out)
    assert report["passed"] and "fewer-ranks" not in report["probes"]  # --quick
    packing = next(c for c in report["checks"] if c["name"] == "packing")
    assert packing["status"] == "PASS" and packing["data"]["documents"] >= 2


INSTRUCTION = ["--set", "data.path=builtin:quickstart-instruct", "--set", "data.format=instruction",
               "--set", "training.mixed_precision=fp32"]  # label counts vary per micro-batch; fp32: tight tolerance


@pytest.mark.parametrize("broken,check,extra,expected", [
    pytest.param("unsharded", "sharding", [], "not sharded over 2 ranks", marks=pytest.mark.slow),  # one probe
    pytest.param("mean-loss", "equivalence", INSTRUCTION, "split: loss", marks=pytest.mark.slow),
    pytest.param("ac-rng", "activation-checkpointing", [], "with dropout 0.1, with vs without", marks=pytest.mark.slow),
    pytest.param("mix-weights", "data", ["quickstart-mix"], "a source's share is 0.2", marks=pytest.mark.slow),
    pytest.param("chunked-loss", "chunked-loss", ["--set", "training.mixed_precision=fp32"],
                 "training.chunked_loss=true vs false", marks=pytest.mark.slow),
])
def test_each_check_fails_when_its_property_is_broken(tmp_path, broken, check, extra, expected):
    out = tmp_path / "verify"
    recipe = extra.pop(0) if extra and not extra[0].startswith("--") else "quickstart"
    proc = run_cli("verify", recipe, "--quick", "--only", check, "--output-dir", out, *extra,
                   env={"ACCEL_FSDP_BREAK": broken})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = report_of(out)["checks"]
    assert result["name"] == check and result["status"] == "FAIL", result
    assert expected in result["measured"], result["measured"]
    assert "0 passed, 1 failed" in proc.stdout
    assert (out / "reference" / "final").exists() == (check == "resume")  # only the resume check reads an export


@pytest.mark.slow
def test_the_precision_packing_and_resume_checks_fail_when_their_properties_are_broken_together(tmp_path):
    """Three properties broken in one verify (one reference probe and one resume probe, not three references): each
    check reads evidence the other breaks leave alone (the gradient dtypes the reference recorded; the packing
    probe's logits of one forward; the weights of two runs that reduce in the same dtype and read the same packed
    rows), so each fails on its own break, with its own measurement."""
    out = tmp_path / "verify"
    proc = run_cli("verify", "quickstart", "--quick", "--only", "precision", "--only", "packing", "--only", "resume",
                   "--output-dir", out, "--set", "training.mixed_precision=bf16",
                   env={"ACCEL_FSDP_BREAK": "bf16-reduce,mask-leak,skip-batch"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = {c["name"]: c for c in report_of(out)["checks"]}
    expected = {"precision": "gradients reduced in torch.bfloat16",
                "packing": "largest logit difference to each document alone",
                "resume": "largest weight difference after resuming from step 2"}
    assert set(results) == set(expected)
    for check, measured in expected.items():
        assert results[check]["status"] == "FAIL", results[check]
        assert measured in results[check]["measured"], results[check]["measured"]
    assert "0 passed, 3 failed" in proc.stdout
    assert (out / "reference" / "final").exists()  # the resume check reads the export


@pytest.mark.slow
def test_the_data_check_passes_on_a_mixture(tmp_path):
    """On a GPU config run on CPU ranks (--cpu), with the sharding check beside it, so the one verify holds
    `verify --cpu` too (the promise of tests/test_gpu_config_on_cpu_ranks.py)."""
    out = tmp_path / "verify"
    proc = run_cli("verify", "quickstart-mix", "--accelerate-config", "fsdp_2gpu", "--cpu", "--quick", "--only", "data",
                   "--only", "sharding", "--output-dir", out, check=0)
    report = report_of(out)
    assert report["device"] == "cpu" and report["ranks"] == 2
    result, sharding = (next(c for c in report["checks"] if c["name"] == name) for name in ("data", "sharding"))
    assert [c["name"] for c in report["checks"]] == ["sharding", "data"], proc.stdout
    assert sharding["status"] == "PASS", sharding
    assert result["status"] == "PASS" and result["data"]["max_share_deviation"] <= 0.01, result
    assert result["data"]["repeats"] == result["data"]["missing"] == 0 and result["data"]["epochs_completed"] >= 1
