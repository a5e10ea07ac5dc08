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


def test_a_new_group_waits_for_one_still_forming_in_this_process(clean_environment):
    """A worker is given back when its run's client is gone while that run's task may still be forming its
    group: the next run's task waits for it instead of forming a second one ("trying to initialize the
    default process group twice")."""
    import socket
    import threading

    import torch
    import torch.distributed as dist

    forming_failed = threading.Event()
    old_port = collectives.find_free_port("127.0.0.1")

    def form_a_group_of_two_alone():  # rank 0 of 2: waits in its store for a rank 1 that never comes
        try:
            collectives.init_process_group("127.0.0.1", old_port, 0, 2, torch.device("cpu"), 2.0, own_host="127.0.0.1")
        except collectives.GroupFormationError:
            forming_failed.set()

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", old_port), timeout=0.5).close()
            return True
        except OSError:
            return False

    forming = threading.Thread(target=form_a_group_of_two_alone)
    forming.start()
    try:
        while not listening():  # the old task's store is up: it is forming its group
            assert forming.is_alive()
        port = collectives.find_free_port("127.0.0.1")
        with pytest.raises(workbench_errors.TrainingError, match="still belongs to another .* after 0.2 s"):
            collectives.init_process_group("127.0.0.1", port, 0, 1, torch.device("cpu"), 0.2, own_host="127.0.0.1")
        assert not dist.is_initialized()
        # Once the old task gave up forming its group, the new one forms its own.
        collectives.init_process_group("127.0.0.1", port, 0, 1, torch.device("cpu"), 10, own_host="127.0.0.1")
        assert forming_failed.is_set() and dist.is_initialized() and dist.get_world_size() == 1
    finally:
        forming.join(10)
        collectives.destroy_process_group()
