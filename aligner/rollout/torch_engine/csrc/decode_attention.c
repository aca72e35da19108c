/* One-token (decode) grouped-query attention over a KV cache, fp32, for the CPU rollout engine.
 *
 * Built at run time by aligner/rollout/torch_engine/cpu_kernels.py (cc -O3 -march=native -ffast-math -fopenmp) and
 * called through ctypes. Each (row, kv head) is one task: its rep query heads read the row's keys
 * and values once, up to that row's own length (no masked positions are read), in a fixed order,
 * so a row's result does not depend on the other rows of the batch.
 *
 * q    query head h * rep + j of row r at q[r * q_row + (h * rep + j) * hd] (heads contiguous in a row)
 * k, v key / value l of row r, kv head h at k[r * row_stride + h * head_stride + l * hd] (hd contiguous)
 * len  [n] int64: keys row r attends to (positions [0, len[r])), 1 <= len[r] <= max_len
 * k_new, v_new kv head h of row r at k_new[r * new_row + h * hd], or NULL: written to position
 *      len[r] - 1 of row r first (the decode step's own key and value; the task reads that row's
 *      keys right after, so the write costs no extra trip to memory, unlike a separate scattered copy)
 * cos, sin [n, hd] contiguous, or NULL: RoPE tables of each row's position; when given, q and k_new
 *      are rotated here first (HF's rotate-half convention: x * cos + rotate_half(x) * sin, with
 *      rotate_half(x) = [-x[hd/2:], x[:hd/2]]), so the caller runs no RoPE ops and copies nothing
 * out  [n, kvh, rep, hd] contiguous: softmax(q k^T * scale) v per query head
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline void rope(const float *x, const float *c, const float *sn, int64_t hd, float *y) {
    const int64_t half = hd / 2;
    for (int64_t d = 0; d < half; d++) y[d] = x[d] * c[d] - x[d + half] * sn[d];
    for (int64_t d = half; d < hd; d++) y[d] = x[d] * c[d] + x[d - half] * sn[d];
}

int decode_attention_f32(const float *q, float *k, float *v, const float *k_new, const float *v_new, const int64_t *len, float *out,
                         const float *cos, const float *sin, int64_t n, int64_t kvh, int64_t rep, int64_t hd, int64_t q_row,
                         int64_t new_row, int64_t row_stride, int64_t head_stride, int64_t max_len, float scale, int nthreads) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* 64-byte aligned in every thread: the vectorized sums then split the same way whichever
         * thread runs a task, so a row's result cannot depend on the thread it lands on */
        const size_t bytes = ((sizeof(float) * (size_t)(rep * max_len) + 63) / 64) * 64;
        const size_t qbytes = ((sizeof(float) * (size_t)(rep * hd) + 63) / 64) * 64;
        float *s = (float *)aligned_alloc(64, bytes + qbytes);
        float *qr = s == NULL ? NULL : s + bytes / sizeof(float); /* the task's rotated queries */
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n * kvh; t++) {
            if (s == NULL) continue;
            const int64_t r = t / kvh, h = t % kvh, L = len[r];
            float *kb = k + r * row_stride + h * head_stride;
            float *vb = v + r * row_stride + h * head_stride;
            const float *qb = q + r * q_row + h * rep * hd;
            float *ob = out + t * rep * hd;
            if (cos != NULL) {
                const float *c = cos + r * hd, *sn = sin + r * hd;
                for (int64_t j = 0; j < rep; j++) rope(qb + j * hd, c, sn, hd, qr + j * hd);
                qb = qr;
            }
            if (k_new != NULL) {
                const float *kn = k_new + r * new_row + h * hd, *vn = v_new + r * new_row + h * hd;
                if (cos != NULL)
                    rope(kn, cos + r * hd, sin + r * hd, hd, kb + (L - 1) * hd);
                else
                    for (int64_t d = 0; d < hd; d++) kb[(L - 1) * hd + d] = kn[d];
                for (int64_t d = 0; d < hd; d++) vb[(L - 1) * hd + d] = vn[d];
            }
            for (int64_t l = 0; l < L; l++) {
                const float *kl = kb + l * hd;
                for (int64_t j = 0; j < rep; j++) {
                    const float *qj = qb + j * hd;
                    float acc = 0.f;
                    for (int64_t d = 0; d < hd; d++) acc += qj[d] * kl[d];
                    s[j * L + l] = acc * scale;
                }
            }
            for (int64_t j = 0; j < rep; j++) {
                float *sj = s + j * L;
                float m = sj[0];
                for (int64_t l = 1; l < L; l++) m = sj[l] > m ? sj[l] : m;
                float z = 0.f;
                for (int64_t l = 0; l < L; l++) {
                    sj[l] = expf(sj[l] - m);
                    z += sj[l];
                }
                const float inv = 1.f / z;
                for (int64_t l = 0; l < L; l++) sj[l] *= inv;
                for (int64_t d = 0; d < hd; d++) ob[j * hd + d] = 0.f;
            }
            for (int64_t l = 0; l < L; l++) {
                const float *vl = vb + l * hd;
                for (int64_t j = 0; j < rep; j++) {
                    const float p = s[j * L + l];
                    float *oj = ob + j * hd;
                    for (int64_t d = 0; d < hd; d++) oj[d] += p * vl[d];
                }
            }
        }
        free(s);
    }
    return failed;
}
