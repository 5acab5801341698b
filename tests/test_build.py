"""The kernels build for their GPUs on a machine without one (`eval.py compile`), and their SASS is sane."""
import json
import os
import re
import subprocess
import sys

import pytest

import eval as ev
from conftest import ROOT, build_test_marks, load_task_yml

try:
    import submission
    import submission_sm90
except ImportError:  # no nvidia-cutlass-dsl: every test here is skipped
    submission = submission_sm90 = None

# submission.USE_PDL as the eval.py subprocess will see it
PDL_ON = os.environ.get("NVFP4_PDL", "1") == "1"


def build_variants(sub, sub90) -> tuple:
    """(sm_100a variants, sm_90a variants) the build tests build: every name compile --variant takes, from the
    submission itself, so that a new variant is built too. sm_100a: VARIANT_CONFIGS ("persistent", the tile
    per problem, among them); sm_90a: SM90_VARIANTS, "sm90_auto" (the choice per problem) and every
    SM90_VARIANT_CONFIGS entry."""
    if sub is None:
        return (), ()
    return tuple(sub.VARIANT_CONFIGS), tuple(sub90.SM90_VARIANTS)


SM100_BUILD_VARIANTS, SM90_BUILD_VARIANTS = build_variants(submission, submission_sm90)


def sm100_expectations(sub, variant: str) -> dict:
    """What the SASS of an sm_100a variant must show, from its config's kind, never from a list of names:
    persistent kernels store C by TMA, launch with programmatic dependent launch and have a shared- and
    tensor-memory plan; the seed's kernel (Sm100GemmConfig) stores with STG and has neither. Another kind
    of config has no expectations yet: an error, not a silent pass."""
    config = sub.VARIANT_CONFIGS[variant]
    if isinstance(config, sub.Sm100PersistentConfig):
        return dict(tma_store=True, pdl=PDL_ON, planned=True)
    if isinstance(config, sub.Sm100GemmConfig):
        return dict(tma_store=False, pdl=False, planned=False)
    raise AssertionError(f"{variant}: no SASS expectations for a {type(config).__name__}; add them to "
                         "tests/test_build.py")


def sm90_expectations(config) -> dict:
    """What the SASS of a Hopper kernel must show: pipelined wgmma waits (WGDEP1) and no local memory, for every
    kept variant (the one that had neither, 128 x 256 tiles with A converted in the kernel, is retired)."""
    return dict(pipelined=True, no_spills=True)


pytestmark = build_test_marks()


def _compile(tmp_path, arch, extra=()):
    out = tmp_path / f"{arch}{'_'.join(extra)}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "eval.py"), "compile", "--arch", arch,
                           str(ROOT / "task.yml"), "--json", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=3600)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert out.exists(), proc.stderr[-2000:]
    return proc, json.loads(out.read_text())


@pytest.mark.parametrize("variant", SM100_BUILD_VARIANTS)
def test_sm100a_builds_for_every_task_group_count(tmp_path, variant):
    task = load_task_yml()
    expect = sm100_expectations(submission, variant)
    # MoE layers run 128-256 experts, empty ones included (the kernels are built per group count as given)
    extra = ("--groups", "1", "16", "64", "256") if variant in submission.TILE_TABLE_VARIANTS else ("--groups", "256")
    proc, report = _compile(tmp_path, "sm_100a", ("--variant", variant, *extra))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert len(report) == len(task["tests"]) + len(task["benchmarks"]) + len(extra[1:])
    assert {r["groups"] for r in report} >= {c["g"] for c in task["tests"] + task["benchmarks"]}
    # a forced tile is not built for the cases whose N it does not divide (persistent_n256: N = 128, 384)
    tile_n = None if variant in submission.TILE_TABLE_VARIANTS else submission.VARIANT_CONFIGS[variant].tile_mn[1]
    skipped = [c for c in task["tests"] + task["benchmarks"] if tile_n and any(n % tile_n for n in c["n"])]
    assert len([r for r in report if r.get("not_applicable")]) == len(skipped)
    for row in report:
        if row.get("not_applicable"):
            continue
        assert row["ok"], row
        sass = row["sass"]
        assert sass["UTCOMMA"] > 0 and sass["UTMALDG"] > 0, row  # tcgen05 MMA and TMA loads are there
        if expect["tma_store"]:
            assert sass["UTMASTG"] > 0, row  # TMA-store epilogue (the seed stores with STG)
        assert sass["LDL"] == 0 and sass["STL"] == 0, row  # no local-memory spills
        # programmatic dependent launch (griddepcontrol.launch_dependents / .wait) in the persistent kernels
        pdl = int(expect["pdl"])
        assert (sass["PREEXIT"], sass["ACQBULK"]) == (pdl, pdl), row
        assert row["resources"]["REG"] > 0
        if expect["planned"]:  # the kernel's plan fits an SM: 227 KiB of shared memory, 512 TMEM columns
            used, allocated = map(int, row["info"]["tmem_cols"].split("/"))
            assert used <= allocated <= 512 and row["info"]["planned_smem_bytes"] + 1024 <= 232448, row


