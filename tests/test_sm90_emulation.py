"""CPU emulation of the sm90 kernel's per-thread index math and bit tricks (no GPU, no DSL needed).

Checks, for one 128-k chunk of a 128 x 128 tile, that
  * the e2m1 -> fp16 and e4m3 -> fp16 bit tricks are exact for every code,
  * the A side (fp16 buffer written by the consumers, read through the wgmma SW128 K-major layout) and
    the B side (register fragment, wgmma A-operand thread/value layout) use the same k permutation,
so that sum_k Alog[m, k] * Blog[n, k] * 2^21 equals the exact dequantized product for the chunk (A's scales
times 2^7, B's as they are: a consumer thread's two scale bytes of a row in one 16-bit load and one conversion,
each multiplied as a broadcast half).
It mirrors the constants and formulas of submission_sm90.py's helpers (scale_to_f16x2, scale_pair_to_f16x2,
fp4x8_to_f16x2x4, their bf16 forms for W4A16, the transform and consumer index math): change both together.
"""
import numpy as np
import pytest
import torch

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
M32 = 0xFFFFFFFF


def f16x2_mul(a, b):
    lo = (np.array([a & 0xFFFF], np.uint16).view(np.float16) * np.array([b & 0xFFFF], np.uint16).view(np.float16))
    hi = (np.array([a >> 16], np.uint16).view(np.float16) * np.array([b >> 16], np.uint16).view(np.float16))
    return int(lo.view(np.uint16)[0]) | (int(hi.view(np.uint16)[0]) << 16)


def prmt(a, b, sel):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for k in range(4):
        s = (sel >> (4 * k)) & 0xF
        byte = src[s & 7]
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * k)
    return out


E4M3_AS_F16 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16)


def scale_to_f16x2(word, sel):
    # prmt puts the chosen byte into both bytes of the low half; the hardware e4m3x2 -> f16x2 conversion
    # (here torch's e4m3 -> fp16 cast, an independent decode), then the product with 2^7
    x = prmt(word, 0, sel)
    lo, hi = (int(E4M3_AS_F16[x & 0xFF]) & 0xFFFF, int(E4M3_AS_F16[(x >> 8) & 0xFF]) & 0xFFFF)
    return f16x2_mul(lo | (hi << 16), 0x58005800)


def scale_pair_to_f16x2(pair):
    # the two bytes of the low 16 bits, each widened by the hardware e4m3 -> fp16 conversion (torch's cast here),
    # byte 0 into the low half; nothing else
    return (int(E4M3_AS_F16[pair & 0xFF]) & 0xFFFF) | ((int(E4M3_AS_F16[(pair >> 8) & 0xFF]) & 0xFFFF) << 16)


def broadcast(sc, half):
    h = (sc >> (16 * half)) & 0xFFFF  # the HMUL2 operand's .H0_H0 / .H1_H1
    return h | (h << 16)


def lop3_or_and(a, b, c):
    return (a | b) & c  # lop3.b32 with LUT 0xA8


def fp4x8_to_f16x2x4(w, sc, half=None):
    if half == "split":  # W4A16: registers 0, 1 by half 0 of the pair, registers 2, 3 by half 1
        lo, hi = fp4x8_to_f16x2x4(w, sc, 0), fp4x8_to_f16x2x4(w, sc, 1)
        return lo[:2] + hi[2:]
    sc = sc if half is None else broadcast(sc, half)
    u = w & 0xF0F0F0F0
    t = u >> 3
    lw = w & 0x0F0F0F0F
    a, b = (lw << 4) & M32, (lw << 1) & M32
    r3 = lop3_or_and(u, t, 0x8E008E00)
    r1 = (lop3_or_and(u, t, 0x008E008E) << 8) & M32
    r2 = lop3_or_and(a, b, 0x8E008E00)
    r0 = (lop3_or_and(a, b, 0x008E008E) << 8) & M32
    return [f16x2_mul(r, sc) for r in (r0, r1, r2, r3)]


