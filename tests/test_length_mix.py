"""The response-length mixes `dvp_jax.aot` prices a step at (`dvp_jax.plan.length_mix`)."""

import numpy as np
import pytest

from dvp_jax.plan import length_mix


@pytest.mark.parametrize("mean", [1, 37.5, 2048, 4096, 8192, 16_000])
def test_a_mean_gives_that_mean_long_tailed_within_the_cap(mean):
    x = length_mix.lengths_from_mean(mean, 512, 16_384)
    assert x.shape == (512,) and x.dtype == np.int64
    assert 1 <= x.min() and x.max() <= 16_384
    # Rounding to ints moves the clipped mean by well under one token per response.
    assert abs(x.mean() - mean) < 1.0
    if 8 < mean < 8192:  # a long tail: the median under the mean, a few far above it
        assert np.median(x) < 0.8 * mean < 2 * mean < x.max()
    # Deterministic: the same call gives the same lengths in the same order.
    np.testing.assert_array_equal(x, length_mix.lengths_from_mean(mean, 512, 16_384))


def test_a_mean_at_the_cap_is_every_response_at_the_cap():
    np.testing.assert_array_equal(length_mix.lengths_from_mean(64, 5, 64), [64] * 5)


def test_a_file_is_read_in_order_and_repeated(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# measured\n3 5\n7  # the last\n")
    got = length_mix.response_lengths(7, 8, path=str(path))
    np.testing.assert_array_equal(got, [3, 5, 7, 3, 5, 7, 3])


@pytest.mark.parametrize(
    "text, message",
    [
        ("3 x 5", "line 1 has 'x'"),
        ("3\n9", r"line 2 has '9'; each length must be an int in \[1, 8\]"),
        ("0", "line 1 has '0'"),
        ("# nothing\n", "no lengths in the file"),
    ],
)
def test_a_bad_file_is_named_in_one_line(tmp_path, text, message):
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        length_mix.response_lengths(4, 8, path=str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_exactly_one_source_and_a_sane_mean():
    with pytest.raises(ValueError, match="one of --response_length_mean and --response_lengths"):
        length_mix.response_lengths(4, 8)
    with pytest.raises(ValueError, match="a number >= 1"):
        length_mix.response_lengths(4, 8, mean=0.5)
    with pytest.raises(ValueError, match="No such file"):
        length_mix.response_lengths(4, 8, path="/nonexistent/lengths.txt")