@pytest.mark.parametrize("variant", SM90_BUILD_VARIANTS)
def test_sm90a_builds_for_every_task_group_count(tmp_path, variant):
    task = load_task_yml()
    proc, report = _compile(tmp_path, "sm_90a", ("--variant", variant))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert len(report) == len(task["tests"]) + len(task["benchmarks"])
    for row in report:
        assert row["ok"], row
        # the kernel built (sm90_auto: the variant its choice per problem builds, `built_as`)
        config = submission_sm90.SM90_VARIANT_CONFIGS[row["built_as"]]
        check_sm90_gemm_sass(row["sass"], config, row)


def check_sm90_gemm_sass(sass: dict, config, where) -> None:
    """What the SASS counts (`eval.count_sass`) of every Hopper GEMM build must show, for its `config`; `where`
    goes into each failure's message."""
    expect = sm90_expectations(config)
    # wgmma, TMA loads of the fp4 bytes, TMA store of C
    assert sass["HGMMA"] > 0 and sass["UTMALDG"] > 0 and sass["UTMASTG"] > 0, where
    # the epilogue writes its slab with stmatrix: one instruction per 16 rows of each width (docs/HOPPER_NOTES.md
    # v31), at least one per width
    assert sass["STSM"] >= len(config.widths), where
    # wgmma groups stay pipelined (one left in flight per wait), not serialized by ptxas
    if expect["pipelined"]:
        assert sass["WGDEP1"] > 0, where
    assert sass["EARLYREL"] == 0, where  # every stage released after its loaded words are used (r43c)
    assert sass["UTCOMMA"] == 0, where  # no Blackwell instruction leaked in
    assert sass["PR2UR"] == 0, where  # no R2UR under a lane predicate: illegal on sm_90a (eval.py's NOTES)
    assert sass["PREEXIT"] == sass["ACQBULK"] == int(PDL_ON), where  # programmatic dependent launch
    if expect["no_spills"]:
        assert sass["LDL"] == 0 and sass["STL"] == 0, where
    # the consumers' forms (docs/HOPPER_NOTES.md v34, v35): a row's two B scales in one 16-bit load, the
    # second taken as a broadcast half; the chunk loop's body twice and once more for an odd count (8
    # wgmmas a chunk, per width). The M-exact builds' producer (v33): the next part's work-list entry
    # prefetched into L1, its group's descriptors into the descriptor cache.
    assert sass["LDS16"] > 0 and sass["HBCAST1"] > 0, where
    assert sass["HGMMA"] == 3 * 8 * len(config.widths), where
    if config.m_exact:
        assert sass["PFL1"] > 0 and sass["TMAPF"] > 0, where
    # the GEMM writes C by TMA only (descriptors are prepared by GroupTensormapKernel); plain global stores
    # only where the launch converts A itself (a16_fused: the fp16 A and the grid barrier's two words)
    if config.a16_prepass and config.a16_fused:
        assert sass["STG"] > 0, where
    else:
        assert sass["STG"] == 0, where


# The frame of a build script for `_sm90_build_sass`: the project on sys.path (argv[1]), then BUILD_BODY, which
# defines build() (from the rest of argv), then BUILD_OK.
_SM90_SCRIPT_FRAME = r"""
import sys
sys.path.insert(0, sys.argv[1])
import submission
import submission_sm90
BUILD_BODY
try:
    build()
except Exception as err:  # 4.3.x without a driver: the cubin is written, then loading it fails
    if "CudaDriverDependencyError" not in repr(err) and "CUDA Driver Dependency" not in str(err):
        raise
print("BUILD_OK")
"""


