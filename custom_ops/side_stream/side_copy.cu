// The side-stream row copy (side_copy.h) as an XLA FFI pair for NVIDIA GPUs.
//
// DistcaSideCopyStart(x, routes) -> (y, token), attributes blocks (the copy's grid: its SM
// budget) and on_side (1: the side stream, 0: XLA's stream). With on_side=1 it records an event
// on XLA's stream, makes the device's side stream (created once per device, highest priority,
// non-blocking) wait on it, launches the copy there with `blocks` CTAs and records a completion
// event, then returns to XLA at once: XLA's stream goes on with the work scheduled after start
// while the copy runs. DistcaSideCopyDone(y, x, routes, token) -> y (y aliased) makes XLA's
// stream wait on that completion event. x and routes are done's operands so that XLA keeps their
// buffers (which the copy reads) allocated, and keeps them from other writers, until done.
//
// The events of one call live in a slot of a ring of kSlots per device (sc::Ring); start takes
// the next free slot, the copy kernel writes the slot's index into token, and done finds the
// slot by the address of the token buffer it receives (start's output; XLA hands it to done
// unchanged). At most kSlots calls per device may be in flight (started, not yet done) at once:
// start refuses a call when every slot is in flight, done refuses a token no start in flight has
// produced.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "side_copy.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace sc = distca_side_copy;

namespace {

constexpr int kThreads = 1024;        // threads per CTA: 32 warps, one row per warp at a time
constexpr int kUnroll = 4;            // 16-byte loads in flight per lane
constexpr int kMaxDevices = 64;

struct Slot {
  cudaEvent_t ready = nullptr;  // recorded on XLA's stream: x and y's prior uses are done
  cudaEvent_t done = nullptr;   // recorded after the copy
};

struct Device {
  sc::Ring ring;  // its mutex guards this whole struct
  bool init = false;
  cudaStream_t side = nullptr;
  Slot slots[sc::kSlots];
};

Device g_devices[kMaxDevices];

std::string Err(const char* what, cudaError_t e) {
  return std::string("side_copy: ") + what + ": " + cudaGetErrorString(e);
}

ffi::Error InitDevice(Device& d, int ordinal) {
  if (d.init) return ffi::Error::Success();
  int prev = 0;
  cudaGetDevice(&prev);
  cudaError_t e = cudaSetDevice(ordinal);
  int least = 0, greatest = 0;
  if (e == cudaSuccess) e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (e == cudaSuccess) e = cudaStreamCreateWithPriority(&d.side, cudaStreamNonBlocking, greatest);
  for (int i = 0; i < sc::kSlots && e == cudaSuccess; ++i) {
    e = cudaEventCreateWithFlags(&d.slots[i].ready, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&d.slots[i].done, cudaEventDisableTiming);
  }
  cudaSetDevice(prev);
  if (e != cudaSuccess) return ffi::Error::Internal(Err("creating the side stream", e));
  d.init = true;
  return ffi::Error::Success();
}

// One warp per output row at a time (grid-stride over rows); 16-byte vectors, kUnroll loads in
// flight per lane before their stores.
__global__ void __launch_bounds__(kThreads) CopyRows(
    const uint4* __restrict__ x, uint4* __restrict__ y, const int32_t* __restrict__ routes,
    int32_t groups, int64_t x_rows, int64_t y_rows, int64_t row_vecs, int32_t* token,
    int32_t slot) {
  extern __shared__ int32_t sh[];  // recv_off, recv_len, peer_send_off: S each
  for (int i = threadIdx.x; i < 3 * groups; i += blockDim.x) {
    const int which = i / groups, g = i % groups;
    const int row = which == 0 ? sc::kRecvOff : (which == 1 ? sc::kRecvLen : sc::kPeerSendOff);
    sh[i] = routes[row * groups + g];
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *token = slot;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       r < y_rows; r += warps) {
    const int64_t s = sc::SourceRow(sh, sh + groups, sh + 2 * groups, groups, r, x_rows);
    uint4* dst = y + r * row_vecs;
    if (s < 0) {
      for (int64_t i = lane; i < row_vecs; i += 32) dst[i] = make_uint4(0, 0, 0, 0);
      continue;
    }
    const uint4* src = x + s * row_vecs;
    int64_t i = lane;
    for (; i + 32 * (kUnroll - 1) < row_vecs; i += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(src + i + 32 * u);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) dst[i + 32 * u] = v[u];
    }
    for (; i < row_vecs; i += 32) dst[i] = __ldg(src + i);
  }
}

