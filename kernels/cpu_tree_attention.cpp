// Attention of a few queries over a cached prefix on the CPU: a decode step's single query,
// a tree's nodes, an EAGLE head's drafting depth.
//
//   out[b, h, t] = sum_s softmax_s(q[b, h, t] . k[b, h / G, s] / sqrt(D), masked) v[b, h / G, s]
//
// with G = H / H_kv query heads per KV head (grouped-query attention) and mask[b, t, s]
// saying which keys query t sees. Built at run time by specdec/models/cpu_attention.py
// (torch.utils.cpp_extension, -march of the machine it runs on); its torch twin is
// F.scaled_dot_product_attention with `enable_gqa`.
//
// With 8 queries over a few hundred keys, torch's CPU flash kernel spends its time on
// blocking meant for long sequences (8 queries over 250 keys: 77 µs with hot caches, for
// 2.3 M multiply-adds). Here one task takes one KV head and up to 16 query rows (the G
// heads' queries of that KV head, G * T rows in all) and keeps the rows in the 16 lanes of
// a vector, so nothing is summed across lanes:
//   1. scores^T [S, 16] = K [S, D] x Q^T [D, 16]: each key's D values broadcast against
//      the rows' query values (the scale 1 / sqrt(D) folded into Q^T);
//   2. softmax down each lane (masked keys -inf, their exp 0);
//   3. out [16, D] = P [16, S] x V [S, D], a few rows at a time against each value row, the
//      last few as a block of just their number (one query's 3 rows are not computed as 6).
// A row's result is a fixed sequence of operations on its own query and the keys and
// values it reads, whatever rows share its task or call. It differs from the torch twin's
// in the last bits (another summation order and exp). Tasks are never split along the keys,
// though one request's 3 KV heads leave one of 2 threads half idle: a split's partial sums
// would group a row's keys by position, so a tree node and a plain step over the same keys
// (masked ones between them or not) would no longer add up the same way.
//
// Needs: q [B, H, T, D] and k, v [B, H_kv, S, D] float32 with their last dimension
// contiguous (q as the layers give it, k and v views of the KV cache); mask [B or 1, 1, T, S] contiguous bool;
// D a multiple of 16 up to 128; every query sees at least one key (a row that sees none
// gives NaN, as the twin's). The Python side checks these and falls back to the twin.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

typedef float lanes16 __attribute__((vector_size(64), aligned(4)));  // 16 floats, unaligned loads
typedef int32_t ints16 __attribute__((vector_size(64), aligned(4)));

constexpr int LANES = 16;   // query rows a task holds, one per lane
constexpr int KEY_BLOCK = 4;  // keys whose scores are accumulated together
constexpr int ACCUMULATORS = 24;  // output vectors step 3. accumulates at once (D / 16 a row)
constexpr int MAX_HEAD_VECTORS = 8;  // D / 16 at most (D up to 128)

inline lanes16 load16(const float* p) { return *reinterpret_cast<const lanes16*>(p); }
inline void store16(float* p, lanes16 v) { *reinterpret_cast<lanes16*>(p) = v; }
inline lanes16 splat(float x) { return lanes16{} + x; }

// exp(x) for lanes x <= 0 (a score minus its row's maximum): x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by Cephes' expf polynomial (within 2 ulp), times 2^n. Lanes below -87 (exp
// under float32's smallest normal; masked keys' -inf among them) give 0.
inline lanes16 exp_nonpositive(lanes16 x) {
  const ints16 under = x < -87.0f;
  x = under ? splat(-87.0f) : x;
  const lanes16 round = splat(12582912.0f);  // 1.5 * 2^23: adding and taking it away rounds to an integer
  const lanes16 n = (x * 1.44269504088896341f + round) - round;
  const lanes16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts: x - n ln2 exactly
  lanes16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ints16 bits = (__builtin_convertvector(n, ints16) + 127) << 23;  // 2^n, n in [-126, 0]
  const lanes16 out = p * reinterpret_cast<const lanes16&>(bits);
  return under ? splat(0.0f) : out;
}

