"""The runner-pattern check of tests/test_gpu_runner_pattern.py, on the CPU with stand-in kernels: it passes a
right kernel and catches the two ways a kernel can be wrong only in the runner's pattern (an element a later
batch leaves unwritten, a result that depends on the call before it)."""
import pytest
import torch

import reference
from harness import _clone_data
from test_gpu_runner_pattern import INPUTS_PER_BATCH, batches_from_env, run_runner_pattern

SHAPE = dict(m=[40, 72], n=[128, 256], k=[256, 256], g=2)


@pytest.fixture(scope="module")
def inputs():
    datas = [reference.generate_input(**SHAPE, seed=7 + 42 * i) for i in range(INPUTS_PER_BATCH)]
    assert not datas[0][0][0][0].is_cuda
    return datas, [reference.reference_check(_clone_data(data)) for data in datas]


def right_kernel(data):
    return reference.ref_kernel(data)


def test_a_right_kernel_passes(inputs):
    datas, checks = inputs
    assert run_runner_pattern(right_kernel, datas, checks) is None


def test_an_element_left_unwritten_in_a_later_batch_is_caught(inputs):
    datas, checks = inputs
    calls = []

    def kernel(data):
        out = reference.ref_kernel(data)
        calls.append(1)
        if len(calls) == 2 * INPUTS_PER_BATCH + 8:  # the 8th input of the second timing batch
            out[1][3, 5] = float("nan")  # as if that element's store never happened (the batch poisoned it)
        return out

    failure = run_runner_pattern(kernel, datas, checks)
    assert failure is not None and "batch 2 of 3, input 8 of 15, group 1" in failure and "never written" in failure


def test_a_result_that_depends_on_the_call_before_is_caught(inputs):
    # a kernel right on every call alone, whose back-to-back calls leak: a row of the previous call's result
    datas, checks = inputs
    previous = []

    def kernel(data):
        out = reference.ref_kernel(data)
        if previous and len(previous) % INPUTS_PER_BATCH:  # not the first call of a batch
            out[0][2] = previous[-1][0][2]
        previous.append([c.clone() for c in out])
        return out

    assert run_runner_pattern(right_kernel, datas, checks) is None
    failure = run_runner_pattern(kernel, datas, checks)
    assert failure is not None and "mismatch" in failure


def test_batches_from_env():
    """NVFP4_PATTERN_BATCHES: unset or empty is the suite's 3, a positive count is taken, anything else refused."""
    assert batches_from_env(None) == 3 and batches_from_env("") == 3 and batches_from_env("100") == 100
    for bad in ("0", "-2", "ten", "1.5"):
        with pytest.raises(ValueError, match="NVFP4_PATTERN_BATCHES"):
            batches_from_env(bad)
