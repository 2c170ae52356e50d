/* Fused CPU step of LowPrecisionAdamW (mct/optim/lowbit/native.py builds and loads it).

   One pass per 256-element block: decode the moments, update them and the fp32 weights,
   then encode them with the block's new absmax. Every operation rounds once (built with
   -ffp-contract=off: no fused multiply-add; sqrtf, division, floorf are IEEE-exact), so the
   bytes equal those of the torch reference in adamw.py (`_step_reference`), whose square
   roots are taken in float64 for the same reason; tests/optim/test_optim_lowbit.py
   compares the two (for finite values: a NaN gradient makes its block's scales NaN in
   both, though the NaN element's own code may differ). The codes follow codec.py; the
   noise of element i of a shard placed at global index `offset` is
   table[(offset + shift + i) mod period] of a table stored twice over
   (`noise.NoiseTable`): the caller passes o = (offset + shift) mod period.

   h[10]: decay (1 - lr * wd), b1, 1 - b1, b2, 1 - b2, step size (lr / (1 - b1^t)),
          sqrt(1 - b2^t), eps, 1 / 127^2, 1 / 255. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256

/* The largest |x| of a block: the int32 order of |x|'s bits is the order of |x|, and an
   integer max vectorizes where a float one needs -ffinite-math-only. */
static float absmax(const float *x) {
    int32_t bits[BLOCK], top = 0;
    memcpy(bits, x, sizeof bits);
    for (int i = 0; i < BLOCK; i++) {
        int32_t a = bits[i] & 0x7fffffff;
        top = a > top ? a : top;
    }
    float r;
    memcpy(&r, &top, sizeof r);
    return r;
}

/* m, v: the block's decoded moments in, updated moments out; p, g: its weights, grads. */
static void update(float *restrict m, float *restrict v, float *restrict p, const float *restrict g,
                   const float *restrict h) {
    const float decay = h[0], b1 = h[1], c1 = h[2], b2 = h[3], c2 = h[4], lr = h[5], bc2 = h[6], eps = h[7];
    for (int i = 0; i < BLOCK; i++) {
        float gi = g[i];
        float mi = m[i] * b1 + gi * c1;
        float vi = v[i] * b2 + (gi * gi) * c2;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * decay - (lr * mi) / (sqrtf(vi) / bc2 + eps);
    }
}

void adamw_int8(float *restrict p, const float *restrict g, int8_t *restrict cm, float *restrict sm,
                uint8_t *restrict cv, float *restrict sv, const float *restrict um, const float *restrict uv,
                int64_t om, int64_t ov, int64_t period, int64_t nblocks, const float *restrict h) {
    float m[BLOCK], v[BLOCK], qm[BLOCK], qv[BLOCK];
    for (int64_t j = 0; j < nblocks; j++) {
        const int64_t at = j * BLOCK;
        const float *restrict nm = um + (om + at) % period, *restrict nv = uv + (ov + at) % period;
        int8_t *restrict cmj = cm + at;
        uint8_t *restrict cvj = cv + at;
        const float sm_j = sm[j] * h[8], sv_j = sv[j], k = h[9];
        for (int i = 0; i < BLOCK; i++) {  /* decode: codec.decode_signed / decode_unsigned */
            float c = (float)cmj[i], t = (float)cvj[i] * k;
            t = t * t;
            m[i] = (c * fabsf(c)) * sm_j;
            v[i] = (t * t) * sv_j;
        }
        update(m, v, p + at, g + at, h);
        const float am = absmax(m), av = absmax(v);
        const float im = am > 0.0f ? 1.0f / am : 0.0f, iv = av > 0.0f ? 1.0f / av : 0.0f;
        for (int i = 0; i < BLOCK; i++) {  /* encode: codec.encode_signed / encode_unsigned */
            float a = floorf(sqrtf(fabsf(m[i]) * im) * 127.0f + nm[i]);
            qm[i] = copysignf(a < 127.0f ? a : 127.0f, m[i]);
            float b = floorf(sqrtf(sqrtf(v[i] * iv)) * 255.0f + nv[i]);
            b = b > 1.0f ? b : 1.0f;
            qv[i] = b < 255.0f ? b : 255.0f;
        }
        for (int i = 0; i < BLOCK; i++) {  /* whole numbers in range: the casts are exact */
            cmj[i] = (int8_t)(int32_t)qm[i];
            cvj[i] = (uint8_t)(int32_t)qv[i];
        }
        sm[j] = am;
        sv[j] = av;
    }
}

/* bf16 moments; stochastic rounding as codec.round_bf16: add 16 noise bits, keep the top 16. */
void adamw_bf16(float *restrict p, const float *restrict g, uint16_t *restrict bm, uint16_t *restrict bv,
                const int32_t *restrict nm, const int32_t *restrict nv, int64_t om, int64_t ov, int64_t period,
                int64_t nblocks, const float *restrict h) {
    float m[BLOCK], v[BLOCK];
    uint32_t bits[BLOCK];
    for (int64_t j = 0; j < nblocks; j++) {
        const int64_t at = j * BLOCK;
        const int32_t *restrict rm = nm + (om + at) % period, *restrict rv = nv + (ov + at) % period;
        for (int i = 0; i < BLOCK; i++) bits[i] = (uint32_t)bm[at + i] << 16;
        memcpy(m, bits, sizeof m);
        for (int i = 0; i < BLOCK; i++) bits[i] = (uint32_t)bv[at + i] << 16;
        memcpy(v, bits, sizeof v);
        update(m, v, p + at, g + at, h);
        memcpy(bits, m, sizeof bits);
        for (int i = 0; i < BLOCK; i++) bm[at + i] = (uint16_t)((bits[i] + (uint32_t)rm[i]) >> 16);
        memcpy(bits, v, sizeof bits);
        for (int i = 0; i < BLOCK; i++) bv[at + i] = (uint16_t)((bits[i] + (uint32_t)rv[i]) >> 16);
    }
}
