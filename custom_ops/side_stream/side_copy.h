// The side-stream row copy's contract, shared by the CUDA kernel (side_copy.cu) and the CPU
// handler (side_copy_cpu.cc).
//
// x [x_rows, row] moves into y [y_rows, row] by the exchange's routes (int32 [6, S], the rows of
// distca_jax.plan.ROUTE_ROWS) read on one device, the receiver's view of every group g:
// y[recv_off[g] + i] = x[peer_send_off[g] + i] for 0 <= i < recv_len[g]. A row of y that no
// group covers is zero; a row whose first covering group points outside x is zero too (groups
// are disjoint in a valid plan: the first covering group decides).
#ifndef DISTCA_SIDE_COPY_H_
#define DISTCA_SIDE_COPY_H_

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define SIDE_COPY_HD __host__ __device__
#else
#define SIDE_COPY_HD
#endif

namespace distca_side_copy {

constexpr int kRecvOff = 2;      // ROUTE_ROWS index of recv_off
constexpr int kRecvLen = 3;      // ... recv_len
constexpr int kPeerSendOff = 5;  // ... peer_send_off
constexpr int kMaxGroups = 4096;  // S at most (the CUDA kernel keeps 3 S int32 in shared memory)

// Source row of output row r (-1: the row is zero). off, len, src: the groups' recv_off,
// recv_len, peer_send_off (S entries each).
SIDE_COPY_HD inline int64_t SourceRow(const int32_t* off, const int32_t* len, const int32_t* src,
                                      int64_t groups, int64_t r, int64_t x_rows) {
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t o = off[g];
    if (r >= o && r < o + static_cast<int64_t>(len[g])) {
      const int64_t s = static_cast<int64_t>(src[g]) + (r - o);
      return (s >= 0 && s < x_rows) ? s : -1;
    }
  }
  return -1;
}

namespace ffi = xla::ffi;

// One-line errors for inputs the copy cannot take (the Python side checks them first).
inline ffi::Error CheckArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& routes,
                            const ffi::AnyBuffer& y, int64_t blocks) {
  auto rd = routes.dimensions();
  if (routes.element_type() != ffi::DataType::S32 || rd.size() != 2 || rd[0] != 6 || rd[1] < 1 ||
      rd[1] > kMaxGroups)
    return ffi::Error::InvalidArgument("side_copy: routes must be int32 [6, S], 1 <= S <= 4096");
  if (x.dimensions().size() < 1 || y.dimensions().size() != x.dimensions().size() ||
      x.element_type() != y.element_type())
    return ffi::Error::InvalidArgument("side_copy: x and y must have one dtype and rank");
  if (blocks < 1 || blocks > 65535)
    return ffi::Error::InvalidArgument("side_copy: blocks must be in [1, 65535]");
  return ffi::Error::Success();
}

// The calls in flight on one device (started, not yet done), at most kSlots: start takes a free
// slot for its token's buffer address, done gives it back by the same address. The CUDA handler
// keeps a slot's events at its index; the CPU handler keeps the same books (its copy is done at
// start) so that the CPU tests check them.
constexpr int kSlots = 64;

class Ring {
 public:
  // A free slot, in ring order, for the start whose token lives at `token`; -1 when all
  // kSlots are in flight. XLA never gives one address to two live tokens: an entry already
  // there is a start whose done never ran (its program failed), and its slot is freed.
  int Acquire(const void* token) {
    int slot = next_;
    for (int k = 0; k < kSlots && in_flight_[slot]; ++k) slot = (slot + 1) % kSlots;
    if (in_flight_[slot]) return -1;
    auto [it, fresh] = by_token_.try_emplace(token, slot);
    if (!fresh) {
      in_flight_[it->second] = false;
      it->second = slot;
    }
    in_flight_[slot] = true;
    next_ = (slot + 1) % kSlots;
    return slot;
  }

  // The slot of the start whose token lives at `token`, freed; -1 when no start in flight has
  // that token.
  int Release(const void* token) {
    auto it = by_token_.find(token);
    if (it == by_token_.end()) return -1;
    const int slot = it->second;
    by_token_.erase(it);
    in_flight_[slot] = false;
    return slot;
  }

  std::mutex mu;  // held by the handler around Acquire / Release and its use of the slot

 private:
  bool in_flight_[kSlots] = {};
  int next_ = 0;
  std::unordered_map<const void*, int> by_token_;
};

inline ffi::Error AllInFlight() {
  return ffi::Error::Internal("side_copy: 64 calls already in flight on this device (call done "
                              "for a start before starting more)");
}

inline ffi::Error UnknownToken() {
  return ffi::Error::Internal("side_copy done: its token comes from no start in flight on this "
                              "device (pass start's token to done unchanged)");
}

// Bytes per row of y (x's rows have the same width).
inline size_t RowBytes(const ffi::AnyBuffer& y) {
  const int64_t rows = y.dimensions()[0];
  return rows ? y.size_bytes() / rows : 0;
}

// The handlers' signatures after the platform's context (b: ffi::Ffi::Bind() with it). A
// binding is built in one expression (its methods take it by rvalue and it cannot be moved from
// a variable): every step passes a temporary on.
// start's outputs and attributes: -> y, token; blocks, on_side.
template <typename B>
auto StartOutputs(B b) {
  return std::move(b)
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Attr<int64_t>("blocks")
      .template Attr<int64_t>("on_side");
}

// start: x, routes -> y, token.
template <typename B>
auto BindStart(B b) {
  return StartOutputs(std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>());
}

// start_into: x, routes, into -> y (aliased to into), token.
template <typename B>
auto BindStartInto(B b) {
  return StartOutputs(std::move(b)
                          .template Arg<ffi::AnyBuffer>()
                          .template Arg<ffi::AnyBuffer>()
                          .template Arg<ffi::AnyBuffer>());
}

// done: y, x, routes, token -> y (aliased).
template <typename B>
auto BindDone(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>();
}

}  // namespace distca_side_copy

#endif  // DISTCA_SIDE_COPY_H_
