"""Device helpers of the MoE layer's stage kernels (routing, quantization, activation, combine): inline PTX with
the rounding of every fp32 operation pinned, so that a kernel's result is the torch stage's bit for bit where the
stage is exact (quantization, combine), and the conversions the stages need (bf16, e4m3, e2m1).

Why inline PTX for plain arithmetic: the compiler may contract a product and a sum into one FMA (one rounding
instead of two) and may take an approximate division; `mul.rn` / `add.rn` / `div.rn` are never contracted or
approximated, which is what the torch statements of the stages compute (each operation correctly rounded).

Nothing here is arch-specific beyond sm_89 (`cvt.rn.satfinite.e4m3x2.f32`, `cvt.rn.f16x2.e4m3x2`): the same
kernels build for sm_90a and sm_100a, so the Hopper runs test what a B200 runs.
"""
import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

import submission_sm90 as sm90

_asm, _u32, _i64 = sm90._asm, sm90._u32, sm90._i64
ld_global_v4, st_global_v4, st_global_u32 = sm90.ld_global_v4, sm90.st_global_v4, sm90.st_global_u32
warp_inclusive_sum = sm90.warp_inclusive_sum


def _f32(x, loc, ip):
    return cutlass.Float32(x).ir_value(loc=loc, ip=ip)


def _f32_op(ptx: str, operands: list, loc, ip):
    r = _asm(T.f32(), operands, ptx, ",".join(["=f"] + ["f"] * len(operands)), False, loc, ip)
    return cutlass.Float32(r)


@dsl_user_op
def mul_rn(a, b, *, loc=None, ip=None):
    """a * b in fp32, rounded to nearest even, never contracted into an FMA."""
    return _f32_op("mul.rn.f32 $0, $1, $2;", [_f32(a, loc, ip), _f32(b, loc, ip)], loc, ip)


@dsl_user_op
def add_rn(a, b, *, loc=None, ip=None):
    """a + b in fp32, rounded to nearest even, never contracted."""
    return _f32_op("add.rn.f32 $0, $1, $2;", [_f32(a, loc, ip), _f32(b, loc, ip)], loc, ip)


@dsl_user_op
def div_rn(a, b, *, loc=None, ip=None):
    """a / b in fp32, IEEE (correctly rounded), as torch's division."""
    return _f32_op("div.rn.f32 $0, $1, $2;", [_f32(a, loc, ip), _f32(b, loc, ip)], loc, ip)


@dsl_user_op
def max_abs(a, b, *, loc=None, ip=None):
    """max(a, |b|) for a >= 0 (a running amax)."""
    return _f32_op("{\n.reg .f32 t;\nabs.f32 t, $2;\nmax.f32 $0, $1, t;\n}", [_f32(a, loc, ip), _f32(b, loc, ip)],
                   loc, ip)


@dsl_user_op
def min_f32(a, b, *, loc=None, ip=None):
    return _f32_op("min.f32 $0, $1, $2;", [_f32(a, loc, ip), _f32(b, loc, ip)], loc, ip)


@dsl_user_op
def select_f32(cond, a, b, *, loc=None, ip=None):
    """a where the int `cond` is nonzero, else b: a select, never arithmetic (b is taken as it is, a NaN in a
    never reaches the result)."""
    r = _asm(T.f32(), [sm90._i32(cond, loc, ip), _f32(a, loc, ip), _f32(b, loc, ip)],
             "{\n.reg .pred p;\nsetp.ne.s32 p, $1, 0;\nselp.f32 $0, $2, $3, p;\n}", "=f,r,f,f", False, loc, ip)
    return cutlass.Float32(r)


@dsl_user_op
def silu(x, *, loc=None, ip=None):
    """x / (1 + exp(-x)) in fp32 (torch's silu statement): exp by ex2.approx of -x log2(e) (within 2 ulp of
    expf), the sum and the division correctly rounded. -x large gives exp = inf and x / inf = -0, as torch."""
    return _f32_op("{\n.reg .f32 t;\nmul.rn.f32 t, $1, 0fBFB8AA3B;\nex2.approx.f32 t, t;\nadd.rn.f32 t, t, 0f3F800000;\n"
                   "div.rn.f32 $0, $1, t;\n}", [_f32(x, loc, ip)], loc, ip)


