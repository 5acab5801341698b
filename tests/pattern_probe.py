"""The runner's leaderboard pattern on one GPU, with the probes of docs/HOPPER_NOTES.md r43 (needs a GPU).

    python tests/pattern_probe.py --setting variant=sm90_tile128 [--setting variant=sm90_a16_mexact]
           [--benches 0,2] [--seeds 90211,4242] [--upper zero|ff]

Per setting (bench.py --ab's forms: variant=NAME, sm90.FIELD=VALUE, pdl=on|off, default), benchmark and seed:
tests/test_gpu_runner_pattern.py's pattern (15 inputs back to back, L2 flushed, outputs poisoned, every result
re-checked after every batch), one line each: PASS, or the first failure. `--upper zero|ff`: after the
descriptor preparation stages each 128-byte
template in shared memory, bytes 64-127 are overwritten with zeros or 0xff before the patch and the release
(does the TMA unit read them?). Both are probes, not settings anyone should ship.
"""
import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]


def overwrite_upper_halves(fill: int) -> None:
    """Descriptor preparation from now on: bytes 64-127 of every staged template set to `fill` (0 or -1)."""
    import cutlass
    import cutlass.cute as cute

    import submission

    stage = submission.TmaDescriptorRows.stage_from_atoms

    def stage_then_overwrite(self, atoms, slots, warp_id):
        stage(self, atoms, slots, warp_id)
        if not self.up_front:
            with cute.arch.elect_one():
                for slot in slots:
                    words = cute.make_tensor(self._smem_ptr(slot), cute.make_layout(16))
                    for w in range(8, 16):
                        words[w] = cutlass.Int64(fill)
            cute.arch.sync_warp()

    submission.TmaDescriptorRows.stage_from_atoms = stage_then_overwrite


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", action="append", required=True, metavar="SETTING",
                        help="a kernel setting in bench.py --ab's forms (repeatable)")
    parser.add_argument("--benches", default="0,1,2,3")
    parser.add_argument("--seeds", default="90211,4242,1111")
    parser.add_argument("--upper", choices=("zero", "ff"))
    args = parser.parse_args(argv)

    import bench
    import submission
    import submission_sm90
    from test_gpu_runner_pattern import _inputs, run_runner_pattern

    variants = submission.KERNEL_VARIANTS + submission_sm90.SM90_VARIANTS
    try:
        settings = [bench.parse_setting(text, variants, submission_sm90.sm90_override_types())
                    for text in args.setting]
    except ValueError as err:
        parser.error(str(err))
    if args.upper:
        overwrite_upper_halves(0 if args.upper == "zero" else -1)
    default_pdl = submission.USE_PDL
    failed = 0
    for number in map(int, args.benches.split(",")):
        for seed in map(int, args.seeds.split(",")):
            datas, checks = _inputs(number, seed)
            for setting in settings:
                bench.apply_setting(submission, submission_sm90, setting, default_pdl)
                failure = run_runner_pattern(submission.custom_kernel, datas, checks)
                failed += failure is not None
                print(f"{setting.text} bench{number} seed{seed} upper={args.upper or 'as staged'}: "
                      f"{failure or 'PASS'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
