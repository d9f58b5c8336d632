// Cache moves for compaction: the launcher's plain C++ interface.
//
// No CUDA or torch types here, so the torch binding (move_kv_binding.cpp) compiles with
// the host compiler alone and the kernel (move_kv_kernel.cu) compiles with nvcc alone.
#pragma once

#include <cstdint>

namespace kvcompress {

// One launch moves K and V of `num_moves` tokens inside the page pool
// `[num_pages, 2, page_size, head_size]` (any element type: rows are copied as bytes).
struct MoveKVParams {
  void* pool;                // base address of pool[0, 0, 0, 0]
  const void* src_slots;     // [num_moves] int32 or int64: page * page_size + offset
  const void* dst_slots;     // same length and type; a negative entry on either side skips
  bool slots_are_int64;
  int64_t num_moves;
  int64_t page_size;
  int64_t stride_page_bytes;   // pool.stride(0) * element size
  int64_t stride_kv_bytes;     // pool.stride(1) * element size (K -> V)
  int64_t stride_token_bytes;  // pool.stride(2) * element size
  int64_t row_bytes;           // head_size * element size (the last dim is contiguous)
};

// Enqueues the copy on `stream` (a cudaStream_t). Contract, as for the Triton move:
// destinations are distinct and none is the source of another move in the same call.
// Returns 0 on success, else a cudaError_t value (see move_kv_error_string).
int move_kv_launch(const MoveKVParams& params, void* stream);

const char* move_kv_error_string(int status);

}  // namespace kvcompress
