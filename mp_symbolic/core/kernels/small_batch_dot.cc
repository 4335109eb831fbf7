// small_batch_dot(a, b, transpose_a, transpose_b): MXNet's batch_dot (the
// same attributes, arrays of 3 or more axes, the leading ones the batch) for
// the small matrices of attention. MXNet 1.9.1's batch_dot calls BLAS's gemm
// once a batch item, and at attention's sizes (64 x 16 by 16 x 64 at the
// language model's width 64) the call costs more than its arithmetic. Here
// each item is one product in registers: the columns of op(b) packed 16 to a
// vector (op(b) copied only where transposed or of a width not a multiple of
// 16), op(a) read in place through its strides, R rows by up to 64 columns
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

using mxnet::ext::MXReturnValue;
using mxnet::ext::MXTensor;
using mxnet::ext::OpResource;
using Attrs = std::unordered_map<std::string, std::string>;

namespace small_batch_dot {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

bool Flag(const Attrs& attrs, const char* name) {
  auto it = attrs.find(name);
  return it != attrs.end() && (it->second == "True" || it->second == "true" || it->second == "1");
}

// c (R rows of ldc) = op(a) (R x K: element (r, k) at a[r rs + k ks]) . b (K x NV 16
// columns from j, row stride ldb), R x NV vector accumulators held in registers
template <int NV, int R>
inline __attribute__((always_inline)) void Block(const float* a, int64_t rs, int64_t ks,
                                                 const float* b, int64_t ldb, float* c,
                                                 int64_t ldc, int64_t K, int64_t j, int64_t N) {
  v16 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    v16 bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = *reinterpret_cast<const v16u*>(b + k * ldb + j + 16 * v);
    for (int r = 0; r < R; ++r) {
      const float s = a[r * rs + k * ks];
      for (int v = 0; v < NV; ++v) acc[r][v] += s * bv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      const int64_t col = j + 16 * v;
      if (col + 16 <= N) {
        *reinterpret_cast<v16u*>(c + r * ldc + col) = acc[r][v];
      } else {
        float tmp[16];
        std::memcpy(tmp, &acc[r][v], sizeof(tmp));
        for (int64_t q = 0; col + q < N; ++q) c[r * ldc + col + q] = tmp[q];
      }
    }
}

// the columns j .. j + 16 NV of every row, R rows at a time
template <int NV, int R>
inline __attribute__((always_inline)) void Cols(const float* a, int64_t rs, int64_t ks,
                                                const float* b, int64_t ldb, float* c,
                                                int64_t M, int64_t K, int64_t N, int64_t j) {
  int64_t i = 0;
  for (; i + R <= M; i += R) Block<NV, R>(a + i * rs, rs, ks, b, ldb, c + i * N, N, K, j, N);
  for (; i < M; ++i) Block<NV, 1>(a + i * rs, rs, ks, b, ldb, c + i * N, N, K, j, N);
}

// one batch item: c (M x N) = op(a) . b, b K x NP (NP a multiple of 16, row stride ldb)
#define ITEM_BODY \
  int64_t j = 0; \
  for (; j + 64 <= NP; j += 64) Cols<4, 4>(a, rs, ks, b, ldb, c, M, K, N, j); \
  if (NP - j == 48) Cols<3, 4>(a, rs, ks, b, ldb, c, M, K, N, j); \
  else if (NP - j == 32) Cols<2, 8>(a, rs, ks, b, ldb, c, M, K, N, j); \
  else if (NP - j == 16) Cols<1, 16>(a, rs, ks, b, ldb, c, M, K, N, j);
#define ITEM_ARGS const float* a, int64_t rs, int64_t ks, const float* b, int64_t ldb, \
  float* c, int64_t M, int64_t K, int64_t N, int64_t NP

__attribute__((target("avx512f,fma"))) void Item512(ITEM_ARGS) { ITEM_BODY }
__attribute__((target("avx2,fma"))) void Item256(ITEM_ARGS) { ITEM_BODY }
void ItemBase(ITEM_ARGS) { ITEM_BODY }

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
  for (size_t i = 0; i < in->size(); ++i) {
    if (in->at(i) != mxnet::ext::kFloat32) {
      MX_ERROR_MSG << "small_batch_dot: expected float32 inputs, found type " << in->at(i)
                   << " at input " << i;
      return mxnet::ext::MX_FAIL;
    }
  }
  out->at(0) = in->at(0);
  return mxnet::ext::MX_SUCCESS;
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
