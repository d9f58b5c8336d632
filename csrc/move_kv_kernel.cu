// CUDA cache-move kernel for compaction (standalone: no torch headers).
//
// Every move copies two rows (K, V) of `row_bytes` bytes from the source slot to the
// destination slot. Work items are (move, K/V, word) triples over a grid-stride loop;
// a word is the widest of 16/8/4/2/1 bytes that divides the row, the strides and the
// pool address, so bf16/fp16/fp32 rows of usual head sizes move as 16-byte vectors.
#include <cuda_runtime.h>

#include <cstdint>

#include "move_kv.h"

namespace kvcompress {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kMaxBlocks = 65535;  // the grid-stride loop covers the rest

template <typename Word, typename Index>
__global__ void move_kv_kernel(char* __restrict__ pool, const Index* __restrict__ src_slots,
                               const Index* __restrict__ dst_slots, int64_t num_moves,
                               int64_t page_size, int64_t stride_page, int64_t stride_kv,
                               int64_t stride_token, int64_t words_per_row) {
  const int64_t words_per_move = 2 * words_per_row;
  const int64_t total = num_moves * words_per_move;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       item < total; item += step) {
    const int64_t move = item / words_per_move;
    const int64_t rest = item - move * words_per_move;
    const int64_t kv = rest / words_per_row;
    const int64_t word = rest - kv * words_per_row;
    const int64_t src = static_cast<int64_t>(src_slots[move]);
    const int64_t dst = static_cast<int64_t>(dst_slots[move]);
    if (src < 0 || dst < 0) {
      continue;
    }
    const int64_t src_offset =
        (src / page_size) * stride_page + (src % page_size) * stride_token + kv * stride_kv;
    const int64_t dst_offset =
        (dst / page_size) * stride_page + (dst % page_size) * stride_token + kv * stride_kv;
    const Word value = reinterpret_cast<const Word*>(pool + src_offset)[word];
    reinterpret_cast<Word*>(pool + dst_offset)[word] = value;
  }
}

int64_t word_bytes_for(const MoveKVParams& p) {
  const uint64_t address = reinterpret_cast<uintptr_t>(p.pool);
  for (int64_t bytes = 16; bytes > 1; bytes /= 2) {
    const bool fits = address % bytes == 0 && p.row_bytes % bytes == 0 &&
                      p.stride_page_bytes % bytes == 0 && p.stride_kv_bytes % bytes == 0 &&
                      p.stride_token_bytes % bytes == 0;
    if (fits) {
      return bytes;
    }
  }
  return 1;
}

template <typename Word, typename Index>
cudaError_t launch_typed(const MoveKVParams& p, cudaStream_t stream) {
  const int64_t words_per_row = p.row_bytes / static_cast<int64_t>(sizeof(Word));
  const int64_t total = p.num_moves * 2 * words_per_row;
  int64_t blocks = (total + kThreadsPerBlock - 1) / kThreadsPerBlock;
  blocks = blocks < kMaxBlocks ? blocks : kMaxBlocks;
  move_kv_kernel<Word, Index><<<static_cast<unsigned int>(blocks), kThreadsPerBlock, 0, stream>>>(
      static_cast<char*>(p.pool), static_cast<const Index*>(p.src_slots),
      static_cast<const Index*>(p.dst_slots), p.num_moves, p.page_size, p.stride_page_bytes,
      p.stride_kv_bytes, p.stride_token_bytes, words_per_row);
  return cudaGetLastError();
}

template <typename Index>
cudaError_t launch_for_index(const MoveKVParams& p, cudaStream_t stream) {
  switch (word_bytes_for(p)) {
    case 16:
      return launch_typed<uint4, Index>(p, stream);
    case 8:
      return launch_typed<uint2, Index>(p, stream);
    case 4:
      return launch_typed<uint32_t, Index>(p, stream);
    case 2:
      return launch_typed<uint16_t, Index>(p, stream);
    default:
      return launch_typed<uint8_t, Index>(p, stream);
  }
}

}  // namespace

int move_kv_launch(const MoveKVParams& params, void* stream) {
  if (params.num_moves == 0) {
    return static_cast<int>(cudaSuccess);
  }
  if (params.pool == nullptr || params.src_slots == nullptr || params.dst_slots == nullptr ||
      params.num_moves < 0 || params.page_size <= 0 || params.row_bytes <= 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  const cudaError_t status = params.slots_are_int64
                                 ? launch_for_index<int64_t>(params, cuda_stream)
                                 : launch_for_index<int32_t>(params, cuda_stream);
  return static_cast<int>(status);
}

const char* move_kv_error_string(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

}  // namespace kvcompress
