// The loops of small_batch_dot and causal_attention (small_kernels.cc): a
// product of small float32 matrices held in vector registers, a causal
// softmax's rows and their backward, each compiled for AVX-512, for AVX2
// with FMA and for the compiler's baseline, the fastest the CPU runs chosen
// once a process (Chosen()).
#ifndef MP_SYMBOLIC_KERNELS_SMALL_KERNELS_H_
#define MP_SYMBOLIC_KERNELS_SMALL_KERNELS_H_

#include <cstdint>

namespace mp_symbolic_kernels {

// Which of a product's terms are computed, for causal attention's triangles
// (rows i, inner index k, columns j):
//   kFull: all of them;
//   kInnerToRow: row i's sum over k <= i only (a's terms past k = i are zero);
//   kInnerFromRow: row i's sum over k >= i only (a's terms before k = i are zero);
//   kRowsFromCol: the columns from j computed on the rows from i = j only
//     (the entries above the diagonal are not needed: rows above a column
//     block are left as they are, the block's own entries above it written).
enum Band { kFull, kInnerToRow, kInnerFromRow, kRowsFromCol };

// c (M rows of N, row stride ldc) = op(a) (M x K: element (r, k) at
// a[r rs + k ks]) . b (K x NP: row stride ldb, NP the columns read, a
// multiple of 16 and at least N; only the first N of a row are written)
typedef void (*ProductFn)(const float* a, int64_t rs, int64_t ks, const float* b, int64_t ldb,
                          float* c, int64_t ldc, int64_t M, int64_t K, int64_t N, int64_t NP,
                          Band band);

// Each of T rows (row stride ld, a multiple of 16) of raw scores s: row i
// made the softmax of scale s[i][0..i], the entries past i set to 0.
typedef void (*SoftmaxFn)(float* s, int64_t T, int64_t ld, float scale);

// The softmax's backward on T rows of its output p and of its output's
// gradient g (row stride ld): g[i][j] = scale p[i][j] (g[i][j] - sum_k<=i
// p[i][k] g[i][k]) for j <= i, 0 past i.
typedef void (*SoftmaxGradFn)(const float* p, float* g, int64_t T, int64_t ld, float scale);

struct Kernel {
  ProductFn product;
  SoftmaxFn softmax;
  SoftmaxGradFn softmax_grad;
  const char* name;  // "avx512", "avx2" or "baseline"
};

// the fastest loops the CPU runs, or slower ones MP_SYMBOLIC_SMALL_BATCH_DOT_KERNEL
// names ("avx2", "baseline": to test each on one machine); chosen at the first call
const Kernel& Chosen();

}  // namespace mp_symbolic_kernels

#endif  // MP_SYMBOLIC_KERNELS_SMALL_KERNELS_H_
