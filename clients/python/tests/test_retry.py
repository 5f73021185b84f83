"""The retry policy and the classification of errors (no Redis needed)."""

import time
import unittest

from redis import exceptions as rex
from redis.sentinel import MasterNotFoundError
from registry_janitor_client import Fenced, RetryPolicy, is_transient
from registry_janitor_client.retry import retry_sync


class Policy(unittest.TestCase):
    def test_defaults_wait_about_five_to_ten_seconds(self):
        for _ in range(20):
            pauses = list(RetryPolicy(timeout_ms=None).delays())
            self.assertEqual(len(pauses), 9)
            self.assertTrue(4.5 <= sum(pauses) <= 9.2, sum(pauses))
            self.assertTrue(all(p <= 2.0 for p in pauses))

    def test_capped_and_doubling(self):
        pauses = list(RetryPolicy(attempts=6, base_delay_ms=100, max_delay_ms=400, timeout_ms=None).delays())
        ceilings = [0.1, 0.2, 0.4, 0.4, 0.4]
        for pause, ceiling in zip(pauses, ceilings):
            self.assertTrue(ceiling / 2 <= pause <= ceiling, (pause, ceiling))

    def test_timeout_cuts_the_pauses(self):
        delays = RetryPolicy(attempts=100, base_delay_ms=100, max_delay_ms=100, timeout_ms=250).delays()
        total = 0.0
        for pause in delays:
            time.sleep(pause)
            total += pause
        self.assertLessEqual(total, 0.3)

    def test_invalid(self):
        with self.assertRaises(ValueError):
            RetryPolicy(attempts=0)

    def test_retry_sync_stops_on_what_does_not_pass(self):
        calls = []

        def fenced():
            calls.append(1)
            raise Fenced("gw#1", "FENCED server gw#1 was declared dead")

        with self.assertRaises(Fenced):
            retry_sync(fenced, RetryPolicy(attempts=5, base_delay_ms=1))
        self.assertEqual(len(calls), 1)

        def flaky():
            calls.append(2)
            if len(calls) < 4:
                raise rex.ConnectionError("refused")
            return "ok"

        self.assertEqual(retry_sync(flaky, RetryPolicy(attempts=5, base_delay_ms=1)), "ok")


class Transient(unittest.TestCase):
    def test_states_that_pass(self):
        for error in [
            rex.ConnectionError("x"), rex.TimeoutError("x"), rex.BusyLoadingError("x"), MasterNotFoundError("x"),
            rex.ReadOnlyError("x"), rex.OutOfMemoryError("x"), rex.TryAgainError("x"), rex.ClusterDownError("x"),
            rex.MasterDownError("x"), rex.ResponseError("BUSY Redis is busy running a script"),
            rex.ResponseError("NOREPLICAS Not enough good replicas to write."),
            rex.ResponseError("MASTERDOWN Link with MASTER is down"), rex.ResponseError("LOADING"),
            rex.ResponseError("OOM command not allowed"), rex.ResponseError("MISCONF errors writing to disk"),
        ]:
            self.assertTrue(is_transient(error), repr(error))

    def test_states_that_do_not(self):
        for error in [
            rex.ResponseError("FENCED server gw#1 was declared dead"), rex.NoScriptError("x"),
            rex.ResponseError("WRONGTYPE Operation against a key"), rex.NoPermissionError("x"),
            rex.AuthenticationError("x"), rex.ResponseError("ERR unknown command"), ValueError("x"),
            Fenced("gw#1", "FENCED"),
        ]:
            self.assertFalse(is_transient(error), repr(error))


if __name__ == "__main__":
    unittest.main()
