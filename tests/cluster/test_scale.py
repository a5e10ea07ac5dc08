"""The metrics plane with many workers (issue 17): the scale benchmark's load generator, run small, loses
no record on the way to the run's client, its run directory and a dashboard hub.

`benchmarks/scale.py` emulates N workers, each with its own connection to a real `dask scheduler`,
sending step-record batches as a worker's `MetricsSender` does; the receiving side is the workbench's
own `RunFeed` and the dashboard's `Hub` in a process of its own. Here 64 workers for 3 s (768 batches,
1,536 records), each batch its own message or every 8 workers' as one; the benchmark measures 64-1024.
"""
import pytest

from helpers import load_benchmark


@pytest.mark.timeout(240)
@pytest.mark.parametrize("group", [1, 8], ids=["each-its-own", "eight-a-message"])
def test_64_emulated_workers_lose_no_record_in_the_client_the_run_directory_or_the_hub(tmp_path, group):
    # group 8: every 8 workers' batches as one `batches` message, as a relay before the scheduler would send.
    scale = load_benchmark("scale")
    result = scale.measure(workers=64, seconds=3.0, steps_per_s=8.0, emulators=2, scratch=tmp_path, group=group)
    assert result["messages_per_s"] == 64 // group * 4, result
    # 64 workers x 4 batches a second x 2 records a batch x 3 s, give or take a tick at either end.
    assert 64 * 4 * 2 * 3 - 2 * 64 * 2 <= result["records_sent"] <= 64 * 4 * 2 * 3 + 64 * 2, result
    assert result["records_lost"] == 0, result  # the client's table
    assert result["records_lost_on_disk"] == 0, result  # the run directory's metrics file
    assert result["records_lost_hub"] == 0, result  # the dashboard's table
    assert 0 < result["median_delay_s"] < 1.0, result
