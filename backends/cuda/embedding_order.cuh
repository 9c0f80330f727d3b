// The embedding backward's kernels (Note [embedding rows sorted on the device]): a stable sort of the positions by
// token id on the GPU, the first position of each id, and the per-row sums. Included by nn.cu inside its anonymous
// namespace (in tg::backend::cuda); it includes nothing itself: the includer supplies acc_t, scalar_cast,
// TG_GRID_STRIDE and the CUDA built-ins. tests/cuda/test_rows_emulated.cpp runs the kernels' bodies, unchanged, on
// the CPU (with __shared__ as a static array the running block's threads share).

// Note [embedding rows sorted on the device]
// Row v of the embedding's weight gradient sums dout over the positions whose id is v, in ascending position order
// (the CPU kernel's order: the sums are the CPU's bit for bit, and the same on every run). Both backends find those
// positions with a stable sort of the positions by id. The GPU sorts on the device, from the ids the forward
// uploaded again, so that the backward reads nothing the host computed from the batch: no host pass over V + n
// entries per micro-batch, no upload of V + 1 row starts (400 KiB for GPT-2's padded vocabulary), and a CUDA
// graph captured from one step can sort the next step's ids itself.
//
// The sort is a least-significant-digit radix sort with 8-bit digits (one pass for V <= 256, two up to 65536,
// three up to 2^24): each pass reads the keys (the ids) and values (the positions; the identity in the first
// pass) and writes them ordered by one digit, keeping the order of equal digits, so after the last pass the
// positions are ordered by id and, within an id, by position. A pass is three kernels:
//   order_count:   one block per chunk of kOrderChunk positions, a thread per position: the chunk's count of each
//                  digit value, written bucket-major (counts[digit * chunks + chunk]).
//   order_scan:    one block: the exclusive prefix sum of those counts, in place. Bucket-major order makes entry
//                  (d, c) the number of positions with a smaller digit, plus those with digit d in earlier chunks:
//                  where chunk c's first position with digit d goes.
//   order_scatter: as order_count; each position goes to its (digit, chunk) entry plus its rank, the number of
//                  the chunk's earlier positions with the same digit.
// A thread finds its rank (and whether it is its digit's last in the chunk, which gives order_count the count
// without atomics) by comparing its digit with the chunk's 256 in shared memory: 256 comparisons per position and
// pass, the threads of a warp reading the same word at once. Integer counts only, no atomics: every launch gives
// the same result. Then order_start finds each id's first position in the sorted ids by a binary search
// (start[V] = n), and embedding_backward_kernel sums each row of dw in that order (one block per row).
// Memory: the ids (n int64), two key and two value buffers (4n int64), 256 · ceil(n / 256) counts and V + 1
// starts. Launches: three per pass, then two.

constexpr int kOrderChunk = 256;            // positions per block of order_count / order_scatter (one per thread)
constexpr int kOrderBits = 8;               // a pass's digit
constexpr int kOrderBuckets = 1 << kOrderBits;
constexpr int kOrderScanThreads = 1024;     // order_scan's one block
static_assert(kOrderChunk == kOrderBuckets, "order_count clears and writes a bucket per thread");

/// Thread t's rank among the chunk's m digits (how many before it are equal to its own), and whether no later one is.
__device__ __forceinline__ int order_rank(const int* digit, int t, int m, bool* last) {
  const int d = digit[t];
  int before = 0;
  bool later = false;
  for (int u = 0; u < m; ++u) {
    const bool same = digit[u] == d;
    before += (same && u < t) ? 1 : 0;
    later = later || (same && u > t);
  }
  *last = !later;
  return before;
}

/// The chunk's digits of this pass in shared memory; returns the chunk's size (blockDim.x == kOrderChunk).
__device__ __forceinline__ int order_load_digits(const std::int64_t* keys, std::int64_t n, int shift, int* digit) {
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * kOrderChunk;
  const int m = n - first < kOrderChunk ? static_cast<int>(n - first) : kOrderChunk;
  const int t = static_cast<int>(threadIdx.x);
  if (t < m) digit[t] = static_cast<int>((keys[first + t] >> shift) & (kOrderBuckets - 1));
  return m;
}

