// verify_sampling: multi-round rejection sampling (SpecInfer / EAGLE) over a batch of
// token trees; lossless for any drafter. Twin:
// backend_src/specdec/ops/verify_sampling.py::verify_sampling_torch, whose docstring
// is the contract; the arithmetic below follows it operation by operation:
//
//   p = target_probs[0]; walk down from the root, trying the current node's children
//   in index (= rank) order. Child c with token x and q = draft_probs[parent] (or
//   one-hot at x) is accepted when p[x] > 0 and fl32(u[c] * q[x]) <= p[x]; then
//   p = target_probs[c] and its children are tried. On rejection
//   r = max(p - q, 0) (float32), T = sum(r) (float64); if T > 0: p = fl32(r / T).
//   With no child accepted (or at a leaf) the bonus token is the first k with p[k] > 0
//   and cumsum(p)[k] > bonus_u * sum(p) (float64), else the last k with p[k] > 0,
//   else 0.
//
// One block per request (blockDim a power of two, <= 1024); threads cooperate over V
// for the residual and the inverse-CDF draw. The residual lives in workspace[b] ([V]
// float32), rewritten in place: every thread reads and writes only its own indices, and
// a barrier separates the residual pass from any read of p[x]. Sums are float64 so that
// the kernel and the twin differ only when a uniform falls within ~1e-15 of a decision
// boundary. Compile without FMA contraction (--fmad=false): the products are compared.

#define VS_MAX_THREADS 1024
#define VS_NOT_FOUND 0x7fffffff

// Sum of v over the block, returned to every thread. Leaves `scratch` reusable.
__device__ double vs_block_sum(double v, double* scratch) {
  const int t = threadIdx.x;
  scratch[t] = v;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (t < stride) scratch[t] += scratch[t + stride];
    __syncthreads();
  }
  const double total = scratch[0];
  __syncthreads();
  return total;
}

extern "C" __global__ void verify_sampling(
    const long long* candidates,  // [B, N]
    const long long* parents,     // [B, N]
    const long long* num_nodes,   // [B]
    const float* target_probs,    // [B, N, V]
    const float* draft_probs,     // [B, N, V]; any valid pointer when has_draft == 0
    const float* uniforms,        // [B, N]
    const float* bonus_uniforms,  // [B]
    float* workspace,             // [B, V] scratch: the current residual
    long long* accept_len,        // [B] out: accepted draft tokens
    long long* accepted_nodes,    // [B, N] out: path from 0, -1 padded
    long long* bonus_token,       // [B] out
    int N, int V, int has_draft) {
  __shared__ double scratch[VS_MAX_THREADS];
  __shared__ double carry;
  __shared__ int found;
  __shared__ int last_positive;

  const int b = blockIdx.x;
  const int t = threadIdx.x;
  const long long row0 = (long long)b * N;
  const long long* par = parents + row0;
  const long long* cand = candidates + row0;
  const float* tp = target_probs + row0 * V;
  const float* dp = draft_probs + row0 * V;
  float* ws = workspace + (long long)b * V;
  long long n = num_nodes[b];
  n = n < 1 ? 1 : (n > N ? N : n);

  for (int k = t; k < N; k += blockDim.x) accepted_nodes[row0 + k] = (k == 0) ? 0 : -1;
  __syncthreads();  // thread 0 overwrites some of these below

  // Every thread holds the same cur / p / loop state: control flow is block-uniform.
  const float* p = tp;  // current distribution: a target row or the workspace
  long long cur = 0;
  long long len = 0;
  bool descended = true;
  while (descended) {
    descended = false;
    for (long long c = cur + 1; c < n; ++c) {
      if (par[c] != cur) continue;
      const long long x = cand[c];
      if (x < 0 || x >= V) continue;  // malformed token: never accepted, no residual
      const float* q = dp + cur * V;
      const float qx = has_draft ? q[x] : 1.0f;
      const float px = p[x];
      if (px > 0.0f && __fmul_rn(uniforms[row0 + c], qx) <= px) {
        cur = c;
        ++len;
        p = tp + c * V;
        if (t == 0) accepted_nodes[row0 + len] = c;
        descended = true;
        break;
      }
      // Rejected: p <- norm(max(p - q, 0)). The first pass only sums, so that p stays
      // intact when the residual is empty (T == 0).
      double local = 0.0;
      for (int i = t; i < V; i += blockDim.x) {
        const float qi = has_draft ? q[i] : (i == x ? 1.0f : 0.0f);
        local += (double)fmaxf(p[i] - qi, 0.0f);
      }
      const double T = vs_block_sum(local, scratch);  // also orders the p[x] reads above
      if (T > 0.0) {
        for (int i = t; i < V; i += blockDim.x) {
          const float qi = has_draft ? q[i] : (i == x ? 1.0f : 0.0f);
          ws[i] = (float)((double)fmaxf(p[i] - qi, 0.0f) / T);
        }
        __syncthreads();
        p = ws;
      }
    }
  }

  // Bonus token: inverse CDF of p, scanned in tiles of blockDim with a running carry.
  double local = 0.0;
  for (int i = t; i < V; i += blockDim.x) local += (double)p[i];
  const double total = vs_block_sum(local, scratch);
  const double threshold = (double)bonus_uniforms[b] * total;
  if (t == 0) {
    carry = 0.0;
    found = VS_NOT_FOUND;
    last_positive = -1;
  }
  __syncthreads();
  for (int base = 0; base < V; base += blockDim.x) {
    const int i = base + t;
    const double v = (i < V) ? (double)p[i] : 0.0;
    scratch[t] = v;
    __syncthreads();
    for (int offset = 1; offset < (int)blockDim.x; offset <<= 1) {  // inclusive scan
      const double left = (t >= offset) ? scratch[t - offset] : 0.0;
      __syncthreads();
      scratch[t] += left;
      __syncthreads();
    }
    if (v > 0.0) {
      if (carry + scratch[t] > threshold) atomicMin(&found, i);
      atomicMax(&last_positive, i);
    }
    __syncthreads();
    if (t == 0) carry += scratch[blockDim.x - 1];
    __syncthreads();
    if (found != VS_NOT_FOUND) break;
  }
  if (t == 0) {
    accept_len[b] = len;
    bonus_token[b] = (found != VS_NOT_FOUND) ? found : (last_positive >= 0 ? last_positive : 0);
  }
}