@dsl_user_op
def bf16x2_to_f32(word, *, loc=None, ip=None):
    """(low, high) halves of a word of two bf16 values, widened to fp32 (exact)."""
    r = _asm(llvm.StructType.get_literal([T.f32()] * 2), [_u32(word, loc, ip)],
             "{\n.reg .b32 lo, hi;\nshl.b32 lo, $2, 16;\nand.b32 hi, $2, 0xFFFF0000;\nmov.b32 $0, lo;\n"
             "mov.b32 $1, hi;\n}", "=f,=f,r", False, loc, ip)
    return [cutlass.Float32(llvm.extractvalue(T.f32(), r, [i], loc=loc, ip=ip)) for i in range(2)]


@dsl_user_op
def f16x2_to_f32(word, *, loc=None, ip=None):
    """(low, high) halves of a word of two fp16 values, widened to fp32 (exact)."""
    r = _asm(llvm.StructType.get_literal([T.f32()] * 2), [_u32(word, loc, ip)],
             "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\ncvt.f32.f16 $0, lo;\ncvt.f32.f16 $1, hi;\n}",
             "=f,=f,r", False, loc, ip)
    return [cutlass.Float32(llvm.extractvalue(T.f32(), r, [i], loc=loc, ip=ip)) for i in range(2)]


@dsl_user_op
def f32x2_to_bf16x2(lo, hi, *, loc=None, ip=None):
    """Two fp32 values rounded to bf16 (nearest even), `lo` in the low half."""
    r = _asm(T.i32(), [_f32(lo, loc, ip), _f32(hi, loc, ip)], "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", False,
             loc, ip)
    return cutlass.Uint32(r)


@dsl_user_op
def to_e4m3(x, *, loc=None, ip=None):
    """fp32 x >= 0 as an e4m3 byte: nearest even, saturated to 448 (torch's float8_e4m3fn of x clamped to 448)."""
    r = _asm(T.i32(), [_f32(x, loc, ip)],
             "{\n.reg .b16 h;\n.reg .f32 z;\nmov.f32 z, 0f00000000;\ncvt.rn.satfinite.e4m3x2.f32 h, z, $1;\n"
             "cvt.u32.u16 $0, h;\n}", "=r,f", False, loc, ip)
    return cutlass.Uint32(r)


@dsl_user_op
def e4m3_to_f32(byte, *, loc=None, ip=None):
    """An e4m3 byte (the low 8 bits of `byte`) widened to fp32 (exact)."""
    r = _asm(T.f32(), [_u32(byte, loc, ip)],
             "{\n.reg .b16 lo, hi, c;\n.reg .b32 x;\nmov.b32 {lo, hi}, $1;\ncvt.rn.f16x2.e4m3x2 x, lo;\n"
             "mov.b32 {c, hi}, x;\ncvt.f32.f16 $0, c;\n}", "=f,r", False, loc, ip)
    return cutlass.Float32(r)


@dsl_user_op
def e2m1x8(values, *, loc=None, ip=None):
    """Eight fp32 values as eight e2m1 codes in one word, value i in nibble i: nearest even on the grid
    {0, 0.5, 1, 1.5, 2, 3, 4, 6}, |v| > 6 saturated, the sign bit kept (also of a zero). The code of |v| is the
    number of rounding boundaries it passes, >= for those that round up to an even code (0.75, 1.75, 3.5), > for
    those that round down to one (0.25, 1.25, 2.5, 5): `quantize.e2m1_codes`' statement, comparison for
    comparison (set.* gives all ones for true, so the code is minus their sum)."""
    assert len(values) == 8
    ptx = "{\n.reg .f32 m;\n.reg .b32 c, t, s, w;\nmov.b32 w, 0;\n"
    bounds = (("ge", "3F400000"), ("ge", "3FE00000"), ("ge", "40600000"),
              ("gt", "3E800000"), ("gt", "3FA00000"), ("gt", "40200000"), ("gt", "40A00000"))
    for i in range(8):
        ptx += f"abs.f32 m, ${i + 1};\nmov.b32 c, 0;\n"
        for op, bits in bounds:
            ptx += f"set.{op}.u32.f32 t, m, 0f{bits};\nsub.u32 c, c, t;\n"
        ptx += f"mov.b32 s, ${i + 1};\nshr.u32 s, s, 31;\nshl.b32 s, s, 3;\nor.b32 c, c, s;\n"
        ptx += f"shl.b32 c, c, {4 * i};\nor.b32 w, w, c;\n"
    ptx += "mov.b32 $0, w;\n}"
    r = _asm(T.i32(), [_f32(v, loc, ip) for v in values], ptx, ",".join(["=r"] + ["f"] * 8), False, loc, ip)
    return cutlass.Uint32(r)


