"""`accel-fsdp generate`'s options as users type them: a seed takes the range of training.seed, refused past it as
every other option's value is (one message, exit status 2), never torch's overflow as a traceback."""

from __future__ import annotations

from conftest import run_in_process, user_error

from accel_fsdp.config.recipe_checks import SEED_MAX  # training.seed's largest, which `generate --seed` shares


def test_a_seed_outside_the_training_seed_range_is_refused_before_loading(tmp_path):
    for seed in (2**64, SEED_MAX + 1, -1):  # 2**64 overflowed torch.manual_seed with a traceback
        out = user_error("generate", tmp_path, "--prompt", "alice has a", "--temperature", "1", "--seed", seed)
        assert f"--seed: {seed} is not in the range 0<=x<={SEED_MAX}" in out


def test_the_largest_seed_samples_and_the_same_seed_samples_the_same(tiny_gpt2):
    said = [run_in_process("generate", tiny_gpt2, "--prompt", "alice has a", "--temperature", "1", "--seed", SEED_MAX,
                           "--max-new-tokens", "8", check=0).stdout for _ in range(2)]
    assert said[0] == said[1] and said[0].startswith("alice has a")
