"""A process group of one rank in this process, bound as `collectives.init_process_group` binds it: a new
group waits for the one still leaving and fails if it never leaves (a real gloo group and its TCP store, no
process started; which interface the binding picks, without a group: tests/unit/test_interface_binding.py)."""
import pytest

from workbench.comm import collectives
from workbench import errors as workbench_errors


def test_a_new_group_waits_for_the_one_still_leaving_this_process_and_fails_if_it_never_leaves(clean_environment):
    import threading

    import torch
    import torch.distributed as dist

    def join(timeout_s):
        port = collectives.find_free_port("127.0.0.1")
        collectives.init_process_group("127.0.0.1", port, 0, 1, torch.device("cpu"), timeout_s, own_host="127.0.0.1")

    join(10)  # the previous run's group, still here
    try:
        with pytest.raises(workbench_errors.TrainingError, match="still belongs to another .* after 0.2 s"):
            join(0.2)
        joined = threading.Event()
        waiting = threading.Thread(target=lambda: (join(10), joined.set()))
        waiting.start()
        assert not joined.wait(0.3)  # waits while the old group is there
        collectives.destroy_process_group()  # the old run's task leaves
        waiting.join(10)
        assert joined.is_set() and dist.is_initialized()
    finally:
        collectives.destroy_process_group()
