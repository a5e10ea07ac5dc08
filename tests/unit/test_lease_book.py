"""The lease book alone (no cluster): who gets which workers, the queue's order, and every way a lease ends."""
import random

from workbench.cluster.leases import LeaseBook, describe_holders

W = ["tcp://w:1", "tcp://w:2", "tcp://w:3"]


def test_a_run_gets_free_workers_and_the_next_one_gets_the_others():
    book = LeaseBook()
    assert book.acquire("a", "alice", "c1", 2, False, W, 0.0) == {"state": "leased", "workers": W[:2]}
    assert book.acquire("b", "bob", "c2", 1, False, W, 1.0) == {"state": "leased", "workers": W[2:]}
    assert book.holder(W[0]) == book.holder(W[1]) == "a" and book.holder(W[2]) == "b"
    assert book.free(W) == []
    # Asking again for a run that holds workers answers the same (a retry never takes more).
    assert book.acquire("a", "alice", "c1", 2, False, W, 2.0)["workers"] == W[:2]


def test_too_few_free_workers_is_refused_with_who_holds_what_or_impossible_beyond_the_cluster():
    book = LeaseBook()
    book.acquire("a", "alice", "c1", 2, False, W, 0.0)
    refused = book.acquire("b", "bob", "c2", 2, False, W, 1.0)
    assert refused["state"] == "refused" and refused["free"] == [W[2]]
    assert refused["runs"] == {"a": {"owner": "alice", "workers": W[:2], "since": 0.0}}
    assert describe_holders(refused) == f"run a (alice) holds {W[0]}, {W[1]}"
    assert "b" not in book.leases and book.queue == []
    assert book.acquire("c", "carol", "c3", 4, True, W, 1.0)["state"] == "impossible"
    assert book.queue == []


def test_the_queue_is_first_come_first_served_and_nobody_overtakes():
    book = LeaseBook()
    book.acquire("a", "alice", "c1", 2, False, W, 0.0)
    assert book.acquire("b", "bob", "c2", 3, True, W, 1.0) == {"state": "queued", "position": 1,
                                                              **book.view(W)}
    # One worker is free, but "b" waits ahead: a newcomer wanting one is queued behind it, or refused.
    assert book.acquire("c", "carol", "c3", 1, False, W, 2.0)["state"] == "refused"
    assert book.acquire("c", "carol", "c3", 1, True, W, 2.0)["position"] == 2
    # And a running run may not grow past the waiting ones.
    assert book.extend("a", [W[2]], W) == []
    book.release("a", None, W, 3.0)
    assert book.poll("b", W, 3.0) == {"state": "leased", "workers": W}
    assert book.poll("c", W, 3.0)["position"] == 1
    book.release("b", None, W, 4.0)
    assert book.poll("c", W, 4.0) == {"state": "leased", "workers": W[:1]}
    assert book.poll("nobody", W, 4.0) == {"state": "gone"}


def test_a_lease_ends_with_its_client_and_a_worker_with_the_cluster():
    book = LeaseBook()
    book.acquire("a", "alice", "c1", 2, False, W, 0.0)
    book.acquire("b", "bob", "c2", 2, True, W, 1.0)
    book.acquire("c", "carol", "c1", 1, True, W, 2.0)  # alice's second run, queued behind bob's
    assert sorted(book.drop_client("c1", W, 3.0)) == ["a", "c"]
    assert book.poll("b", W, 3.0)["state"] == "leased" and book.queue == []
    book.worker_removed(W[0])
    assert book.holder(W[0]) is None and book.leases["b"].workers == [W[1]]


def test_giving_back_some_workers_and_growing_into_free_ones():
    book = LeaseBook()
    book.acquire("a", "alice", "c1", 3, False, W, 0.0)
    book.release("a", [W[2]], W, 1.0)  # lost, say
    assert book.leases["a"].workers == W[:2] and book.free(W) == [W[2]]
    assert book.extend("a", [W[2], "tcp://elsewhere:9"], W) == [W[2]]
    assert book.free(W) == []


def test_random_interleavings_never_lease_a_worker_twice_and_the_queue_drains():
    rng = random.Random(7)
    for _ in range(200):
        book, present, clients = LeaseBook(), list(W), {}
        for step in range(30):
            action = rng.choice(["acquire", "acquire", "release", "drop", "remove", "add"])
            run = f"r{rng.randrange(8)}"
            if action == "acquire":
                clients.setdefault(run, f"c{rng.randrange(3)}")
                book.acquire(run, "u", clients[run], rng.randint(1, 3), rng.random() < 0.7, present, step)
            elif action == "release":
                book.release(run, None, present, step)
            elif action == "drop":
                book.drop_client(f"c{rng.randrange(3)}", present, step)
            elif action == "remove" and present:
                gone = present.pop(rng.randrange(len(present)))
                book.worker_removed(gone)
            elif action == "add":
                present.append(f"tcp://w:{10 + step}")
                book.promote(present, step)
            held = [w for lease in book.leases.values() for w in lease.workers]
            assert len(held) == len(set(held)) and set(held) <= set(present)
            assert not set(book.leases) & {w.run_id for w in book.queue}
        while book.leases:  # each release may grant the next waiting run its workers
            book.release(next(iter(book.leases)), None, present, 99)
        # Once everyone running is done, the queue's head has its workers (or wants more than exist).
        assert not book.queue or book.queue[0].wanted > len(present)


def test_the_dashboards_workers_view_lists_holders_free_workers_and_the_queue():
    from widgets.dashboard.views.workers import WorkersView, queue_rows, worker_rows

    book = LeaseBook()
    book.acquire("a", "alice", "c1", 2, False, W, 0.0)
    book.acquire("b", "bob", "c2", 2, True, W, 1.0)
    view = book.view(W)
    assert worker_rows(view).values.tolist() == [[W[0], "a", "alice"], [W[1], "a", "alice"], [W[2], "free", ""]]
    assert queue_rows(view)[["place", "run", "owner", "workers wanted"]].values.tolist() == [[1, "b", "bob", 2]]
    drawn = WorkersView()
    drawn.show(view)
    assert drawn.summary.object.startswith("**1 of 3 workers free**, 1 run(s) holding workers, 1 waiting")
    assert drawn.workers_table.object.equals(worker_rows(view))


def test_the_hub_lists_a_queued_run_and_ends_it_once_its_place_is_gone():
    from widgets.dashboard.hub import Hub

    hub = Hub(None)
    hub._on_registry({"kind": "run-queued", "run_id": "q", "owner": "bob", "world_size": 2, "queued": 10.0,
                      "status": "queued", "strategy": "async"}, follow=False)
    (row,) = hub.runs()
    assert (row["state"], row["owner"], row["workers"], row["started"]) == ("queued", "bob", 2, 10.0)
    book = LeaseBook()
    book.acquire("a", "alice", "c1", 3, False, W, 0.0)
    book.acquire("q", "bob", "c2", 2, True, W, 10.0)
    hub._end_abandoned_places(book.view(W), asked=20.0)
    assert hub.feed("q").status == "queued"  # still waiting
    book.drop_client("c2", W, 21.0)  # its notebook closed
    hub._end_abandoned_places(book.view(W), asked=10.5)
    assert hub.feed("q").status == "queued"  # a view older than its place proves nothing
    hub._end_abandoned_places(book.view(W), asked=22.0)
    assert hub.feed("q").status == "failed" and "client is gone" in hub.feed("q").info["error"]