struct Task {
  const float* q;  // this batch row's: head h, token t at q + h * q_head + t * q_token
  const float* k;  // key s at k + s * k_stride
  const float* v;
  const bool* mask;  // [T, S]
  float* out;      // [T, H, D] of this batch row
  int64_t q_head, q_token, k_stride, v_stride;
  int64_t head, G, H, T, S, first_row, rows;  // KV head `head`; rows [first_row, first_row + rows) of its G * T
};

// Step 3. for rows [i0, i0 + NR) of a task: out = P x V over its S keys, `scores` holding
// P^T [S, 16], each row scaled by its `inverse` sum at the end. Each row's sums are the same
// sequence of operations whatever NR is.
template <int DV, int NR>
void weigh_values(const Task& task, const float* scores, const float* inverse, int64_t i0) {
  constexpr int D = DV * LANES;
  lanes16 acc[NR][DV] = {};
  for (int64_t j = 0; j < task.S; j++) {
    lanes16 value[DV];
    for (int c = 0; c < DV; c++) value[c] = load16(task.v + j * task.v_stride + c * LANES);
    const float* p = scores + j * LANES + i0;
    for (int i = 0; i < NR; i++) {
      for (int c = 0; c < DV; c++) acc[i][c] += p[i] * value[c];
    }
  }
  for (int i = 0; i < NR; i++) {
    const int64_t r = task.first_row + i0 + i, g = r / task.T, t = r % task.T;
    float* o = task.out + (t * task.H + task.head * task.G + g) * D;
    for (int c = 0; c < DV; c++) store16(o + c * LANES, acc[i][c] * inverse[i0 + i]);
  }
}

// The last `rows` rows (fewer than a full block) as one block of exactly that many: NR,
// NR - 1, ..., 1 (a block of 6 rows for 3 did twice the work).
template <int DV, int NR>
void weigh_values_last(int64_t rows, const Task& task, const float* scores, const float* inverse, int64_t i0) {
  if constexpr (NR > 0) {
    if (rows == NR) {
      weigh_values<DV, NR>(task, scores, inverse, i0);
    } else {
      weigh_values_last<DV, NR - 1>(rows, task, scores, inverse, i0);
    }
  }
}

// One task: up to 16 query rows (row r = g * T + t: query head head * G + g, token t) of
// one KV head. `scores` holds [S, 16] floats.
template <int DV>
void attend_rows(const Task& task, float* scores) {
  constexpr int D = DV * LANES;  // DV: vectors a key, value or output row takes
  constexpr int ROWS = ACCUMULATORS / DV < LANES ? ACCUMULATORS / DV : LANES;  // output rows accumulated at once
  const int64_t S = task.S, T = task.T, R = task.rows;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Q^T [D, 16], the scale folded in; lanes past `rows` stay 0.
  alignas(64) float qt[D * LANES] = {};
  for (int64_t i = 0; i < R; i++) {
    const int64_t r = task.first_row + i, g = r / T, t = r % T;
    const float* qr = task.q + (task.head * task.G + g) * task.q_head + t * task.q_token;
    for (int d = 0; d < D; d++) qt[d * LANES + i] = qr[d] * scale;
  }
  // 1. scores^T [S, 16], KEY_BLOCK keys at a time.
  int64_t s = 0;
  for (; s + KEY_BLOCK <= S; s += KEY_BLOCK) {
    lanes16 acc[KEY_BLOCK] = {};
    for (int d = 0; d < D; d++) {
      const lanes16 qd = load16(qt + d * LANES);
      for (int j = 0; j < KEY_BLOCK; j++) acc[j] += task.k[(s + j) * task.k_stride + d] * qd;
    }
    for (int j = 0; j < KEY_BLOCK; j++) store16(scores + (s + j) * LANES, acc[j]);
  }
  for (; s < S; s++) {
    lanes16 acc = {};
    for (int d = 0; d < D; d++) acc += task.k[s * task.k_stride + d] * load16(qt + d * LANES);
    store16(scores + s * LANES, acc);
  }
  // 2. The mask, then softmax down each lane.
  const float hidden = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < R; i++) {
    const bool* seen = task.mask + ((task.first_row + i) % T) * S;
    for (int64_t j = 0; j < S; j++) {
      if (!seen[j]) scores[j * LANES + i] = hidden;
    }
  }
  lanes16 top = splat(hidden);
  for (int64_t j = 0; j < S; j++) {
    const lanes16 x = load16(scores + j * LANES);
    top = x > top ? x : top;
  }
  lanes16 total = {};
  for (int64_t j = 0; j < S; j++) {
    const lanes16 e = exp_nonpositive(load16(scores + j * LANES) - top);
    store16(scores + j * LANES, e);
    total += e;
  }
  alignas(64) float inverse[LANES];
  store16(inverse, splat(1.0f) / total);
  // 3. out = P x V, ROWS rows at a time, the last few as a block of their own size.
  int64_t i0 = 0;
  for (; i0 + ROWS <= R; i0 += ROWS) weigh_values<DV, ROWS>(task, scores, inverse, i0);
  if (i0 < R) weigh_values_last<DV, ROWS - 1>(R - i0, task, scores, inverse, i0);
}

}  // namespace

