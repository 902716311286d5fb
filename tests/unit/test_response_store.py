"""The Responses store: bounded by count and bytes, a shared history counted once (issue 23,
finding 5)."""

from switchyard.gateway.request.response_store import ResponseStore, message_bytes


def user(text):
    return {"role": "user", "content": text}


def test_a_history_shared_between_responses_is_counted_once():
    store = ResponseStore(max_responses=10, max_bytes=10_000)
    history = [user("a" * 1000)]
    store.put("r1", history + [user("b")])
    once = store.num_bytes
    store.put("r2", history + [user("c")])
    assert store.num_bytes < once + 100 and len(store) == 2
    assert store.get("r1")[0] is history[0]


def test_the_least_recently_used_go_past_the_byte_bound():
    store = ResponseStore(max_responses=100, max_bytes=5_000)
    for i in range(10):
        assert store.put(f"r{i}", [user(str(i) * 1000)])
    assert store.num_bytes <= 5_000 and store.get("r9") is not None and store.get("r0") is None
    assert store.num_bytes == sum(message_bytes(store.get(f"r{i}")[0])
                                  for i in range(10) if store.get(f"r{i}") is not None)


def test_a_conversation_larger_than_the_store_is_not_kept():
    store = ResponseStore(max_responses=10, max_bytes=1_000)
    store.put("small", [user("x")])
    assert not store.put("huge", [user("x" * 5_000)])
    assert store.get("huge") is None and store.get("small") is not None


def test_dropping_an_entry_frees_what_only_it_held():
    store = ResponseStore(max_responses=2, max_bytes=100_000)
    shared = user("s" * 500)
    store.put("a", [shared, user("1" * 500)])
    store.put("b", [shared, user("2" * 500)])
    store.put("c", [user("3" * 500)])  # "a" goes; `shared` stays (b holds it)
    assert store.get("a") is None
    store.put("d", [user("4")])  # "b" goes: `shared` is freed
    assert store.num_bytes == message_bytes(user("3" * 500)) + message_bytes(user("4"))
