"""Integer helpers of the balancer (host, plain Python): half-open interval sets (``merge``,
``subtract``) and bisection of a non-decreasing work function (``first_reaching``,
``last_within``: a move's amount under a sliding window, ``balancer.Balancer._exact``)."""

from __future__ import annotations


def merge(ivs: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """Sorted union of half-open intervals, touching ones merged."""
  if len(ivs) <= 1:
    return list(ivs)
  ivs = sorted(ivs)
  out = [ivs[0]]
  for lo, hi in ivs[1:]:
    plo, phi = out[-1]
    if lo <= phi:
      out[-1] = (plo, max(phi, hi))
    else:
      out.append((lo, hi))
  return out


def subtract(ivs: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """``ivs`` minus ``cut`` (``cut`` lies inside ``ivs``)."""
  out = []
  for lo, hi in ivs:
    pieces = [(lo, hi)]
    for clo, chi in cut:
      nxt = []
      for plo, phi in pieces:
        if chi <= plo or clo >= phi:
          nxt.append((plo, phi))
          continue
        if plo < clo:
          nxt.append((plo, clo))
        if chi < phi:
          nxt.append((chi, phi))
      pieces = nxt
    out.extend(pieces)
  return out


def first_reaching(work, target: float, top: int) -> int:
  """Smallest n in [0, top] with work(n) >= target (``work`` non-decreasing), else top."""
  lo, hi = 0, max(int(top), 0)
  while lo < hi:
    mid = (lo + hi) // 2
    if work(mid) >= target:
      hi = mid
    else:
      lo = mid + 1
  return lo


def last_within(work, room: float, top: int) -> int:
  """Largest n in [0, top] with work(n) <= room (``work`` non-decreasing, work(0) = 0)."""
  lo, hi = 0, max(int(top), 0)
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if work(mid) <= room:
      lo = mid
    else:
      hi = mid - 1
  return lo