ffi::Error Start(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer routes,
                 ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> token,
                 int64_t blocks, int64_t on_side) {
  if (auto e = sc::CheckArgs(x, routes, *y, blocks); !e.success()) return e;
  if (ordinal < 0 || ordinal >= kMaxDevices)
    return ffi::Error::Internal("side_copy: device ordinal out of range");
  const int64_t x_rows = x.dimensions()[0], y_rows = y->dimensions()[0];
  const size_t row_bytes = sc::RowBytes(*y);
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(x.untyped_data()) |
                              reinterpret_cast<uintptr_t>(y->untyped_data());
  if (row_bytes % 16 != 0 || addresses % 16 != 0)
    return ffi::Error::InvalidArgument(
        "side_copy: rows must be a multiple of 16 bytes, 16-byte aligned");
  Device& d = g_devices[ordinal];
  std::lock_guard<std::mutex> lock(d.ring.mu);
  if (auto e = InitDevice(d, ordinal); !e.success()) return e;
  const int slot = d.ring.Acquire(token->untyped_data());
  if (slot < 0) return sc::AllInFlight();
  Slot& s = d.slots[slot];
  cudaStream_t run = on_side ? d.side : stream;
  cudaError_t e = cudaSuccess;
  if (on_side) {
    e = cudaEventRecord(s.ready, stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(d.side, s.ready, 0);
  }
  const int groups = static_cast<int>(routes.dimensions()[1]);
  if (e == cudaSuccess) {
    CopyRows<<<static_cast<unsigned>(blocks), kThreads, 3 * groups * sizeof(int32_t), run>>>(
        static_cast<const uint4*>(x.untyped_data()), static_cast<uint4*>(y->untyped_data()),
        static_cast<const int32_t*>(routes.untyped_data()), groups, x_rows, y_rows,
        static_cast<int64_t>(row_bytes / 16), token->typed_data(), slot);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaEventRecord(s.done, run);
  if (e != cudaSuccess) {
    d.ring.Release(token->untyped_data());
    return ffi::Error::Internal(Err("starting the copy", e));
  }
  return ffi::Error::Success();
}

ffi::Error Done(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::AnyBuffer x,
                ffi::AnyBuffer routes, ffi::Buffer<ffi::S32> token,
                ffi::Result<ffi::AnyBuffer> out) {
  if (out->untyped_data() != y.untyped_data())
    return ffi::Error::Internal("side_copy done: y is not aliased to the output");
  if (ordinal < 0 || ordinal >= kMaxDevices)
    return ffi::Error::Internal("side_copy: device ordinal out of range");
  Device& d = g_devices[ordinal];
  std::lock_guard<std::mutex> lock(d.ring.mu);
  const int slot = d.ring.Release(token.untyped_data());
  if (slot < 0) return sc::UnknownToken();
  cudaError_t e = cudaStreamWaitEvent(stream, d.slots[slot].done, 0);
  if (e != cudaSuccess) return ffi::Error::Internal(Err("waiting for the copy", e));
  return ffi::Error::Success();
}

// Start writing into a buffer the caller passes (aliased to y), e.g. one filled with a poison
// value to check that every row is written.
ffi::Error StartInto(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer routes,
                     ffi::AnyBuffer into, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t blocks, int64_t on_side) {
  if (into.untyped_data() != y->untyped_data())
    return ffi::Error::Internal("side_copy start: the buffer passed in is not aliased to y");
  return Start(stream, ordinal, x, routes, y, token, blocks, on_side);
}

}  // namespace

// The CUDA handlers read XLA's stream and the device's ordinal before their arguments.
#define SIDE_COPY_CUDA_CTX \
  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(DistcaSideCopyStart, Start, sc::BindStart(SIDE_COPY_CUDA_CTX));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DistcaSideCopyStartInto, StartInto,
                              sc::BindStartInto(SIDE_COPY_CUDA_CTX));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DistcaSideCopyDone, Done, sc::BindDone(SIDE_COPY_CUDA_CTX));
