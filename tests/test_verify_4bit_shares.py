"""verify's sharding check shows what each rank holds of a 4-bit base (sharding.json's quantized_bytes, against one
copy, quantized_whole_bytes) and fails where a rank holds more than its 1/W share: a 4-bit base left whole on every
rank (unsharded) is the fault it names."""

from __future__ import annotations

from accel_fsdp.tools.verify import quantized_shares


def test_each_rank_holding_its_share_passes_and_says_so():
    text, problems = quantized_shares([64 * 2**20, 64 * 2**20], 128 * 2**20, 2)
    assert problems == []
    assert text == "4-bit bytes per rank 64.00, 64.00 MiB of 128.00 (0.500, 0.500)"


def test_a_rank_holding_more_than_its_share_fails():
    text, problems = quantized_shares([128 * 2**20, 128 * 2**20], 128 * 2**20, 2)  # left whole on both ranks
    assert "(1.000, 1.000)" in text
    assert problems == ["rank(s) 0, 1 hold more than 1/2 of the 4-bit bytes (64.00 MiB)"]
    _, problems = quantized_shares([40, 24, 32, 32], 128, 4)
    assert problems == ["rank(s) 0 hold more than 1/4 of the 4-bit bytes (0.00 MiB)"]
