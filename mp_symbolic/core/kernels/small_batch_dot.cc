// small_batch_dot(a, b, transpose_a, transpose_b): MXNet's batch_dot (the
// same attributes, arrays of 3 or more axes, the leading ones the batch) for
// the small matrices of attention. MXNet 1.9.1's batch_dot calls BLAS's gemm
// once a batch item, and at attention's sizes (64 x 16 by 16 x 64 at the
// language model's width 64) the call costs more than its arithmetic. Here
// each item is one product in registers: op(b)'s rows read as vectors (op(b)
// copied only where transposed or of a width not a multiple of 16), op(a)
// read in place through its strides, a block of R rows by up to 64 columns
// accumulated at once. The products are float32 sums in another order than
// BLAS's: equal to batch_dot's to float32 rounding, not bit for bit. The
// loop is compiled three times, for AVX-512, for AVX2 with FMA and for the
// compiler's baseline, and the fastest the CPU runs is chosen as the library
// loads (small_batch_dot_kernel names it; MP_SYMBOLIC_SMALL_BATCH_DOT_KERNEL
// asks for a slower one, to test it). Built and loaded by
// mp_symbolic/core/kernels/__init__.py.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "mxnet/lib_api.h"
#include "float32_only.h"

using mxnet::ext::MXReturnValue;
using mxnet::ext::MXTensor;
using mxnet::ext::OpResource;
using Attrs = std::unordered_map<std::string, std::string>;