def _sm90_script(body: str) -> str:
    return _SM90_SCRIPT_FRAME.replace("BUILD_BODY", body)


# argv[2] a part of the two-launch config (the A conversion as its own launch, so both parts exist)
_SM90_BUILD_SCRIPT = _sm90_script("""
sys.path.insert(0, sys.argv[1] + "/tests")
from conftest import sm90_changed_config
config = sm90_changed_config("two_launch")

def build():
    submission.compiled_kernel(submission.compile_key(2, "sm_90a", config, sys.argv[2]))
""")


def _sm90_build_sass(tmp_path, name: str, script: str, *args: str) -> str:
    """The SASS of kernel `name`, built for sm_90a by `script` (`_SM90_BUILD_SCRIPT`: a part) in a process of its
    own (DSL 4.3.x without a driver stops after its first build)."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(tmp_path), CUTE_DSL_KEEP_CUBIN="1",
               CUTE_DSL_KEEP="cubin", CUTE_DSL_DISABLE_FILE_CACHING="1")
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT), *args], env=env,
                          capture_output=True, text=True, timeout=900)
    assert "BUILD_OK" in proc.stdout, proc.stderr[-3000:]
    cubins = sorted(tmp_path.rglob(f"*{name}*.cubin"))
    assert cubins, list(tmp_path.rglob("*"))
    return subprocess.run([ev.find_cuobjdump(), "-sass", str(cubins[-1])], capture_output=True, text=True).stdout


# The Hopper kernels other than the GEMM: the shared descriptor preparation (every input set) and the A prepass
# (every call of the a16 variants).
@pytest.mark.parametrize("part, name, sass_ops", [("tensormaps", "GroupTensormapKernel", ()),
                                                  ("convert", "Sm90AConvertKernel", ("LDG", "STG.E.128"))])
def test_sm90a_auxiliary_kernels_build(tmp_path, part, name, sass_ops):
    sass = _sm90_build_sass(tmp_path, name, _SM90_BUILD_SCRIPT, part)
    assert "HGMMA" not in sass and "EXIT" in sass, sass[-2000:]
    for op in sass_ops:
        assert op in sass, (op, sass[-2000:])


def test_compile_reports_a_bad_case_file(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("m: [64]; n: [128]; k: 256; g: 1\n")
    proc = subprocess.run([sys.executable, str(ROOT / "eval.py"), "compile", str(bad)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "lacks seed" in proc.stderr


_UPLOAD_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import submission
try:  # one build for every group count (compile_key)
    submission.compiled_kernel(submission.compile_key(1, sys.argv[2], submission.TABLE_UPLOAD_CONFIG, "upload"))
except Exception as err:  # 4.3.x without a driver: the cubin is written, then loading it fails
    if "CudaDriverDependencyError" not in repr(err) and "CUDA Driver Dependency" not in str(err):
        raise
print("UPLOAD_OK")
"""


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_table_upload_kernel_builds(tmp_path, arch):
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_DUMP_DIR=str(tmp_path), CUTE_DSL_KEEP_CUBIN="1",
               CUTE_DSL_KEEP="cubin", CUTE_DSL_DISABLE_FILE_CACHING="1")
    proc = subprocess.run([sys.executable, "-c", _UPLOAD_SCRIPT, str(ROOT), arch], env=env, capture_output=True,
                          text=True, timeout=900)
    assert "UPLOAD_OK" in proc.stdout, proc.stderr[-3000:]
    cubins = sorted(tmp_path.rglob("*TableUploadKernel*.cubin"))
    assert cubins, list(tmp_path.rglob("*"))
    sass = subprocess.run([ev.find_cuobjdump(), "-sass", str(cubins[-1])], capture_output=True, text=True).stdout
    # one 64-bit load from the pinned staging copy and one store to the device tables per word
    assert "LDG.E.64" in sass and "STG.E.64" in sass, sass[-2000:]


