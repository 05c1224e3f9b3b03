"""launch.Watchdog: before it is armed it polls the coordination service only after a stall
(no `progress` for ``quiet_s``); `progress` waits for a poll in flight; armed, it polls always.
The trainer calls `progress` before each first execution and arms it after the first step."""

import threading
import time
import types

import pytest

from distca_jax import launch, trainer
from test_train import tiny_config


class FakeClient:
  def __init__(self, poll_s=0.0):
    self.calls, self.in_flight, self.poll_s = 0, False, poll_s
    self.lock = threading.Lock()

  def get_live_nodes(self, everyone):
    self.in_flight = True
    time.sleep(self.poll_s)
    with self.lock:
      self.calls += 1
    self.in_flight = False
    return list(everyone)


@pytest.fixture
def client(monkeypatch):
  fake = FakeClient()
  monkeypatch.setattr(launch, "_client", lambda: types.SimpleNamespace(
      client=fake, coordinator_address="127.0.0.1:0"))
  return fake


def wait_for(predicate, timeout_s=10.0):
  deadline = time.time() + timeout_s
  while time.time() < deadline and not predicate():
    time.sleep(0.01)
  return predicate()


def test_unarmed_it_polls_only_after_quiet_s_without_progress(client, tmp_path):
  dog = launch.Watchdog(str(tmp_path), heartbeat_timeout_s=30, poll_s=0.01, quiet_s=0.5)
  t_end = time.monotonic() + 1.0
  while time.monotonic() < t_end:  # progress every 0.1 s: never a stall
    dog.progress()
    time.sleep(0.1)
  assert client.calls == 0, f"{client.calls} polls while the process made progress"
  assert wait_for(lambda: client.calls >= 3), f"{client.calls} polls after a stall"
  dog.progress()
  calls = client.calls
  time.sleep(0.25)
  assert client.calls == calls, "a poll within quiet_s of progress()"
  dog.close()
  assert not dog.fired.is_set()


def test_armed_it_polls_at_once_even_after_progress(client, tmp_path):
  dog = launch.Watchdog(str(tmp_path), heartbeat_timeout_s=30, poll_s=0.01, quiet_s=60)
  time.sleep(0.2)
  assert client.calls == 0
  dog.arm()
  dog.progress()
  assert wait_for(lambda: client.calls >= 3), f"{client.calls} polls once armed"
  dog.close()
  calls = client.calls
  time.sleep(0.1)
  assert client.calls == calls


def test_progress_returns_after_the_poll_in_flight(client, tmp_path):
  client.poll_s = 0.3  # a slow RPC
  dog = launch.Watchdog(str(tmp_path), heartbeat_timeout_s=30, poll_s=0.01, quiet_s=0.2)
  assert wait_for(lambda: client.in_flight)  # a stall poll
  t0 = time.monotonic()
  dog.progress()
  assert not client.in_flight and client.calls >= 1, "progress() returned beside a poll"
  assert time.monotonic() - t0 > 0.05
  time.sleep(0.1)
  assert not client.in_flight, "a poll started within quiet_s of progress()"
  dog.close()


def test_the_trainer_marks_each_first_run_then_arms_after_the_first_step(tmp_path):
  calls = []
  c = tiny_config(num_steps=3, log_every=1, checkpoint_every=0, tensorboard=False,
                  **{"optim.warmup_steps": 1})
  records = trainer.train_and_evaluate(
      c, str(tmp_path), before_first_run=lambda: calls.append("before"),
      on_first_step=lambda: calls.append("first step"))
  assert calls == ["before", "before", "first step"], calls
  assert [r["step"] for r in records][-1] == 3
