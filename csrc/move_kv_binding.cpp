// Torch binding of the CUDA cache move: registers torch.ops.kvcompress.move_kv (CUDA).
//
// Host code only, no CUDA and no Python headers: the current stream comes through c10's
// device-generic guard interface, the launch through the plain interface of move_kv.h.
// Loading the library (import kvcompress._C, or the JIT build of kernels/cuda_ext.py)
// registers the op; nothing else is exported.
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>

#include "move_kv.h"

namespace {

void check_slots(const at::Tensor& slots, const char* name, const at::Tensor& pool) {
  TORCH_CHECK(slots.dim() == 1, "kvcompress.move_kv: ", name, " must be 1-D, got ",
              slots.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt,
              "kvcompress.move_kv: ", name, " must be int64 or int32, got ",
              slots.scalar_type());
  TORCH_CHECK(slots.device() == pool.device(), "kvcompress.move_kv: ", name, " is on ",
              slots.device(), ", the pool on ", pool.device());
}

// Copy K and V of src_slots[i] to dst_slots[i] (negative entries skip) in one launch.
void move_kv(at::Tensor& pool, const at::Tensor& src_slots, const at::Tensor& dst_slots) {
  TORCH_CHECK(pool.is_cuda(), "kvcompress.move_kv: the pool must be a CUDA tensor");
  TORCH_CHECK(pool.dim() == 4 && pool.size(1) == 2,
              "kvcompress.move_kv: pool must be [num_pages, 2, page_size, head_size], got ",
              pool.sizes());
  TORCH_CHECK(pool.stride(3) == 1,
              "kvcompress.move_kv: the pool must be contiguous in its last dimension");
  check_slots(src_slots, "src_slots", pool);
  check_slots(dst_slots, "dst_slots", pool);
  TORCH_CHECK(src_slots.sizes() == dst_slots.sizes() &&
                  src_slots.scalar_type() == dst_slots.scalar_type(),
              "kvcompress.move_kv: src_slots and dst_slots must match in length and dtype");
  if (src_slots.numel() == 0 || pool.numel() == 0) {
    return;
  }
  const at::Tensor src = src_slots.contiguous();
  const at::Tensor dst = dst_slots.contiguous();
  const int64_t element_bytes = static_cast<int64_t>(pool.element_size());

  const c10::DeviceGuard device_guard(pool.device());
  const c10::impl::VirtualGuardImpl guard_impl(pool.device().type());
  void* stream = guard_impl.getStream(pool.device()).native_handle();

  kvcompress::MoveKVParams params{};
  params.pool = pool.data_ptr();
  params.src_slots = src.data_ptr();
  params.dst_slots = dst.data_ptr();
  params.slots_are_int64 = src.scalar_type() == at::kLong;
  params.num_moves = src.numel();
  params.page_size = pool.size(2);
  params.stride_page_bytes = pool.stride(0) * element_bytes;
  params.stride_kv_bytes = pool.stride(1) * element_bytes;
  params.stride_token_bytes = pool.stride(2) * element_bytes;
  params.row_bytes = pool.size(3) * element_bytes;
  const int status = kvcompress::move_kv_launch(params, stream);
  TORCH_CHECK(status == 0, "kvcompress.move_kv: kernel launch failed: ",
              kvcompress::move_kv_error_string(status));
}

}  // namespace

// A fragment: other native ops of the namespace may live in other translation units.
TORCH_LIBRARY_FRAGMENT(kvcompress, m) {
  m.def("move_kv(Tensor(a!) pool, Tensor src_slots, Tensor dst_slots) -> ()");
}

TORCH_LIBRARY_IMPL(kvcompress, CUDA, m) { m.impl("move_kv", &move_kv); }