# ---------------------------------------------------------------------------------------------------------
# TMA descriptor bit 85 (submission.clear_oob_128k_bit): cleared in every descriptor a B200 kernel stages and
# releases, never in a Hopper one; and no B200 kernel hands a TMA instruction a host-made descriptor straight
# from its parameters (it would escape the clear). Read from the PTX the DSL installed here generates.
# ---------------------------------------------------------------------------------------------------------
# Bit 85 of the 128-byte descriptor: bit 21 of its 64-bit word 1 (NVIDIA driver 595.71.05 release notes).
TENSORMAP_BYTES = 128
BIT85_WORD_OFFSET = 85 // 64 * 8
BIT85_CLEAR_MASK = ~(1 << (85 % 64))

_PTX_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import submission
arch, variant, part = sys.argv[2:5]
configs = submission.backend_for_arch(arch).variant_configs
try:
    submission.compiled_kernel(submission.compile_key(2, arch, configs[variant], part))
except Exception as err:  # 4.3.x without a driver: the PTX is written, then loading it fails
    if "CudaDriverDependencyError" not in repr(err) and "CUDA Driver Dependency" not in str(err):
        raise
print("PTX_OK")
"""


def _kernel_ptx(tmp_path, arch: str, variant: str, part: str, name: str) -> str:
    """The PTX of one kernel (G = 2), built in a fresh process with the DSL asked to keep it."""
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_DUMP_DIR=str(tmp_path), CUTE_DSL_KEEP_PTX="1",
               CUTE_DSL_KEEP="ptx", CUTE_DSL_DISABLE_FILE_CACHING="1")
    proc = subprocess.run([sys.executable, "-c", _PTX_SCRIPT, str(ROOT), arch, variant, part], env=env,
                          capture_output=True, text=True, timeout=900)
    assert "PTX_OK" in proc.stdout, proc.stderr[-3000:]
    found = sorted(tmp_path.rglob(f"*{name}*.ptx"))
    assert found, list(tmp_path.rglob("*"))
    return found[-1].read_text(errors="replace").replace("\x00", "")


def bit85_clears(ptx: str) -> list:
    """(line index, shared-memory byte offset) of every `ld.shared 64-bit; and.b64 with ~(1 << 21); st.shared
    64-bit` back to the same address: a descriptor's word 1 loaded, bit 21 cleared, stored back."""
    lines = [line.strip() for line in ptx.splitlines()]
    load = re.compile(r"ld\.shared\.[bu]64\s+(%rd\d+),\s*\[([^\]]+)\];")
    store = re.compile(r"st\.shared\.[bu]64\s+\[([^\]]+)\],\s*(%rd\d+);")
    found = []
    for i, line in enumerate(lines):
        match = re.fullmatch(r"and\.b64\s+(%rd\d+),\s*(%rd\d+),\s*(-?\d+);", line)
        if not match or int(match[3]) != BIT85_CLEAR_MASK:
            continue
        loads = [load.fullmatch(x) for x in lines[max(0, i - 3):i]]
        stores = [store.fullmatch(x) for x in lines[i + 1:i + 4]]
        address = next((m[2] for m in loads if m and m[1] == match[2]), None)
        stored = next((m[1] for m in stores if m and m[2] == match[1]), None)
        if address is not None and address == stored:
            offset = re.search(r"\+(\d+)$", address)
            found.append((i, int(offset[1]) if offset else 0))
    return found


def descriptor_stagings(ptx: str) -> list:
    """(line index, 128-byte parameter, its byte offset, shared-memory byte offset) of every 16-byte piece of a
    host-made TMA descriptor (a 128-byte kernel parameter) stored into shared memory: `ld.param.v2` 64-bit of
    the parameter (by name or through a register holding its address), then `st.shared.v2` of both words."""
    names = set(re.findall(r"\.param\s+\.align\s+\d+\s+\.b8\s+(\w+)\[128\]", ptx))
    holders, loaded, found = {}, {}, []
    for i, line in enumerate(line.strip() for line in ptx.splitlines()):
        taken = re.fullmatch(r"mov\.[bu]64\s+(%rd\d+),\s*(\w+);", line)
        if taken and taken[2] in names:
            holders[taken[1]] = taken[2]
            continue
        load = re.fullmatch(r"ld\.param\.v2\.[bu]64\s+\{(%rd\d+),\s*(%rd\d+)\},\s*\[([%\w]+)(?:\+(\d+))?\];", line)
        if load:
            param = holders.get(load[3], load[3])
            if param in names:
                loaded[(load[1], load[2])] = (param, int(load[4] or 0))
            continue
        store = re.fullmatch(r"st\.shared\.v2\.[bu]64\s+\[([%\w]+)(?:\+(\d+))?\],\s*\{(%rd\d+),\s*(%rd\d+)\};", line)
        if store and (store[3], store[4]) in loaded:
            found.append((i, *loaded[(store[3], store[4])], int(store[2] or 0)))
    return found