namespace small_batch_dot {

// vectors of 16, 8 and 4 floats
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// a vector read or written at any float's alignment (memcpy: one unaligned move)
template <typename V>
inline __attribute__((always_inline)) void Load(V* x, const float* p) {
  std::memcpy(x, p, sizeof(V));
}

template <typename V>
inline __attribute__((always_inline)) void Store(float* p, const V& x) {
  std::memcpy(p, &x, sizeof(V));
}

bool Flag(const Attrs& attrs, const char* name) {
  auto it = attrs.find(name);
  return it != attrs.end() && (it->second == "True" || it->second == "true" || it->second == "1");
}

// c (R rows of ldc) = op(a) (R x K: element (r, k) at a[r rs + k ks]) . b (K x NV W
// columns from j, row stride ldb), R x NV vector accumulators held in registers
template <typename V, int W, int NV, int R>
inline __attribute__((always_inline)) void Block(const float* a, int64_t rs, int64_t ks,
                                                 const float* b, int64_t ldb, float* c,
                                                 int64_t ldc, int64_t K, int64_t j, int64_t N) {
  V acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = V{};
  for (int64_t k = 0; k < K; ++k) {
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

// the columns j .. j + NV W of every row, R rows at a time
template <typename V, int W, int NV, int R>
inline __attribute__((always_inline)) void Cols(const float* a, int64_t rs, int64_t ks,
                                                const float* b, int64_t ldb, float* c,
                                                int64_t M, int64_t K, int64_t N, int64_t j) {
  int64_t i = 0;
  for (; i + R <= M; i += R)
    Block<V, W, NV, R>(a + i * rs, rs, ks, b, ldb, c + i * N, N, K, j, N);
  for (; i < M; ++i) Block<V, W, NV, 1>(a + i * rs, rs, ks, b, ldb, c + i * N, N, K, j, N);
}

// one batch item: c (M x N) = op(a) . b, b K x NP (NP a multiple of 16, row stride ldb).
// Each loop holds at most 16 accumulators in the registers its instructions have:
// AVX-512's 32 of 16 floats, up to 64 columns by 4 rows (16 columns by 16 rows) at once;
// AVX2's 16 of 8 floats, 16 columns by 6 rows; the baseline's (SSE2) 16 of 4, 16 by 3
#define ITEM_ARGS const float* a, int64_t rs, int64_t ks, const float* b, int64_t ldb, \
  float* c, int64_t M, int64_t K, int64_t N, int64_t NP

__attribute__((target("avx512f,fma"))) void Item512(ITEM_ARGS) {
  int64_t j = 0;
  for (; j + 64 <= NP; j += 64) Cols<v16, 16, 4, 4>(a, rs, ks, b, ldb, c, M, K, N, j);
  if (NP - j == 48) Cols<v16, 16, 3, 4>(a, rs, ks, b, ldb, c, M, K, N, j);
  else if (NP - j == 32) Cols<v16, 16, 2, 8>(a, rs, ks, b, ldb, c, M, K, N, j);
  else if (NP - j == 16) Cols<v16, 16, 1, 16>(a, rs, ks, b, ldb, c, M, K, N, j);
}

__attribute__((target("avx2,fma"))) void Item256(ITEM_ARGS) {
  for (int64_t j = 0; j < NP; j += 16) Cols<v8, 8, 2, 6>(a, rs, ks, b, ldb, c, M, K, N, j);
}

void ItemBase(ITEM_ARGS) {
  for (int64_t j = 0; j < NP; j += 16) Cols<v4, 4, 4, 3>(a, rs, ks, b, ldb, c, M, K, N, j);
}

typedef void (*ItemFn)(ITEM_ARGS);
struct Kernel {
  ItemFn item;
  const char* name;
};
// the fastest loop the CPU runs, or a slower one MP_SYMBOLIC_SMALL_BATCH_DOT_KERNEL
// names ("avx2", "baseline": to test each loop on one machine)
Kernel Choose() {
  __builtin_cpu_init();
  const char* asked = std::getenv("MP_SYMBOLIC_SMALL_BATCH_DOT_KERNEL");
  const std::string want = asked ? asked : "";
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (want != "avx2" && want != "baseline" && __builtin_cpu_supports("avx512f"))
    return {Item512, "avx512"};
  if (want != "baseline" && avx2) return {Item256, "avx2"};
  return {ItemBase, "baseline"};
}
const Kernel kChosen = Choose();

// C[n] = op(A[n]) . op(B[n]) for each of the batch's items
void Product(const float* A, const float* B, float* C, int64_t batch, int64_t M, int64_t K,
             int64_t N, bool ta, bool tb) {
  const int64_t NP = (N + 15) / 16 * 16;
  const bool pack = tb || NP != N;
  std::vector<float> bp(pack ? K * NP : 0, 0.f);
  const int64_t rs = ta ? 1 : K, ks = ta ? M : 1;
  for (int64_t n = 0; n < batch; ++n) {
    const float* b = B + n * K * N;
    if (tb) {  // b is N x K
      for (int64_t q = 0; q < N; ++q)
        for (int64_t k = 0; k < K; ++k) bp[k * NP + q] = b[q * K + k];
    } else if (pack) {
      for (int64_t k = 0; k < K; ++k) std::memcpy(&bp[k * NP], b + k * N, N * sizeof(float));
    }
    kChosen.item(A + n * M * K, rs, ks, pack ? bp.data() : b, pack ? NP : N, C + n * M * N,
                 M, K, N, NP);
  }
}

// the batch (the leading axes' product) and the shapes of op(a) (M x K) and op(b) (K x N)
void Dims(const std::vector<int64_t>& a, const std::vector<int64_t>& b, bool ta, bool tb,
          int64_t* batch, int64_t* M, int64_t* K, int64_t* N) {
  const size_t n = a.size();
  *batch = 1;
  for (size_t i = 0; i + 2 < n; ++i) *batch *= a[i];
  *M = ta ? a[n - 1] : a[n - 2];
  *K = ta ? a[n - 2] : a[n - 1];
  *N = tb ? b[n - 2] : b[n - 1];
}

MXReturnValue Forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                      std::vector<MXTensor>* outputs, const OpResource& res) {
  const bool ta = Flag(attrs, "transpose_a"), tb = Flag(attrs, "transpose_b");
  int64_t batch, M, K, N;
  Dims(inputs->at(0).shape, inputs->at(1).shape, ta, tb, &batch, &M, &K, &N);
  Product(inputs->at(0).data<float>(), inputs->at(1).data<float>(),
          outputs->at(0).data<float>(), batch, M, K, N, ta, tb);
  return mxnet::ext::MX_SUCCESS;
}

// inputs: the output's gradient g, then a and b; outputs: the gradients of a and b
MXReturnValue Backward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                       std::vector<MXTensor>* outputs, const OpResource& res) {
  const bool ta = Flag(attrs, "transpose_a"), tb = Flag(attrs, "transpose_b");
  const float* g = inputs->at(0).data<float>();
  const float* a = inputs->at(1).data<float>();
  const float* b = inputs->at(2).data<float>();
  int64_t batch, M, K, N;
  Dims(inputs->at(1).shape, inputs->at(2).shape, ta, tb, &batch, &M, &K, &N);
  // C = op(a) op(b), g = dC (M x N)
  // d op(a) = g op(b)^T (M x K); da = ta ? (g op(b)^T)^T = op(b) g^T : g op(b)^T
  // d op(b) = op(a)^T g (K x N); db = tb ? g^T op(a) : op(a)^T g
  float* da = outputs->at(0).data<float>();
  float* db = outputs->at(1).data<float>();
  if (!ta) Product(g, b, da, batch, M, N, K, false, !tb);      // g . op(b)^T
  else Product(b, g, da, batch, K, N, M, tb, true);            // op(b) . g^T
  if (!tb) Product(a, g, db, batch, K, M, N, !ta, false);      // op(a)^T . g
  else Product(g, a, db, batch, N, M, K, true, ta);            // g^T . op(a)
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue ParseAttrs(const Attrs& attrs, int* num_in, int* num_out) {
  *num_in = 2;
  *num_out = 1;
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue InferType(const Attrs& attrs, std::vector<int>* in, std::vector<int>* out) {
  return mp_symbolic_kernels::Float32Only("small_batch_dot", "inputs", in, out);
}

MXReturnValue InferShape(const Attrs& attrs, std::vector<std::vector<unsigned int>>* in,
                         std::vector<std::vector<unsigned int>>* out) {
  const auto& a = in->at(0);
  const auto& b = in->at(1);
  const size_t n = a.size();
  bool batch = n >= 3 && b.size() == n;
  for (size_t i = 0; batch && i + 2 < n; ++i) batch = a[i] == b[i];
  if (!batch) {
    MX_ERROR_MSG << "small_batch_dot: expected two arrays of 3 or more axes, the same but "
                 << "the last two, found " << n << " and " << b.size() << " axes";
    return mxnet::ext::MX_FAIL;
  }
  const bool ta = Flag(attrs, "transpose_a"), tb = Flag(attrs, "transpose_b");
  const unsigned M = ta ? a[n - 1] : a[n - 2], K = ta ? a[n - 2] : a[n - 1];
  const unsigned Kb = tb ? b[n - 1] : b[n - 2], N = tb ? b[n - 2] : b[n - 1];
  if (K != Kb) {
    MX_ERROR_MSG << "small_batch_dot: expected the products' inner axes equal, found " << K
                 << " and " << Kb;
    return mxnet::ext::MX_FAIL;
  }
  std::vector<unsigned int> shape(a.begin(), a.end() - 2);
  shape.push_back(M);
  shape.push_back(N);
  out->at(0) = shape;
  return mxnet::ext::MX_SUCCESS;
}

}  // namespace small_batch_dot

// the loop this CPU runs: "avx512", "avx2" or "baseline"
extern "C" const char* small_batch_dot_kernel() { return small_batch_dot::kChosen.name; }

REGISTER_OP(small_batch_dot)
.setForward(small_batch_dot::Forward, "cpu")
.setBackward(small_batch_dot::Backward, "cpu")
.setParseAttrs(small_batch_dot::ParseAttrs)
.setInferType(small_batch_dot::InferType)
.setInferShape(small_batch_dot::InferShape);
