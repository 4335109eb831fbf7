// The loops of small_kernels.h. A product's item is a block of R rows by up
// to 64 columns accumulated in vector registers: op(b)'s rows read as
// vectors, op(a) read in place through its strides. Each loop holds at most
// 16 accumulators in the registers its instructions have: AVX-512's 32 of
// 16 floats, up to 64 columns by 4 rows (16 columns by 16 rows at once, and
// for a causal band's columns); AVX2's 16 of 8 floats, 16 columns by 6
// rows; the baseline's (SSE2) 16 of 4, 16 by 3. The softmax's exponential
// is Cephes' expf polynomial on vectors: within 1.01 units in the last
// place of the float32 nearest to exp over [-87, 0] in each loop (against
// float64's). The sums are float32 in another order than BLAS's and MXNet's
// softmax's: equal to theirs to float32 rounding, not bit for bit.
#include "small_kernels.h"

#include <cstdlib>
#include <cstring>
#include <string>

namespace mp_symbolic_kernels {
namespace {

// vectors of 16, 8 and 4 floats, and of as many ints
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef int32_t i4 __attribute__((vector_size(16)));

// a vector read or written at any float's alignment (memcpy: one unaligned move)
template <typename V>
inline __attribute__((always_inline)) void Load(V* x, const float* p) {
  std::memcpy(x, p, sizeof(V));
}

template <typename V>
inline __attribute__((always_inline)) void Store(float* p, const V& x) {
  std::memcpy(p, &x, sizeof(V));
}

template <typename V>
inline __attribute__((always_inline)) V Splat(float x) {
  return V{} + x;
}

// c (R rows of ldc) = op(a) (R x [k0, k1): element (r, k) at a[r rs + k ks]) . b
// (rows k0 .. k1, NV W columns from j, row stride ldb), R x NV accumulators in registers
template <typename V, int W, int NV, int R>
inline __attribute__((always_inline)) void Block(const float* a, int64_t rs, int64_t ks,
                                                 const float* b, int64_t ldb, float* c,
                                                 int64_t ldc, int64_t k0, int64_t k1, int64_t j,
                                                 int64_t N) {
  V acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = V{};
  for (int64_t k = k0; k < k1; ++k) {
    V bv[NV];
    for (int v = 0; v < NV; ++v) Load(&bv[v], b + k * ldb + j + W * v);
    for (int r = 0; r < R; ++r) {
      const float s = a[r * rs + k * ks];
      for (int v = 0; v < NV; ++v) acc[r][v] += s * bv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      const int64_t col = j + W * v;
      if (col + W <= N) {
        Store(c + r * ldc + col, acc[r][v]);
      } else {
        float tmp[W];
        std::memcpy(tmp, &acc[r][v], sizeof(tmp));
        for (int64_t q = 0; col + q < N; ++q) c[r * ldc + col + q] = tmp[q];
      }
    }
}

// rows [i, i + rows)'s range of k under the band
inline void Inner(Band band, int64_t i, int64_t rows, int64_t K, int64_t* k0, int64_t* k1) {
  *k0 = band == kInnerFromRow ? (i < K ? i : K) : 0;
  *k1 = band == kInnerToRow ? (i + rows < K ? i + rows : K) : K;
}

// the columns j .. j + NV W of every row (from row j under kRowsFromCol), R rows at a time
template <typename V, int W, int NV, int R>
inline __attribute__((always_inline)) void Cols(const float* a, int64_t rs, int64_t ks,
                                                const float* b, int64_t ldb, float* c,
                                                int64_t ldc, int64_t M, int64_t K, int64_t N,
                                                int64_t j, Band band) {
  int64_t i = band == kRowsFromCol ? (j < M ? j : M) : 0, k0, k1;
  for (; i + R <= M; i += R) {
    Inner(band, i, R, K, &k0, &k1);
    Block<V, W, NV, R>(a + i * rs, rs, ks, b, ldb, c + i * ldc, ldc, k0, k1, j, N);
  }
  for (; i < M; ++i) {
    Inner(band, i, 1, K, &k0, &k1);
    Block<V, W, NV, 1>(a + i * rs, rs, ks, b, ldb, c + i * ldc, ldc, k0, k1, j, N);
  }
}

#define PRODUCT_ARGS const float* a, int64_t rs, int64_t ks, const float* b, int64_t ldb, \
  float* c, int64_t ldc, int64_t M, int64_t K, int64_t N, int64_t NP, Band band
#define PRODUCT_PASS a, rs, ks, b, ldb, c, ldc, M, K, N

__attribute__((target("avx512f,fma"))) void Product512(PRODUCT_ARGS) {
  int64_t j = 0;
  if (band == kRowsFromCol) {  // blocks of 16 columns: the rows above each are left out
    for (; j < NP; j += 16) Cols<v16, 16, 1, 16>(PRODUCT_PASS, j, band);
    return;
  }
  for (; j + 64 <= NP; j += 64) Cols<v16, 16, 4, 4>(PRODUCT_PASS, j, band);
  if (NP - j == 48) Cols<v16, 16, 3, 4>(PRODUCT_PASS, j, band);
  else if (NP - j == 32) Cols<v16, 16, 2, 8>(PRODUCT_PASS, j, band);
  else if (NP - j == 16) Cols<v16, 16, 1, 16>(PRODUCT_PASS, j, band);
}

__attribute__((target("avx2,fma"))) void Product256(PRODUCT_ARGS) {
  for (int64_t j = 0; j < NP; j += 16) Cols<v8, 8, 2, 6>(PRODUCT_PASS, j, band);
}

void ProductBase(PRODUCT_ARGS) {
  for (int64_t j = 0; j < NP; j += 16) Cols<v4, 4, 4, 3>(PRODUCT_PASS, j, band);
}

// exp(x) for x <= 0 (Cephes' expf): x = n ln 2 + r, |r| <= ln 2 / 2, exp(r) by
// its polynomial, 2^n made in the exponent's bits; below -87.3, exp(-87.3) (not 0)
template <typename V, typename I>
inline __attribute__((always_inline)) V Exp(V x) {
  const V low = Splat<V>(-87.33654f);
  x = x < low ? low : x;
  const float magic = 12582912.f;  // 1.5 2^23: adding it rounds to an integer
  const V t = x * 1.44269504088896341f + magic;
  const V n = t - magic;
  const V r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  V p = Splat<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const I bits = ((I)t - 0x4B400000 + 127) << 23;  // t's low bits are n
  return p * (V)bits;
}

template <typename V>
inline __attribute__((always_inline)) float Sum(const V& x) {
  float lanes[sizeof(V) / sizeof(float)];
  std::memcpy(lanes, &x, sizeof(lanes));
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  return sum;
}

template <typename V, typename I, int W>
inline __attribute__((always_inline)) void Softmax(float* s, int64_t T, int64_t ld,
                                                   float scale) {
  for (int64_t i = 0; i < T; ++i) {
    float* row = s + i * ld;
    const int64_t n = i + 1, chunks = (n + W - 1) / W, whole = n / W;
    // the row's largest score: its whole vectors' lanes, then the rest one by one
    V most = Splat<V>(row[0]);
    for (int64_t c = 0; c < whole; ++c) {
      V x;
      Load(&x, row + c * W);
      most = x > most ? x : most;
    }
    float top = row[0], lanes[W];
    std::memcpy(lanes, &most, sizeof(lanes));
    for (float lane : lanes) top = lane > top ? lane : top;
    for (int64_t j = whole * W; j < n; ++j) top = row[j] > top ? row[j] : top;
    const float shift = -top * scale;
    for (int64_t c = 0; c < chunks; ++c) {
      V x;
      Load(&x, row + c * W);
      Store(row + c * W, Exp<V, I>(x * scale + shift));
    }
    std::memset(row + n, 0, (ld - n) * sizeof(float));
    V total = V{};
    for (int64_t c = 0; c < chunks; ++c) {
      V x;
      Load(&x, row + c * W);
      total += x;
    }
    const float inverse = 1.f / Sum(total);
    for (int64_t c = 0; c < chunks; ++c) {
      V x;
      Load(&x, row + c * W);
      Store(row + c * W, x * inverse);
    }
  }
}

template <typename V, int W>
inline __attribute__((always_inline)) void SoftmaxGrad(const float* p, float* g, int64_t T,
                                                       int64_t ld, float scale) {
  for (int64_t i = 0; i < T; ++i) {
    const float* prow = p + i * ld;  // 0 past i
    float* grow = g + i * ld;
    const int64_t n = i + 1, chunks = (n + W - 1) / W;
    V dot = V{};
    for (int64_t c = 0; c < chunks; ++c) {
      V x, y;
      Load(&x, prow + c * W);
      Load(&y, grow + c * W);
      dot += x * y;
    }
    const float shift = Sum(dot);
    for (int64_t c = 0; c < chunks; ++c) {
      V x, y;
      Load(&x, prow + c * W);
      Load(&y, grow + c * W);
      Store(grow + c * W, x * (y - shift) * scale);
    }
    std::memset(grow + n, 0, (ld - n) * sizeof(float));
  }
}

__attribute__((target("avx512f,fma"))) void Softmax512(float* s, int64_t T, int64_t ld,
                                                       float scale) {
  Softmax<v16, i16, 16>(s, T, ld, scale);
}
__attribute__((target("avx2,fma"))) void Softmax256(float* s, int64_t T, int64_t ld,
                                                    float scale) {
  Softmax<v8, i8, 8>(s, T, ld, scale);
}
void SoftmaxBase(float* s, int64_t T, int64_t ld, float scale) {
  Softmax<v4, i4, 4>(s, T, ld, scale);
}

__attribute__((target("avx512f,fma"))) void SoftmaxGrad512(const float* p, float* g, int64_t T,
                                                           int64_t ld, float scale) {
  SoftmaxGrad<v16, 16>(p, g, T, ld, scale);
}
__attribute__((target("avx2,fma"))) void SoftmaxGrad256(const float* p, float* g, int64_t T,
                                                        int64_t ld, float scale) {
  SoftmaxGrad<v8, 8>(p, g, T, ld, scale);
}
void SoftmaxGradBase(const float* p, float* g, int64_t T, int64_t ld, float scale) {
  SoftmaxGrad<v4, 4>(p, g, T, ld, scale);
}

Kernel Choose() {
  __builtin_cpu_init();
  const char* asked = std::getenv("MP_SYMBOLIC_SMALL_BATCH_DOT_KERNEL");
  const std::string want = asked ? asked : "";
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (want != "avx2" && want != "baseline" && __builtin_cpu_supports("avx512f"))
    return {Product512, Softmax512, SoftmaxGrad512, "avx512"};
  if (want != "baseline" && avx2) return {Product256, Softmax256, SoftmaxGrad256, "avx2"};
  return {ProductBase, SoftmaxBase, SoftmaxGradBase, "baseline"};
}

}  // namespace

const Kernel& Chosen() {
  static const Kernel chosen = Choose();
  return chosen;
}

}  // namespace mp_symbolic_kernels

// the loops this CPU runs: "avx512", "avx2" or "baseline"
extern "C" const char* small_batch_dot_kernel() { return mp_symbolic_kernels::Chosen().name; }