def descriptor_params_used_directly(ptx: str) -> list:
    """Uses of a 128-byte kernel parameter (a host-made TMA descriptor) other than reading it with ld.param
    (to copy it into shared memory): what a TMA instruction given the parameter itself would show."""
    names = set(re.findall(r"\.param\s+\.align\s+\d+\s+\.b8\s+(\w+)\[128\]", ptx))
    holders = {}
    uses = []
    for line in (line.strip() for line in ptx.splitlines()):
        if line.startswith(".param") or line.startswith("//"):
            continue
        taken = re.fullmatch(r"mov\.[bu]64\s+(%rd\d+),\s*(\w+);", line)
        if taken and taken[2] in names:
            holders[taken[1]] = taken[2]
            continue
        for name in names:
            if name in line and not line.startswith("ld.param"):
                uses.append(line)
        for register in holders:
            if re.search(rf"{re.escape(register)}\b", line) and not re.match(
                    rf"ld\.param\.\S+\s+.*\[{re.escape(register)}(\+\d+)?\];", line):
                uses.append(line)
    return uses


@pytest.mark.parametrize("variant, part, name, slots", [
    ("persistent", "tensormaps", "GroupTensormapKernel", 5),  # A, B, SFA, SFB, C of each group
    ("seed", "gemm", "Sm100BlockScaledGroupedGemmKernel", 4),  # A, B, SFA, SFB of each tile
])
def test_sm100a_descriptors_are_released_with_bit_85_clear(tmp_path, variant, part, name, slots):
    ptx = _kernel_ptx(tmp_path, "sm_100a", variant, part, name)
    clears = bit85_clears(ptx)
    # word 1 of every staged descriptor (128 bytes apart from the start of the kernel's shared memory)
    assert sorted(offset for _, offset in clears) == [BIT85_WORD_OFFSET + 128 * s for s in range(slots)], clears
    lines = [line.strip() for line in ptx.splitlines()]
    first = {op: next(i for i, line in enumerate(lines) if line.startswith(op))
             for op in ("tensormap.replace", "tensormap.cp_fenceproxy")}
    last_staging_store = max(i for i, line in enumerate(lines) if line.startswith("st.shared.v2"))
    # after the templates are staged, before they are patched and released
    assert all(last_staging_store < i < min(first.values()) for i, _ in clears), (clears, first, last_staging_store)
    i = clears[0][0]
    print(f"{variant} {part}: " + " ".join(lines[i - 1:i + 2]) + f" (and {len(clears) - 1} more descriptors)")


