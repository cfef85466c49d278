// The small operations around a decoder layer's matmuls on the CPU, one call each:
//
//   rms_norm(x, w, eps)          y = w * (x * 1 / sqrt(mean(x^2) + eps))     per row of x [R, H]
//   silu_mul(gate_up)            y = silu(g) * u, g and u the halves of each row [R, 2I] -> [R, I]
//   rope_qkv(qkv, cos, sin, ...) the fused q/k/v projection's output [B, T, (H_q + 2 H_kv) D] split
//                                into q [B, H_q, T, D] and k, v [B, H_kv, T, D], RoPE applied to
//                                q and k (rotate-half: x * cos + rotate(x) * sin)
//   write_kv(kv, layer, slot, start, k, v)
//                                one request's new keys and values k, v [H_kv, T, D] into the KV
//                                cache kv [L, 2, S, H_kv, P, D] at positions [start, start + T)
//   greedy_tokens(logits)        the index of each row's largest value, [..., V] -> [...] int64: the
//                                first one on ties, the first NaN where a row has one (as torch's
//                                max(dim).indices, the twin in specdec/sampling.py)
//   top_log_probs(logits, k, t)  the k largest log-probabilities of each row of logits / t, best
//                                first, and their indices, [..., V] -> [..., k] twice: a drafter's
//                                candidates (log_softmax(logits / t).topk(k), the twin in
//                                specdec/drafters/eagle.py)
//
// Built at run time by specdec/models/cpu_layer_ops.py (torch.utils.cpp_extension, -march of
// the machine it runs on). Their torch twins are the layers' own code (RMSNorm.forward,
// MLP.forward's silu and product, Attention's split, reshapes and `rope`; greedy_tokens's is
// sampling.greedy_tokens's max, top_log_probs's EagleDrafter.top_log_probs's torch code).
//
// In a decode step these operate on a few rows of 576-1536 values: microseconds of
// arithmetic, while torch spends several operators on each (a norm is eight: a cast,
// pow, mean, add, rsqrt, two products and a cast back), each paying its dispatch and an
// allocation. SmolLM2's 30 layers made that most of a plain step beside its matmuls.
//
// Results: rope_qkv's are its twin's bit for bit (the same two products and sum, kept
// apart: no fused multiply-add), write_kv's copies too. rms_norm sums the squares in another order than torch's
// mean and silu_mul has its own exp (within 2 ulp), so theirs differ from the twins' in
// the last bits. greedy_tokens's equal its twin's. top_log_probs picks the twin's tokens (the
// lowest index first among equal values, where torch's order is its own) and its values differ
// from the twin's in the last bits (its own exp and sum). A row's result depends on that row alone.
//
// Needs float32 on the CPU with contiguous rows: x [R, H] and w [H]; gate_up [R, 2I]; logits [..., V];
// qkv [B, T, (H_q + 2 H_kv) D] contiguous, cos and sin [B, 1, T, D] contiguous, D even; kv
// contiguous, k and v contiguous and inside it.
// The Python side checks these and falls back to the twins.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float lanes16 __attribute__((vector_size(64), aligned(4)));  // 16 floats, unaligned loads
typedef int32_t ints16 __attribute__((vector_size(64), aligned(4)));

constexpr int LANES = 16;
constexpr int64_t ROWS_PER_TASK = 16;  // rows a thread takes at a time (a prompt's thousands split; a step's few not)

inline lanes16 load16(const float* p) { return *reinterpret_cast<const lanes16*>(p); }
inline void store16(float* p, lanes16 v) { *reinterpret_cast<lanes16*>(p) = v; }
inline lanes16 splat(float x) { return lanes16{} + x; }

// One head's RoPE, D values. Each product is rounded before the sum, never fused into a
// multiply-add (GCC contracts a * b + c by default, -ffp-contract=fast), so that it rounds
// as torch's twin does. (GCC does not inline a function with other optimize options.)
__attribute__((optimize("fp-contract=off"))) void rotate_row(
    const float* x, const float* cos, const float* sin, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {  // x * cos + (-x[d + half]) * sin, then x * cos + x[d - half] * sin
    out[d] = x[d] * cos[d] + (-x[d + half]) * sin[d];
    out[d + half] = x[d + half] * cos[d + half] + x[d] * sin[d + half];
  }
}

