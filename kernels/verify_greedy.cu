// verify_greedy: greedy acceptance of a batch of token trees against the target's argmax.
// Twin: backend_src/specdec/ops/verify_greedy.py::verify_greedy_torch.
//
// Node i > 0 matches when candidates[i] == target_argmax[parents[i]] (the target's
// next-token choice after the parent); it is accepted when it and all its ancestors
// match. The root (node 0) is always accepted. The deepest accepted node wins, the
// lowest index on ties; its path is written root first, -1 after it:
//
//   parents  -1  0  0  1        candidates     [r, a, b, c]
//   target_argmax [a, c, x, y]  -> nodes 1 and 3 accepted, 2 rejected (b != a)
//   accept_len 2, accepted_nodes [0, 1, 3, -1], bonus_token target_argmax[3] = y
//
// One block per request; threads stride over nodes, each walking its own ancestor
// chain; the winner is a shared-memory atomicMax over (depth << 32 | ~index).

extern "C" __global__ void verify_greedy(
    const long long* __restrict__ candidates,     // [B, N]
    const long long* __restrict__ parents,        // [B, N]
    const long long* __restrict__ num_nodes,      // [B]
    const long long* __restrict__ target_argmax,  // [B, N]
    long long* __restrict__ accept_len,           // [B] out: accepted draft tokens
    long long* __restrict__ accepted_nodes,       // [B, N] out: path from 0, -1 padded
    long long* __restrict__ bonus_token,          // [B] out
    int N) {
  const int b = blockIdx.x;
  const long long row0 = (long long)b * N;
  const long long* par = parents + row0;
  const long long* cand = candidates + row0;
  const long long* amax = target_argmax + row0;
  long long n = num_nodes[b];
  n = n < 1 ? 1 : (n > N ? N : n);

  __shared__ unsigned long long best;  // (depth << 32) | (0xffffffff - node)
  if (threadIdx.x == 0) best = 0xffffffffull;  // the root: depth 0, node 0
  __syncthreads();

  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    bool ok = true;
    unsigned long long d = 0;
    long long j = i;
    // The step bound only guards malformed input (parents[j] >= j).
    while (j > 0 && d < (unsigned long long)N) {
      const long long p = par[j];
      if (p < 0 || p >= n || cand[j] != amax[p]) {  // padding is never accepted
        ok = false;
        break;
      }
      ++d;
      j = p;
    }
    if (ok) atomicMax(&best, (d << 32) | (0xffffffffull - (unsigned long long)i));
  }
  __syncthreads();

  const long long winner = (long long)(0xffffffffull - (best & 0xffffffffull));
  const long long win_depth = (long long)(best >> 32);
  for (int k = threadIdx.x; k < N; k += blockDim.x) {
    if (k > win_depth) accepted_nodes[row0 + k] = -1;
  }
  if (threadIdx.x == 0) {
    long long j = winner;
    for (long long k = win_depth; k > 0; --k) {
      accepted_nodes[row0 + k] = j;
      j = par[j];
    }
    accepted_nodes[row0] = 0;
    accept_len[b] = win_depth;
    bonus_token[b] = amax[winner];
  }
}
