"""Helpers shared by the tests."""
import time


def wait_until(condition, timeout_s=30.0, interval_s=0.02):
    """Poll `condition` until true; fail the test if it is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")