@dsl_user_op
def atomic_add_shared(addr, value, *, loc=None, ip=None):
    """atomicAdd on a 32-bit word of shared memory at `addr`: the old value."""
    r = _asm(T.i32(), [sm90._i32(addr, loc, ip), sm90._i32(value, loc, ip)], "atom.shared.add.u32 $0, [$1], $2;",
             "=r,r,r,~{memory}", True, loc, ip)
    return cutlass.Int32(r)


@dsl_user_op
def st_global_v2(addr, v0, v1, *, loc=None, ip=None):
    _asm(None, [_i64(addr, loc, ip), _u32(v0, loc, ip), _u32(v1, loc, ip)], "st.global.v2.b32 [$0], {$1, $2};",
         "l,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def st_global_u8(addr, v, *, loc=None, ip=None):
    _asm(None, [_i64(addr, loc, ip), _u32(v, loc, ip)], "st.global.u8 [$0], $1;", "l,r,~{memory}", True, loc, ip)


@dsl_user_op
def ld_global_v2(addr, *, loc=None, ip=None):
    """Two 32-bit words of read-only global memory (8-byte aligned)."""
    r = _asm(llvm.StructType.get_literal([T.i32()] * 2), [_i64(addr, loc, ip)],
             "ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l", False, loc, ip)
    return [cutlass.Uint32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(2)]


@dsl_user_op
def ld_global_u8(addr, *, loc=None, ip=None):
    r = _asm(T.i32(), [_i64(addr, loc, ip)], "ld.global.nc.u8 $0, [$1];", "=r,l", False, loc, ip)
    return cutlass.Uint32(r)


@dsl_user_op
def ld_global_s32(addr, *, loc=None, ip=None):
    """A 32-bit word of global memory that this launch may have written (a plain load: program order holds)."""
    r = _asm(T.i32(), [_i64(addr, loc, ip)], "ld.global.b32 $0, [$1];", "=r,l,~{memory}", True, loc, ip)
    return cutlass.Int32(r)


@dsl_user_op
def ld_global_nc_s32(addr, *, loc=None, ip=None):
    """A 32-bit word of read-only global memory (an input of the launch), signed: `sm90.ld_global_u32`'s load."""
    return cutlass.Int32(sm90.ld_global_u32(addr, loc=loc, ip=ip))


@dsl_user_op
def ld_global_nc_id(addr, wide: bool, *, loc=None, ip=None):
    """An expert id of `topk_ids` (int32, or int64 with `wide`) as an Int32: an int64 outside the int32 range
    becomes -1 (an invalid id either way)."""
    if not wide:
        return ld_global_nc_s32(addr, loc=loc, ip=ip)
    r = _asm(T.i32(), [_i64(addr, loc, ip)],
             "{\n.reg .s64 v, w;\n.reg .pred p;\nld.global.nc.s64 v, [$1];\ncvt.s32.s64 $0, v;\ncvt.s64.s32 w, $0;\n"
             "setp.ne.s64 p, w, v;\n@p mov.s32 $0, -1;\n}", "=r,l", False, loc, ip)
    return cutlass.Int32(r)


@dsl_user_op
def ld_global_nc_f32(addr, *, loc=None, ip=None):
    r = _asm(T.f32(), [_i64(addr, loc, ip)], "ld.global.nc.f32 $0, [$1];", "=f,l", False, loc, ip)
    return cutlass.Float32(r)


@dsl_user_op
def ld_global_nc_u16(addr, *, loc=None, ip=None):
    r = _asm(T.i32(), [_i64(addr, loc, ip)], "ld.global.nc.u16 $0, [$1];", "=r,l", False, loc, ip)
    return cutlass.Uint32(r)


@dsl_user_op
def st_global_s32(addr, v, *, loc=None, ip=None):
    """A signed 32-bit word to global memory: `sm90.st_global_u32`'s store of the same bits."""
    sm90.st_global_u32(addr, cutlass.Uint32(cutlass.Int32(v)), loc=loc, ip=ip)


WEIGHT_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


@dsl_user_op
def round_bf16(x, *, loc=None, ip=None):
    """fp32 x rounded to bf16 (nearest even) and widened back (exact): the value a bf16 tensor stores."""
    return _f32_op(("{\n.reg .b16 h, z;\n.reg .b32 r;\ncvt.rn.bf16.f32 h, $1;\nmov.b16 z, 0;\nmov.b32 r, {z, h};\n"
                    "mov.b32 $0, r;\n}"), [_f32(x, loc, ip)], loc, ip)


@cute.jit
def load_f32_weight(addr, dtype: cutlass.Constexpr[str]):
    """One router weight at `addr` as fp32: dtype "f32", "bf16" or "f16" (exact widening)."""
    result = cutlass.Float32(0.0)
    if cutlass.const_expr(dtype == "f32"):
        result = ld_global_nc_f32(addr)
    elif cutlass.const_expr(dtype == "bf16"):
        result = bf16x2_to_f32(ld_global_nc_u16(addr))[0]
    else:
        result = f16x2_to_f32(ld_global_nc_u16(addr))[0]
    return result


@cute.jit
def quantize16(values: list, gs):
    """NVFP4 of one block of 16 fp32 values (16-bit values widened) with global scale gs, `quantize.quantize_nvfp4`'s
    statement operation for operation: (scale byte, codes word 0, codes word 1)."""
    amax = cutlass.Float32(0.0)
    for i in cutlass.range_constexpr(len(values)):
        amax = max_abs(amax, values[i])
    sf_value = min_f32(mul_rn(gs, mul_rn(amax, cutlass.Float32(1.0 / 6.0))), cutlass.Float32(448.0))
    sf = to_e4m3(sf_value)
    sf32 = e4m3_to_f32(sf)
    inverse = div_rn(cutlass.Float32(1.0), mul_rn(sf32, div_rn(cutlass.Float32(1.0), gs)))
    out_scale = select_f32(cutlass.Int32(sf != 0), inverse, cutlass.Float32(0.0))
    scaled = [mul_rn(v, out_scale) for v in values]
    return sf, e2m1x8(scaled[:8]), e2m1x8(scaled[8:])


@cute.jit
def load_bf16x16(addr):
    """16 bf16 values at `addr` (32 bytes, 16-byte aligned) widened to fp32, in order."""
    values = []
    for half in cutlass.range_constexpr(2):
        words = ld_global_v4(addr + 16 * half)
        for i in cutlass.range_constexpr(4):
            values.extend(bf16x2_to_f32(words[i]))
    return values


@cute.jit
def store_words(addr, words: list):
    """Eight 32-bit words to `addr` (16-byte aligned): two 128-bit stores."""
    st_global_v4(addr, words[0], words[1], words[2], words[3])
    st_global_v4(addr + 16, words[4], words[5], words[6], words[7])


@cute.jit
def store_nvfp4_block(codes, scales, row, width: cutlass.Constexpr[int], b, sf, w0, w1):
    """Block b (16 values) of `row` of an NVFP4 matrix `width` values wide: its two words of codes ([rows, width/2])
    and its scale byte (row-major [rows, width/16])."""
    st_global_v2(codes + cutlass.Int64(row) * (width // 2) + 8 * b, w0, w1)
    st_global_u8(scales + cutlass.Int64(row) * (width // 16) + b, sf)


@cute.jit
def expert_global_scale(global_scale, row_expert, row):
    """The fp32 global scale (of `global_scale` [E]) of the expert that `row` belongs to (`row_expert`)."""
    expert = ld_global_nc_s32(row_expert + 4 * cutlass.Int64(row))
    return ld_global_nc_f32(global_scale + 4 * cutlass.Int64(expert))
