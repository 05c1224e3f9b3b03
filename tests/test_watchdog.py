"""launch.Watchdog polls the coordination service only once armed, and the trainer arms it
after the first step has completed."""

import threading
import time
import types

import pytest

from distca_jax import launch, trainer
from test_train import tiny_config


class FakeClient:
  def __init__(self):
    self.calls = 0
    self.lock = threading.Lock()

  def get_live_nodes(self, everyone):
    with self.lock:
      self.calls += 1
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


def test_an_unarmed_watchdog_does_not_poll_until_armed(client, tmp_path):
  dog = launch.Watchdog(str(tmp_path), heartbeat_timeout_s=30, poll_s=0.01)
  time.sleep(0.3)
  assert client.calls == 0, f"{client.calls} polls before arm()"
  dog.arm()
  assert wait_for(lambda: client.calls >= 3), f"{client.calls} polls after arm()"
  dog.close()
  assert not dog.fired.is_set()


def test_an_armed_watchdog_polls_at_once_and_close_stops_it(client, tmp_path):
  dog = launch.Watchdog(str(tmp_path), heartbeat_timeout_s=30, poll_s=0.01, armed=True)
  assert wait_for(lambda: client.calls >= 1)
  dog.close()
  calls = client.calls
  time.sleep(0.1)
  assert client.calls == calls


def test_closing_an_unarmed_watchdog_ends_its_thread(client, tmp_path):
  dog = launch.Watchdog(str(tmp_path), heartbeat_timeout_s=30, poll_s=0.01)
  dog.close()
  assert not dog._thread.is_alive()  # pylint: disable=protected-access
  assert client.calls == 0


def test_the_trainer_calls_on_first_step_once_after_the_first_step(tmp_path):
  calls = []
  c = tiny_config(num_steps=3, log_every=1, checkpoint_every=0, tensorboard=False,
                  **{"optim.warmup_steps": 1})
  records = trainer.train_and_evaluate(
      c, str(tmp_path), on_first_step=lambda: calls.append(time.time()))
  assert len(calls) == 1, calls
  assert [r["step"] for r in records][-1] == 3