/// counts[d * chunks + c] = the positions of chunk c (this block) whose digit is d.
__global__ void order_count_kernel(const std::int64_t* keys, std::int64_t n, int shift, int* counts,
                                   std::int64_t chunks) {
  __shared__ int digit[kOrderChunk];
  __shared__ int count[kOrderBuckets];
  const int t = static_cast<int>(threadIdx.x);
  count[t] = 0;
  const int m = order_load_digits(keys, n, shift, digit);
  __syncthreads();
  if (t < m) {
    bool last = false;
    const int r = order_rank(digit, t, m, &last);
    if (last) count[digit[t]] = r + 1;  // one writer per digit value: its last position
  }
  __syncthreads();
  counts[static_cast<std::int64_t>(t) * chunks + blockIdx.x] = count[t];
}

/// counts[0, total) replaced by its exclusive prefix sum (one block: each thread a contiguous segment).
__global__ void order_scan_kernel(int* counts, std::int64_t total) {
  __shared__ std::int64_t part[kOrderScanThreads];
  const int t = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  const std::int64_t per = (total + threads - 1) / threads;
  const std::int64_t b = t * per < total ? t * per : total, e = b + per < total ? b + per : total;
  std::int64_t sum = 0;
  for (std::int64_t i = b; i < e; ++i) sum += counts[i];
  part[t] = sum;
  __syncthreads();
  if (t == 0) {
    std::int64_t run = 0;
    for (int u = 0; u < threads; ++u) {
      const std::int64_t s = part[u];
      part[u] = run;
      run += s;
    }
  }
  __syncthreads();
  std::int64_t run = part[t];
  for (std::int64_t i = b; i < e; ++i) {
    const int c = counts[i];
    counts[i] = static_cast<int>(run);
    run += c;
  }
}

/// One pass's stable scatter: this chunk's keys and values (vals == nullptr: the positions themselves) to their
/// places by digit, after order_scan turned the counts into places.
__global__ void order_scatter_kernel(const std::int64_t* keys, const std::int64_t* vals, std::int64_t n, int shift,
                                     const int* place, std::int64_t chunks, std::int64_t* keys_out,
                                     std::int64_t* vals_out) {
  __shared__ int digit[kOrderChunk];
  const int t = static_cast<int>(threadIdx.x);
  const int m = order_load_digits(keys, n, shift, digit);
  __syncthreads();
  if (t < m) {
    bool last = false;
    const int r = order_rank(digit, t, m, &last);
    const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kOrderChunk + t;
    const std::int64_t at = place[static_cast<std::int64_t>(digit[t]) * chunks + blockIdx.x] + r;
    keys_out[at] = keys[i];
    vals_out[at] = vals != nullptr ? vals[i] : i;
  }
}

/// start[v] = the first place of id v in the sorted ids (the number of ids below v), for v in [0, V]; start[V] = n.
__global__ void order_start_kernel(const std::int64_t* sorted, std::int64_t n, std::int64_t* start, std::int64_t V) {
  TG_GRID_STRIDE(v, V + 1) {
    std::int64_t lo = 0, hi = n;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (sorted[mid] < v) lo = mid + 1;
      else hi = mid;
    }
    start[v] = lo;
  }
}

/// Row v of dw sums dout over positions order[start[v] .. start[v+1]) (ascending position order) in acc_t<T>.
template <class T>
__global__ void embedding_backward_kernel(const T* dout, const std::int64_t* start, const std::int64_t* order, T* dw,
                                          std::int64_t V, std::int64_t C) {
  using A = acc_t<T>;
  for (std::int64_t v = blockIdx.x; v < V; v += gridDim.x) {
    const std::int64_t p0 = start[v], p1 = start[v + 1];
    for (std::int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      A acc = 0;
      for (std::int64_t p = p0; p < p1; ++p) acc += scalar_cast<A>(dout[order[p] * C + j]);
      dw[v * C + j] = scalar_cast<T>(acc);
    }
  }
}

/// The sort's passes for ids below V (8 bits each; at least one, which also makes the positions' array).
inline int order_passes(std::int64_t V) {
  int bits = 0;
  while (bits < 63 && ((V - 1) >> bits) > 0) ++bits;
  const int passes = (bits + kOrderBits - 1) / kOrderBits;
  return passes > 0 ? passes : 1;
}
