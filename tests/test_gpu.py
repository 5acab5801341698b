"""custom_kernel on a GPU: every task.yml case through check_implementation, outputs poisoned first."""
import pytest
import torch

import reference
import submission
from conftest import cuda_capability, load_task_yml

CAPABILITY = cuda_capability()
B200 = CAPABILITY is not None and CAPABILITY[0] == 10

pytestmark = pytest.mark.gpu


def _cases(section):
    return [pytest.param({k: case[k] for k in ("m", "n", "k", "g", "seed")}, id=f"{section}{i}")
            for i, case in enumerate(load_task_yml()[section])]


def _poison(data):
    for _, _, c in data[0]:
        c.fill_(float("nan"))
    return data


def _check(args, seed_offset=0):
    args = dict(args, seed=args["seed"] + seed_offset)
    data = reference.generate_input(**args)
    out = submission.custom_kernel(_poison(reference.generate_input(**args)))
    torch.cuda.synchronize()
    for c in out:
        assert not torch.isnan(c).any(), "an output element was never written"
    ok, msg = reference.check_implementation(data, out)
    assert ok, msg


@pytest.mark.skipif(not B200, reason="the B200 kernel needs an sm_100 GPU")
@pytest.mark.parametrize("args", _cases("tests") + _cases("benchmarks"))
def test_b200_task_cases(args):
    _check(args)
    _check(args, seed_offset=17)  # fresh inputs, same shapes: nothing may be cached but the compile


@pytest.mark.skipif(not B200, reason="the B200 kernel needs an sm_100 GPU")
def test_b200_same_buffers_new_sizes():
    # Regression for the launch-metadata cache: same pointers, other sizes must not reuse stale sizes.
    data = reference.generate_input(m=(128, 128), n=(256, 128), k=(512, 256), g=2, seed=3)
    submission.custom_kernel(data)
    abc, sfs, sfs_r, sizes = data
    small = [(a[:64], b, c[:64]) for a, b, c in abc]
    small_sfs = [(sfa[:64], sfb) for sfa, sfb in sfs]
    shrunk = (small, small_sfs, sfs_r, [(64, n, k, l) for _, n, k, l in sizes])
    for _, _, c in small:
        c.fill_(float("nan"))
    out = submission.custom_kernel(shrunk)
    torch.cuda.synchronize()
    ok, msg = reference.check_implementation(shrunk, out)
    assert ok, msg


@pytest.mark.skipif(CAPABILITY in (None, (10, 0), (9, 0)), reason="checks a GPU that has no kernel here")
def test_other_gpus_get_a_clear_error():
    data = reference.generate_input(m=(64,), n=(128,), k=(256,), g=1, seed=1)
    with pytest.raises(submission.UnsupportedDeviceError, match=torch.cuda.get_device_name()):
        submission.custom_kernel(data)
