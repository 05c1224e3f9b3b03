"""launch.Watchdog on a real coordination service (in this process, one client per pretend
process): its heartbeats are key-value calls that return at once whatever the other processes
do; a peer whose heartbeats stop, or never start, is named lost after the heartbeat timeout; a
peer that finished cleanly is not; and the service's own liveness query is a barrier (the reason
the watchdog does not poll it)."""

import socket
import threading
import time

import pytest

from distca_jax import launch
from jax._src.lib import _jax


@pytest.fixture
def clients():
  """A coordination service for 2 processes and a connected client for each."""
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  address = f"127.0.0.1:{s.getsockname()[1]}"
  s.close()
  service = _jax.get_distributed_runtime_service(address, 2, heartbeat_timeout=30,
                                                 shutdown_timeout=5, recoverable=True)
  cs = [_jax.get_distributed_runtime_client(address, i, init_timeout=30, heartbeat_timeout=30,
                                            use_compression=True) for i in range(2)]
  joins = [threading.Thread(target=c.connect) for c in cs]
  for t in joins:
    t.start()
  for t in joins:
    t.join()
  yield cs
  for c in cs:
    c.shutdown()
  service.shutdown()


class Dog(launch.Watchdog):
  """Records what it would print and exit with instead of ending the test process."""

  def _exit(self, lost, why):
    self.lost, self.why = lost, why
    self.fired.set()


def dog(tmp_path, clients, me, timeout_s=30.0, poll_s=0.01):
  return Dog(str(tmp_path), heartbeat_timeout_s=timeout_s, poll_s=poll_s, client=clients[me],
             me=me, count=len(clients))


def beats(client, me) -> int:
  """Process ``me``'s heartbeat counter (0 before its first beat)."""
  return int(dict(client.key_value_dir_get(launch.Watchdog.KEY)).get(
      f"{launch.Watchdog.KEY}{me}", 0))


def test_its_calls_return_while_the_other_process_makes_none(clients, tmp_path):
  d = dog(tmp_path, clients, 0)
  deadline = time.time() + 10
  while time.time() < deadline and beats(clients[1], 0) < 20:
    time.sleep(0.01)
  assert beats(clients[1], 0) >= 20, "the watchdog's heartbeats waited on process 1"
  t0 = time.monotonic()
  d.close()
  assert time.monotonic() - t0 < 2 and not d.fired.is_set()


def test_get_live_nodes_is_a_barrier_of_the_live_processes(clients):
  """Why the watchdog does not poll it: one process's call returns only once the other calls."""
  got = []
  t = threading.Thread(target=lambda: got.append(clients[0].get_live_nodes([0, 1])), daemon=True)
  t.start()
  t.join(1.0)
  assert t.is_alive() and not got
  clients[1].get_live_nodes([0, 1])
  t.join(10)
  assert got and sorted(got[0]) == [0, 1]


def test_a_peer_whose_heartbeats_stop_is_named_lost_after_the_timeout(clients, tmp_path):
  d0, d1 = dog(tmp_path, clients, 0, timeout_s=1.0), dog(tmp_path, clients, 1, timeout_s=1.0)
  time.sleep(1.5)  # both beat: neither is lost
  assert not d0.fired.is_set() and not d1.fired.is_set()
  d1.close()  # stops beating without finishing (an error, or the process is gone)
  t0 = time.monotonic()
  assert d0.fired.wait(10), "process 1's silence went unnoticed"
  assert 0.8 <= time.monotonic() - t0 <= 3.0, time.monotonic() - t0
  assert d0.lost == [1] and d0.why == "no heartbeat for 1 s"
  line = launch.lost_line(0, 2, d0.lost, d0.why, str(tmp_path))
  assert line.startswith("process 0/2: lost process 1 (no heartbeat for 1 s); rerun"), line
  d0.close()


def test_a_peer_that_never_beats_is_lost_after_the_timeout(clients, tmp_path):
  d0 = dog(tmp_path, clients, 0, timeout_s=1.0)
  assert d0.fired.wait(10) and d0.lost == [1]
  d0.close()


def test_a_peer_lost_while_this_process_waits_at_the_exit_barrier_is_named(clients, tmp_path):
  """The barrier's wait leaves the watchdog's thread running (it releases the GIL), so a peer
  that dies before it reaches the job's exit barrier is named there, not after the barrier's
  timeout."""
  d0, d1 = dog(tmp_path, clients, 0, timeout_s=0.5), dog(tmp_path, clients, 1, timeout_s=0.5)
  time.sleep(0.2)
  d1.close()  # process 1 dies before the barrier
  t0 = time.monotonic()
  with pytest.raises(Exception, match="DEADLINE_EXCEEDED"):
    clients[0].wait_at_barrier("distca_exit_test", 2000)
  assert d0.fired.is_set() and d0.lost == [1], "no peer named during the barrier"
  assert time.monotonic() - t0 >= 1.5
  d0.close()


def test_a_coordinator_that_stops_answering_is_named(tmp_path):
  class Gone:
    def key_value_set(self, *a, **k):
      raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")

  d = Dog(str(tmp_path), heartbeat_timeout_s=30, poll_s=0.01, client=Gone(), me=1, count=2)
  assert d.fired.wait(10) and d.lost == [0]
  assert d.why.startswith("the coordinator does not answer: UNAVAILABLE"), d.why
