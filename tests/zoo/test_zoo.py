"""The model zoo in one process, on 2 logical CPUs: every pattern under every
in-process strategy against plain Keras from the same initial weights (see
patterns.py for what each outcome asserts)."""

import functools

import pytest

import patterns as zoo


@functools.lru_cache(maxsize=1)
def _reference(name):
    """Plain Keras's run of pattern `name` (one at a time: the tests go
    pattern by pattern)."""
    return zoo.reference(zoo.BY_NAME[name])


@pytest.mark.parametrize("strategy", zoo.IN_PROCESS)
@pytest.mark.parametrize("name", [p.name for p in zoo.PATTERNS])
def test_pattern_trains_as_plain_keras(name, strategy, zoo_results):
    pattern = zoo.BY_NAME[name]
    if pattern.outcome(strategy) == zoo.SKIPPED:
        zoo_results[name, strategy] = zoo.SKIPPED
        pytest.skip(f"{name} under {strategy}: not run in the zoo (see patterns.SKIPPED)")
    initial, expected, logs, bounds = _reference(name)
    result = zoo.run_pattern(pattern, strategy, initial)
    zoo_results[name, strategy] = zoo.check(
        pattern, strategy, initial, expected, result, logs, bounds
    )