// exp(x) for lanes in [-87, 88] (callers clamp): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by
// Cephes' expf polynomial (within 2 ulp), times 2^n.
inline lanes16 exp_clamped(lanes16 x) {
  const lanes16 round = splat(12582912.0f);  // 1.5 * 2^23: adding and taking it away rounds to an integer
  const lanes16 n = (x * 1.44269504088896341f + round) - round;
  const lanes16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts
  lanes16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ints16 scale = (__builtin_convertvector(n, ints16) + 127) << 23;  // 2^n as float32 bits
  return p * reinterpret_cast<const lanes16&>(scale);
}

inline float exp_scalar(float x) {
  lanes16 v = splat(x);
  return exp_clamped(v)[0];
}

inline lanes16 clamp16(lanes16 x, float low, float high) {
  x = x < low ? splat(low) : x;
  return x > high ? splat(high) : x;
}

void check_cpu_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu(), name, ": float32 on the CPU expected");
  TORCH_CHECK(t.is_contiguous(), name, ": a contiguous tensor expected");
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_cpu_float(x, "x");
  check_cpu_float(weight, "weight");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "weight [", H, "] expected");
  auto out = torch::empty_like(x);
  const int64_t R = H ? x.numel() / H : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t vec_end = H - H % LANES;
  at::parallel_for(0, R, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * H;
      float* dst = op + r * H;
      lanes16 acc = {};
      for (int64_t h = 0; h < vec_end; h += LANES) {
        const lanes16 v = load16(row + h);
        acc += v * v;
      }
      float sum = 0.0f;
      for (int i = 0; i < LANES; ++i) sum += acc[i];
      for (int64_t h = vec_end; h < H; ++h) sum += row[h] * row[h];
      const float scale = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t h = 0; h < vec_end; h += LANES) store16(dst + h, load16(wp + h) * (load16(row + h) * scale));
      for (int64_t h = vec_end; h < H; ++h) dst[h] = wp[h] * (row[h] * scale);
    }
  });
  return out;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_cpu_float(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1);
  TORCH_CHECK(width % 2 == 0, "gate_up: an even last dimension expected, got ", width);
  const int64_t I = width / 2;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = I;
  auto out = torch::empty(shape, gate_up.options());
  const int64_t R = I ? gate_up.numel() / width : 0;
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t vec_end = I - I % LANES;
  at::parallel_for(0, R, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gp + r * width;
      const float* up = gate + I;
      float* dst = op + r * I;
      for (int64_t i = 0; i < vec_end; i += LANES) {
        const lanes16 g = load16(gate + i);
        store16(dst + i, g / (1.0f + exp_clamped(clamp16(-g, -87.0f, 88.0f))) * load16(up + i));
      }
      for (int64_t i = vec_end; i < I; ++i) {
        const float g = gate[i];
        const float e = exp_scalar(std::fmin(std::fmax(-g, -87.0f), 88.0f));
        dst[i] = g / (1.0f + e) * up[i];
      }
    }
  });
  return out;
}

std::vector<torch::Tensor> rope_qkv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                    int64_t n_heads, int64_t n_kv, int64_t head_dim) {
  check_cpu_float(qkv, "qkv");
  check_cpu_float(cos, "cos");
  check_cpu_float(sin, "sin");
  TORCH_CHECK(qkv.dim() == 3, "qkv [B, T, (H_q + 2 H_kv) D] expected");
  const int64_t B = qkv.size(0), T = qkv.size(1), D = head_dim;
  TORCH_CHECK(D > 0 && D % 2 == 0 && qkv.size(2) == (n_heads + 2 * n_kv) * D,
              "qkv's last dimension must be (", n_heads, " + 2 * ", n_kv, ") * ", D);
  TORCH_CHECK(cos.dim() == 4 && cos.sizes() == sin.sizes() && cos.size(0) == B && cos.size(1) == 1 &&
              cos.size(2) == T && cos.size(3) == D, "cos and sin [B, 1, T, D] expected");
  auto q = torch::empty({B, n_heads, T, D}, qkv.options());
  auto k = torch::empty({B, n_kv, T, D}, qkv.options());
  auto v = torch::empty({B, n_kv, T, D}, qkv.options());
  const int64_t width = qkv.size(2);
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  at::parallel_for(0, B * T, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      const float* row = src + bt * width;
      const float* c = cp + bt * D;  // [B, 1, T, D]: row (b, t)
      const float* s = sp + bt * D;
      for (int64_t h = 0; h < n_heads; ++h) rotate_row(row + h * D, c, s, qp + ((b * n_heads + h) * T + t) * D, D);
      for (int64_t h = 0; h < n_kv; ++h) {
        const int64_t dst = ((b * n_kv + h) * T + t) * D;
        rotate_row(row + (n_heads + h) * D, c, s, kp + dst, D);
        std::memcpy(vp + dst, row + (n_heads + n_kv + h) * D, D * sizeof(float));
      }
    }
  });
  return {q, k, v};
}