def bf16_halves(u):
    return torch.tensor([u & 0xFFFF, u >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double().numpy()


def bf16_bits(values) -> int:
    h = torch.tensor(values, dtype=torch.float64).to(torch.bfloat16).view(torch.int16).int().numpy() & 0xFFFF
    return int(h[0]) | (int(h[1]) << 16)


def bf16x2_mul(a, b):
    # mul.rn.bf16x2 with subnormal operands kept: the float64 product (exact here) rounded to bf16
    return bf16_bits(bf16_halves(a) * bf16_halves(b))


def scale_pair_to_bf16x2(pair):
    # scale_pair_to_f16x2(..., bf16=True): the fp16 pair through fp32, times 2^112, to bf16x2
    return bf16_bits(halves(scale_pair_to_f16x2(pair)) * 2.0 ** 112)


def fp4x8_to_bf16x2x4(w, sc, half):
    # fp4x8_to_f16x2x4(..., bf16=True): each fp16 code h (bits 15, 11, 10, 9) to the bf16 code with the bits at
    # 15, 8, 7, 6 by one shift and one lop3 (LUT 0xE4: (h & c) | (t & ~c)), then the bf16 product
    if half == "split":
        lo, hi = fp4x8_to_bf16x2x4(w, sc, 0), fp4x8_to_bf16x2x4(w, sc, 1)
        return lo[:2] + hi[2:]
    sc = broadcast(sc, half)
    u = w & 0xF0F0F0F0
    t = u >> 3
    lw = w & 0x0F0F0F0F
    a, b = (lw << 4) & M32, (lw << 1) & M32
    codes = (lop3_or_and(a, b, 0x008E008E) << 8) & M32, (lop3_or_and(u, t, 0x008E008E) << 8) & M32, \
        lop3_or_and(a, b, 0x8E008E00), lop3_or_and(u, t, 0x8E008E00)
    c = 0x90009000
    return [bf16x2_mul((h & c) | ((h >> 3) & ~c & M32), sc) for h in codes]


def halves(u):
    return np.array([u & 0xFFFF, u >> 16], np.uint16).view(np.float16).astype(np.float64)


def check_bit_tricks():
    # every e4m3 code (NaN codes must give NaN)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    for v in range(256):
        for b in range(4):
            word = (v << (8 * b)) | (0x5A << (8 * ((b + 1) % 4)))
            got = halves(scale_to_f16x2(word, b * 0x11))
            want = e4m3[v] * 2.0 ** 7
            assert (np.isnan(want) and np.isnan(got).all()) or (got == want).all(), (v, b, got, want)
    # every pair of e2m1 codes with a range of scales
    rng = np.random.default_rng(0)
    for _ in range(2000):
        w = int(rng.integers(0, 2 ** 32))
        s = int(rng.integers(0, 256))
        if s & 0x7F == 0x7F:
            continue
        sc = scale_to_f16x2(s, 0x00)
        regs = fp4x8_to_f16x2x4(w, sc)
        for i in range(4):
            got = halves(regs[i])
            want = np.array([E2M1[(w >> (4 * i)) & 0xF], E2M1[(w >> (4 * (i + 4))) & 0xF]]) * e4m3[s] * 2.0 ** -7
            assert (got == want).all(), (hex(w), s, i, got, want)
    # the consumers' B scale pairs: every e4m3 code in either byte of the pair, and every e2m1 code times every scale, exact at
    # 2^-14 (fp16 subnormals included: v s 2^-14 is a multiple of 2^-24 below 2^-14)
    for v in range(256):
        pair = scale_pair_to_f16x2(v | (0x5A << 8))
        assert halves(pair)[1] == e4m3[0x5A]
        got = halves(scale_pair_to_f16x2((v << 8) | 0x5A))
        assert got[0] == e4m3[0x5A] and ((np.isnan(e4m3[v]) and np.isnan(got[1])) or got[1] == e4m3[v]), v
        if v & 0x7F == 0x7F:
            continue
        for code in range(16):
            word = code * 0x11111111  # the code in every nibble
            for half in range(2):
                sc = scale_pair_to_f16x2((v << (8 * half)) | (0x3C << (8 * (1 - half))))
                for reg in fp4x8_to_f16x2x4(word, sc, half):
                    assert (halves(reg) == E2M1[code] * e4m3[v] * 2.0 ** -14).all(), (code, v, half)
    print("bit tricks: exact for all e4m3 codes and random e2m1 words")


def check_bf16_bit_tricks():
    # W4A16 with bf16 A: every e2m1 code times every e4m3 code, in either half of the scale pair, is the product
    # times 2^-14 exactly (the fp16 path's encoding), e2m1 0.5 a bf16 subnormal before the product
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    for v in range(256):
        got = bf16_halves(scale_pair_to_bf16x2((v << 8) | 0x5A))
        assert got[0] == e4m3[0x5A] * 2.0 ** 112 and ((np.isnan(e4m3[v]) and np.isnan(got[1]))
                                                        or got[1] == e4m3[v] * 2.0 ** 112), v
        if v & 0x7F == 0x7F:
            continue
        for code in range(16):
            word = code * 0x11111111
            for half in range(2):
                sc = scale_pair_to_bf16x2((v << (8 * half)) | (0x3C << (8 * (1 - half))))
                for reg in fp4x8_to_bf16x2x4(word, sc, half):
                    assert (bf16_halves(reg) == E2M1[code] * e4m3[v] * 2.0 ** -14).all(), (code, v, half)
    # random words: the register order and the nibble pairing are the fp16 path's
    rng = np.random.default_rng(1)
    for _ in range(500):
        w, s = int(rng.integers(0, 2 ** 32)), int(rng.integers(0, 0x7F))
        sc16, sc = scale_pair_to_f16x2(s), scale_pair_to_bf16x2(s)
        for r16, r in zip(fp4x8_to_f16x2x4(w, sc16, 0), fp4x8_to_bf16x2x4(w, sc, 0)):
            assert (halves(r16) == bf16_halves(r)).all(), (hex(w), s)


def sw64(row, chunk16):
    return row * 64 + 16 * (chunk16 ^ ((row >> 1) & 3))


def check_chunk(seed=0):
    rng = np.random.default_rng(seed)
    a_bytes = rng.integers(0, 256, (128, 64), dtype=np.uint8)
    b_bytes = rng.integers(0, 256, (128, 64), dtype=np.uint8)
    # scale bytes: avoid NaN codes; one 128-row block x 8 k-blocks of 16 for this chunk
    def rand_sf():
        v = rng.integers(0, 256, (128, 8)).astype(np.uint8)
        v[(v & 0x7F) == 0x7F] = 0x38
        return v
    sfa, sfb = rand_sf(), rand_sf()

    def sf_slice(sf):  # 1 KB slice of the reordered layout for k-blocks 0..7 of the chunk
        out = np.zeros(1024, np.uint8)
        for r in range(128):
            for j in range(8):
                out[(j // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + j % 4] = sf[r, j]
        return out

    stage = np.zeros(8192 * 2 + 2048, np.uint8)
    for r in range(128):
        for c in range(4):
            stage[sw64(r, c):sw64(r, c) + 16] = a_bytes[r, 16 * c:16 * c + 16]
            stage[8192 + sw64(r, c):8192 + sw64(r, c) + 16] = b_bytes[r, 16 * c:16 * c + 16]
    stage[16384:17408] = sf_slice(sfa)
    stage[17408:18432] = sf_slice(sfb)
    u32 = lambda off: int(stage[off:off + 4].view(np.uint32)[0])
    u16 = lambda off: int(stage[off:off + 2].view(np.uint16)[0])

    a16 = np.zeros(128 * 128 * 2, np.uint8)
    blog = np.zeros((128, 128))
    for wg in range(2):
        for w in range(4):
            for lane in range(32):
                # ---- A side (mirror of transform): one row per transform thread
                if wg == 0 and w < 2:
                    for row in ([32 * w + lane, 64 + 32 * w + lane]):
                        a_swz16 = ((row >> 1) & 3) * 16
                        sfa_off = (row % 32) * 16 + ((row // 32) % 4) * 4
                        words = [[u32(row * 64 + ((16 * qq) ^ a_swz16) + 4 * t) for t in range(4)] for qq in range(4)]
                        sf = [u32(16384 + sfa_off + 512 * sub) for sub in range(2)]
                        for t in range(4):
                            conv = [fp4x8_to_f16x2x4(words[qq][t], scale_to_f16x2(
                                sf[qq // 2], (2 * (qq % 2) + t // 2) * 0x11)) for qq in range(4)]
                            for i in range(4):
                                s_log = 2 * t + i // 2
                                addr = row * 128 + (s_log // 4) * 16384 + ((((2 * s_log + i % 2) % 8) * 16) ^ ((row % 8) * 16))
                                vec = np.array([conv[qq][i] for qq in range(4)], np.uint32)
                                a16[addr:addr + 16] = vec.view(np.uint8)
                # ---- B side
                q = lane % 4
                b_row = 64 * wg + 16 * w + lane // 4
                b_off = b_row * 64 + 16 * (q ^ ((b_row >> 1) & 3))
                sfb_off = (b_row // 128) * 1024 + (q // 2) * 512 + (b_row % 32) * 16 + ((b_row // 32) % 4) * 4
                frag = [0] * 32
                for ri in range(2):  # rows b_row and b_row + 8: +512 B of B, +128 B of SFB
                    bw = [u32(8192 + b_off + 512 * ri + 4 * t) for t in range(4)]
                    # the 16-bit load at the thread's pair, one conversion, broadcast halves
                    pair = scale_pair_to_f16x2(u16(17408 + sfb_off + 2 * (q % 2) + 128 * ri))
                    sc = [(pair, 0), (pair, 1)]
                    for t in range(4):
                        o = fp4x8_to_f16x2x4(bw[t], *sc[t // 2])
                        for i in range(4):
                            step, slot = 2 * t + i // 2, i % 2
                            frag[4 * step + 2 * slot + ri] = o[i]
                # frag -> logical (n, k) by the wgmma A thread/value layout ((4,8,4),(2,2,2))
                for step in range(8):
                    for j in range(4):
                        v1, v2 = j % 2, j // 2
                        vals = halves(frag[4 * step + j])
                        for v0 in range(2):
                            n = 64 * wg + 16 * w + lane // 4 + 8 * v1
                            k = 16 * step + 2 * q + v0 + 8 * v2
                            blog[n, k] = vals[v0]
    # A buffer read through the SW128 K-major layout S<3,4,3> o ((8,16),(64,2)):((64,512),(1,8192)) (fp16)
    alog = np.zeros((128, 128))
    for m in range(128):
        for k in range(128):
            off = (k // 64) * 16384 + m * 128 + (k % 64) * 2
            off ^= ((off >> 7) & 7) << 4
            alog[m, k] = np.array([a16[off:off + 2].view(np.uint16)[0]], np.uint16).view(np.float16)[0]

    def deq(bytes_, sf):
        codes = np.stack([bytes_ & 0xF, bytes_ >> 4], -1).reshape(128, 128)
        s = torch.from_numpy(sf.copy()).view(torch.float8_e4m3fn).to(torch.float64).numpy()
        return E2M1[codes] * np.repeat(s, 16, axis=1)

    want = deq(a_bytes, sfa) @ deq(b_bytes, sfb).T
    got = (alog @ blog.T) * 2.0 ** 21  # the kernel's EPILOGUE_EXPONENT
    err = np.abs(got - want).max()
    assert err == 0.0, err
    print(f"chunk emulation (seed {seed}): exact, max |value| {np.abs(want).max():.1f}")


def test_bit_tricks_exact_for_every_code():
    check_bit_tricks()


def test_bf16_bit_tricks_exact_for_every_code():
    check_bf16_bit_tricks()


def check_w4a16_chunk(seed, bf16):
    """W4A16: one 128-k chunk of a 128-row B tile against A in its natural k order (the wgmma B operand read from
    the buffer TMA fills with A's rows as they are): B's codes in moe.w4a16_codes' order, staged in the SW64 stage
    layout, each consumer thread's four words per row, its row's two scale words (k-blocks 0-3 and 4-7), word t's
    pair (k-blocks 2 t, 2 t + 1) "split" over its registers, the wgmma A-operand fragment read back to (n, k):
    sum_k A[m, k] Blog[n, k] 2^14 must be the exact product."""
    import nvfp4_moe.gemm as moe

    rng = np.random.default_rng(seed)
    b_bytes = rng.integers(0, 256, (128, 64), dtype=np.uint8)
    sfb = rng.integers(0, 256, (128, 8)).astype(np.uint8)
    sfb[(sfb & 0x7F) == 0x7F] = 0x38
    stage_b = moe.w4a16_codes(torch.from_numpy(b_bytes.copy())).numpy()
    stage = np.zeros(8192 + 1024, np.uint8)
    for r in range(128):
        for c in range(4):
            stage[sw64(r, c):sw64(r, c) + 16] = stage_b[r, 16 * c:16 * c + 16]
    for r in range(128):  # the blocked 1 KB scale slice of the chunk
        for j in range(8):
            stage[8192 + (j // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + j % 4] = sfb[r, j]
    u32 = lambda off: int(stage[off:off + 4].view(np.uint32)[0])  # noqa: E731
    blog = np.zeros((128, 128))
    for wg in range(2):
        for w in range(4):
            for lane in range(32):
                q = lane % 4
                b_row = 64 * wg + 16 * w + lane // 4
                b_off = b_row * 64 + 16 * (q ^ ((b_row >> 1) & 3))
                sfb_off = (b_row % 32) * 16 + ((b_row // 32) % 4) * 4
                frag = [0] * 32
                for ri in range(2):
                    bw = [u32(b_off + 512 * ri + 4 * t) for t in range(4)]
                    sw = [u32(8192 + sfb_off + 128 * ri + 512 * sub) for sub in range(2)]
                    for t in range(4):
                        pair = (sw[t // 2] >> (16 * (t % 2))) & 0xFFFF
                        if bf16:
                            o = fp4x8_to_bf16x2x4(bw[t], scale_pair_to_bf16x2(pair), "split")
                        else:
                            o = fp4x8_to_f16x2x4(bw[t], scale_pair_to_f16x2(pair), "split")
                        for i in range(4):
                            frag[4 * (2 * t + i // 2) + 2 * (i % 2) + ri] = o[i]
                for step in range(8):
                    for j in range(4):
                        v1, v2 = j % 2, j // 2
                        vals = (bf16_halves if bf16 else halves)(frag[4 * step + j])
                        for v0 in range(2):
                            blog[64 * wg + 16 * w + lane // 4 + 8 * v1, 16 * step + 2 * q + v0 + 8 * v2] = vals[v0]
    codes = np.stack([b_bytes & 0xF, b_bytes >> 4], -1).reshape(128, 128)
    scales = torch.from_numpy(sfb.copy()).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    b_exact = E2M1[codes] * np.repeat(scales, 16, axis=1)
    a = rng.integers(-2048, 2048, (64, 128)) * 2.0 ** rng.integers(-12, 4, (64, 1))  # exact in fp16 and in float64
    got = (a @ blog.T) * 2.0 ** 14  # the kernel's A16_INPUT_EPILOGUE_EXPONENT
    assert np.abs(got - a @ b_exact.T).max() == 0.0


def test_w4a16_chunk_meets_a_in_natural_order():
    pytest.importorskip("cutlass")  # moe.w4a16_codes (moe imports the DSL)
    for seed, bf16 in ((0, False), (1, True), (2, True)):
        check_w4a16_chunk(seed, bf16)


def test_chunk_k_permutation_matches_between_operands():
    for seed in (0, 1, 2):
        check_chunk(seed)
