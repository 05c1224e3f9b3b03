// CPU handlers of the side-stream row copy (side_copy.h): the same contract as the CUDA pair,
// run synchronously, so the code path (the FFI calls, their aliasing and order) runs on CPU.
// start writes y and token 0 (start_into: into the buffer passed in, aliased to y); done returns
// y (aliased). Both keep the CUDA pair's books of calls in flight (sc::Ring, one for the host
// device), with the same refusals.
#include <cstring>
#include <string>

#include "side_copy.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace sc = distca_side_copy;

static sc::Ring g_ring;

static ffi::Error StartCpu(ffi::AnyBuffer x, ffi::AnyBuffer routes,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> token,
                           int64_t blocks, int64_t on_side) {
  if (auto e = sc::CheckArgs(x, routes, *y, blocks); !e.success()) return e;
  const int64_t x_rows = x.dimensions()[0], y_rows = y->dimensions()[0];
  const size_t row_bytes = sc::RowBytes(*y);
  const int64_t groups = routes.dimensions()[1];
  const int32_t* r = static_cast<const int32_t*>(routes.untyped_data());
  const char* xs = static_cast<const char*>(x.untyped_data());
  char* ys = static_cast<char*>(y->untyped_data());
  for (int64_t row = 0; row < y_rows; ++row) {
    int64_t s = sc::SourceRow(r + sc::kRecvOff * groups, r + sc::kRecvLen * groups,
                              r + sc::kPeerSendOff * groups, groups, row, x_rows);
    if (s < 0) std::memset(ys + row * row_bytes, 0, row_bytes);
    else std::memcpy(ys + row * row_bytes, xs + s * row_bytes, row_bytes);
  }
  std::lock_guard<std::mutex> lock(g_ring.mu);
  const int slot = g_ring.Acquire(token->untyped_data());
  if (slot < 0) return sc::AllInFlight();
  token->typed_data()[0] = slot;
  return ffi::Error::Success();
}

static ffi::Error StartIntoCpu(ffi::AnyBuffer x, ffi::AnyBuffer routes, ffi::AnyBuffer into,
                               ffi::Result<ffi::AnyBuffer> y,
                               ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t blocks,
                               int64_t on_side) {
  if (into.untyped_data() != y->untyped_data())
    return ffi::Error::Internal("side_copy start: the buffer passed in is not aliased to y");
  return StartCpu(x, routes, y, token, blocks, on_side);
}

static ffi::Error DoneCpu(ffi::AnyBuffer y, ffi::AnyBuffer x, ffi::AnyBuffer routes,
                          ffi::Buffer<ffi::S32> token, ffi::Result<ffi::AnyBuffer> out) {
  if (out->untyped_data() != y.untyped_data())
    return ffi::Error::Internal("side_copy done: y is not aliased to the output");
  std::lock_guard<std::mutex> lock(g_ring.mu);
  if (g_ring.Release(token.untyped_data()) < 0) return sc::UnknownToken();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DistcaSideCopyStartCpu, StartCpu,
                              sc::BindStart(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DistcaSideCopyStartIntoCpu, StartIntoCpu,
                              sc::BindStartInto(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DistcaSideCopyDoneCpu, DoneCpu, sc::BindDone(ffi::Ffi::Bind()));