void write_kv(torch::Tensor& kv, int64_t layer, int64_t slot, int64_t start, const torch::Tensor& k,
              const torch::Tensor& v) {
  check_cpu_float(kv, "kv");
  check_cpu_float(k, "k");
  check_cpu_float(v, "v");
  TORCH_CHECK(kv.dim() == 6 && kv.size(1) == 2, "kv [L, 2, S, H_kv, P, D] expected");
  const int64_t L = kv.size(0), S = kv.size(2), H = kv.size(3), P = kv.size(4), D = kv.size(5);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == H && k.size(2) == D,
              "k and v [", H, ", T, ", D, "] expected");
  const int64_t T = k.size(1);
  TORCH_CHECK(layer >= 0 && layer < L && slot >= 0 && slot < S && start >= 0 && start + T <= P,
              "layer ", layer, ", slot ", slot, " or positions [", start, ", ", start + T, ") outside the cache");
  float* base = kv.data_ptr<float>();
  const float* parts[2] = {k.data_ptr<float>(), v.data_ptr<float>()};
  for (int64_t part = 0; part < 2; ++part) {
    for (int64_t h = 0; h < H; ++h) {
      float* dst = base + ((((layer * 2 + part) * S + slot) * H + h) * P + start) * D;
      std::memcpy(dst, parts[part] + h * T * D, T * D * sizeof(float));  // T consecutive positions
    }
  }
}

torch::Tensor greedy_tokens(const torch::Tensor& logits) {
  check_cpu_float(logits, "logits");
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) > 0, "logits [..., V > 0] expected");
  const int64_t V = logits.size(-1), R = logits.numel() / V;
  std::vector<int64_t> shape(logits.sizes().begin(), logits.sizes().end() - 1);
  auto out = torch::empty(shape, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t vec_end = V - V % LANES;
  at::parallel_for(0, R, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = lp + r * V;
      // Each lane keeps its first largest value (a strict >) and where it was; a NaN never
      // compares larger, so NaNs are only noted, and looked for again at the end.
      int64_t best_at = 0;
      float best = row[0];
      bool nan = false;
      if (vec_end > 0) {
        lanes16 top = load16(row);
        ints16 at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        ints16 seen_nan = top != top;
        const ints16 step = ints16{} + LANES;
        ints16 here = at;
        for (int64_t v = LANES; v < vec_end; v += LANES) {
          here += step;
          const lanes16 x = load16(row + v);
          const ints16 larger = x > top;
          top = larger ? x : top;
          at = larger ? here : at;
          seen_nan |= x != x;
        }
        best = top[0];
        best_at = at[0];
        for (int i = 1; i < LANES; ++i) {  // the largest, the lowest index among equals
          if (top[i] > best || (top[i] == best && at[i] < best_at)) {
            best = top[i];
            best_at = at[i];
          }
        }
        for (int i = 0; i < LANES; ++i) nan |= seen_nan[i] != 0;
      }
      for (int64_t v = vec_end; v < V; ++v) {
        if (row[v] > best) {
          best = row[v];
          best_at = v;
        }
        nan |= row[v] != row[v];
      }
      if (nan) {
        for (int64_t v = 0; v < V; ++v) {
          if (row[v] != row[v]) {
            best_at = v;
            break;
          }
        }
      }
      op[r] = best_at;
    }
  });
  return out;
}