# Regression: DSL 4.5.2 and 4.8.1 stage only bytes 0-63 of each template (TensorMapManager.init_tensormap_from_atom),
# so bytes 64-127 of every published descriptor were whatever shared memory held (4.3.5 staged all 128).
@pytest.mark.parametrize("arch, variant, part, name, slots", [
    ("sm_100a", "persistent", "tensormaps", "GroupTensormapKernel", 5),
    ("sm_100a", "seed", "gemm", "Sm100BlockScaledGroupedGemmKernel", 4),
    ("sm_90a", "sm90_a16_mexact", "tensormaps", "GroupTensormapKernel", 3),  # A, B, C
])
def test_descriptors_are_staged_whole(tmp_path, arch, variant, part, name, slots):
    ptx = _kernel_ptx(tmp_path, arch, variant, part, name)
    stagings = descriptor_stagings(ptx)
    by_slot = {}
    for _, param, src, dst in stagings:
        by_slot.setdefault(dst // TENSORMAP_BYTES, set()).add((param, src, dst % TENSORMAP_BYTES))
    # every slot gets all 128 bytes of one template, each 16 bytes from the same offset; one template per slot
    assert sorted(by_slot) == list(range(slots)), stagings
    for slot, pieces in by_slot.items():
        assert len({param for param, _, _ in pieces}) == 1, (slot, pieces)
        assert sorted((src, dst) for _, src, dst in pieces) == [(o, o) for o in range(0, TENSORMAP_BYTES, 16)], pieces
    assert len({next(iter(pieces))[0] for pieces in by_slot.values()}) == slots
    # all of it before the bit-85 clears (Blackwell), the patching and the release
    lines = [line.strip() for line in ptx.splitlines()]
    after = [i for i, line in enumerate(lines) if line.startswith(("tensormap.replace", "tensormap.cp_fenceproxy"))]
    after += [i for i, _ in bit85_clears(ptx)]
    assert max(i for i, *_ in stagings) < min(after), (stagings[-1], min(after))
    print(f"{arch} {variant} {part}: {len(stagings)} x ld.param.v2 -> st.shared.v2, {slots} x 128 bytes")


@pytest.mark.parametrize("variant", tuple(submission_sm90.SM90_VARIANT_CONFIGS) if submission_sm90 else ())
def test_sm90a_descriptors_keep_bit_85(tmp_path, variant):
    ptx = _kernel_ptx(tmp_path, "sm_90a", variant, "tensormaps", "GroupTensormapKernel")
    assert "tensormap.cp_fenceproxy" in ptx and "tensormap.replace" in ptx  # the preparation kernel it is
    assert bit85_clears(ptx) == [] and str(BIT85_CLEAR_MASK) not in ptx


@pytest.mark.parametrize("variant, part, name", [
    ("persistent", "gemm", "Sm100PersistentGroupedGemmKernel"),
    ("persistent", "tensormaps", "GroupTensormapKernel"),
    ("seed", "gemm", "Sm100BlockScaledGroupedGemmKernel"),
])
def test_sm100a_tma_uses_no_descriptor_from_the_parameters(tmp_path, variant, part, name):
    ptx = _kernel_ptx(tmp_path, "sm_100a", variant, part, name)
    assert "cp.async.bulk.tensor" in ptx or "tensormap.cp_fenceproxy" in ptx
    assert descriptor_params_used_directly(ptx) == []


def test_ptx_readers_see_what_they_look_for():
    # The readers above on hand-written PTX: a clear they must find, its near misses, and a direct use.
    ptx = "\n".join([
        ".param .align 64 .b8 k_param_0[128],",
        "mov.b64 %rd1, k_param_0;",
        "ld.param.v2.b64 {%rd2, %rd3}, [%rd1+16];",
        "st.shared.v2.b64 [%r1+16], {%rd2, %rd3};",
        "ld.shared.b64 %rd4, [%r1+136];",
        f"and.b64 %rd5, %rd4, {BIT85_CLEAR_MASK};",
        "st.shared.b64 [%r1+136], %rd5;",
        "ld.shared.b64 %rd6, [%r1+8];",
        f"and.b64 %rd7, %rd6, {~(1 << 20)};",  # another bit
        "st.shared.b64 [%r1+8], %rd7;",
        "ld.shared.u64 %rd8, [__dynamic_shmem__0+264];",
        f"and.b64  %rd9, %rd8, {BIT85_CLEAR_MASK};",
        "st.shared.u64 [__dynamic_shmem__0+272], %rd9;",  # stored elsewhere
    ])
    assert [offset for _, offset in bit85_clears(ptx)] == [136]
    assert BIT85_CLEAR_MASK == -2097153 and BIT85_WORD_OFFSET == 8
    assert descriptor_params_used_directly(ptx) == []
    # one 16-byte piece staged (+16 -> +16), one through the parameter's name (+32 -> +160), one not from a
    # descriptor (a register loaded elsewhere)
    staged = ptx + "\n" + "\n".join([
        "ld.param.v2.u64 {%rd10, %rd11}, [k_param_0+32];",
        "st.shared.v2.u64 [__dynamic_shmem__0+160], {%rd10, %rd11};",
        "st.shared.v2.u64 [__dynamic_shmem__0+176], {%rd2, %rd9};",
    ])
    pieces = [(param, src, dst) for _, param, src, dst in descriptor_stagings(staged)]
    assert pieces == [("k_param_0", 16, 16), ("k_param_0", 32, 160)]
    direct = ptx + "\ncp.async.bulk.tensor.2d.shared::cta.global.tile [%r2], [%rd1, {%r3, %r4}], [%r5];"
    assert descriptor_params_used_directly(direct) == [direct.splitlines()[-1]]
    assert descriptor_params_used_directly(ptx + "\nprefetch.tensormap [k_param_0];") != []