// out [B, T, H, D] (the layout the output projection reads, as [B, T, H * D]).
torch::Tensor tree_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "4-d q, k, v and mask expected");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32, "float32 q, k and v expected");
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.is_contiguous(), "a contiguous bool mask expected");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && mask.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "q, k and v with their last dimension contiguous expected");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t H_kv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == H_kv && v.size(2) == S && k.size(3) == D &&
              v.size(3) == D, "k and v [B, H_kv, S, D] expected");
  TORCH_CHECK(H_kv > 0 && H % H_kv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(D % LANES == 0 && D <= LANES * MAX_HEAD_VECTORS, "head dim a multiple of 16 up to 128 expected, got ", D);
  TORCH_CHECK((mask.size(0) == B || mask.size(0) == 1) && mask.size(1) == 1 && mask.size(2) == T &&
              mask.size(3) == S, "mask [B or 1, 1, T, S] expected");
  auto out = torch::empty({B, T, H, D}, q.options());
  const int64_t G = H / H_kv, chunks = (G * T + LANES - 1) / LANES;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  // Tasks: (batch row, KV head, chunk of 16 query rows), over torch's threads.
  at::parallel_for(0, B * H_kv * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(S * LANES);  // [S, 16]
    float* buffer = scores.data();
    for (int64_t id = begin; id < end; id++) {
      const int64_t b = id / (H_kv * chunks), head = (id / chunks) % H_kv, chunk = id % chunks;
      const int64_t first = chunk * LANES;
      const Task task{qp + b * q.stride(0), kp + b * k.stride(0) + head * k.stride(1),
                      vp + b * v.stride(0) + head * v.stride(1), mp + (mask.size(0) == 1 ? 0 : b) * T * S,
                      op + b * T * H * D, q.stride(1), q.stride(2), k.stride(2), v.stride(2), head, G, H, T, S,
                      first, std::min<int64_t>(LANES, G * T - first)};
      switch (D / LANES) {
        case 1: attend_rows<1>(task, buffer); break;
        case 2: attend_rows<2>(task, buffer); break;
        case 3: attend_rows<3>(task, buffer); break;
        case 4: attend_rows<4>(task, buffer); break;
        case 5: attend_rows<5>(task, buffer); break;
        case 6: attend_rows<6>(task, buffer); break;
        case 7: attend_rows<7>(task, buffer); break;
        default: attend_rows<8>(task, buffer); break;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_attention", &tree_attention,
        "grouped-query attention of a few queries over cached keys and values, with a bool mask (CPU, float32)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("mask"));
}