std::vector<torch::Tensor> top_log_probs(const torch::Tensor& logits, int64_t k, double temperature) {
  check_cpu_float(logits, "logits");
  TORCH_CHECK(logits.dim() >= 1, "logits [..., V] expected");
  const int64_t V = logits.size(-1), R = V ? logits.numel() / V : 0;
  TORCH_CHECK(k >= 1 && k <= V, "k in [1, ", V, "] expected, got ", k);
  TORCH_CHECK(temperature > 0, "a positive temperature expected");
  std::vector<int64_t> shape(logits.sizes().begin(), logits.sizes().end());
  shape.back() = k;
  auto values = torch::empty(shape, logits.options());
  auto indices = torch::empty(shape, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  const float t = static_cast<float>(temperature);
  const int64_t vec_end = V - V % LANES;
  // A row is a few thousand exps: a drafting depth's 4-16 rows are shared out two at a time
  at::parallel_for(0, R, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> scaled(V);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = lp + r * V;
      float* y = scaled.data();
      // 1. y = logits / t (a division, as the twin's), its largest value
      lanes16 top = splat(-std::numeric_limits<float>::infinity());
      for (int64_t v = 0; v < vec_end; v += LANES) {
        const lanes16 x = load16(row + v) / t;
        store16(y + v, x);
        top = x > top ? x : top;
      }
      float largest = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < LANES; ++i) largest = std::fmax(largest, top[i]);
      for (int64_t v = vec_end; v < V; ++v) {
        y[v] = row[v] / t;
        largest = std::fmax(largest, y[v]);
      }
      // 2. log(sum(exp(y - largest))), every term in [-87, 0] (below, exp is 0 to float32's eye)
      lanes16 total = {};
      for (int64_t v = 0; v < vec_end; v += LANES) total += exp_clamped(clamp16(load16(y + v) - largest, -87.0f, 0.0f));
      float sum = 0.0f;
      for (int i = 0; i < LANES; ++i) sum += total[i];
      for (int64_t v = vec_end; v < V; ++v) sum += exp_scalar(std::fmin(std::fmax(y[v] - largest, -87.0f), 0.0f));
      const float shift = largest + std::log(sum);
      // 3. the k largest, best first, the lowest index first among equals: a sorted list that a
      //    value enters only when larger than its last one (16 values checked at a time)
      float* best = vp + r * k;
      int64_t* at = ip + r * k;
      int64_t held = 0;
      auto offer = [&](float x, int64_t v) {
        if (held == k && !(x > best[k - 1])) return;
        int64_t j = held < k ? held++ : k - 1;
        for (; j > 0 && x > best[j - 1]; --j) {
          best[j] = best[j - 1];
          at[j] = at[j - 1];
        }
        best[j] = x;
        at[j] = v;
      };
      int64_t v = 0;
      for (; v < vec_end; v += LANES) {
        if (held == k) {
          const ints16 larger = load16(y + v) > splat(best[k - 1]);
          bool any = false;
          for (int i = 0; i < LANES; ++i) any |= larger[i] != 0;
          if (!any) continue;
        }
        for (int i = 0; i < LANES; ++i) offer(y[v + i], v + i);
      }
      for (; v < V; ++v) offer(y[v], v);
      for (int64_t j = 0; j < k; ++j) best[j] -= shift;
    }
  });
  return {values, indices};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMS norm of each row times the weight (CPU, float32)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("silu_mul", &silu_mul, "silu of each row's first half times its second half (CPU, float32)",
        pybind11::arg("gate_up"));
  m.def("rope_qkv", &rope_qkv, "q, k, v split from a fused projection's output, RoPE on q and k (CPU, float32)",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("n_heads"),
        pybind11::arg("n_kv"), pybind11::arg("head_dim"));
  m.def("write_kv", &write_kv, "one request's new keys and values into the KV cache (CPU, float32)",
        pybind11::arg("kv"), pybind11::arg("layer"), pybind11::arg("slot"), pybind11::arg("start"),
        pybind11::arg("k"), pybind11::arg("v"));
  m.def("top_log_probs", &top_log_probs, "the k largest log-probabilities of each row of logits / t (CPU, float32)",
        pybind11::arg("logits"), pybind11::arg("k"), pybind11::arg("temperature"));
  m.def("greedy_tokens", &greedy_tokens, "the index of each row's largest value, the first on ties (CPU, float32)",
        pybind11::arg("logits"));
}
