"""The Responses store: bounded by count and bytes, a shared history counted once."""

from switchyard.gateway.request.response_store import ResponseStore, ResponseStores, message_bytes


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


def image_message(data: bytes, text: str = "look"):
    from switchyard.gateway.vision.parts import ImageRef, image_part

    return {"role": "user", "content": [image_part(ImageRef("input[0].content[0]", data=data)),
                                        {"type": "text", "text": text}]}


def test_image_files_count_toward_the_byte_bound():
    """A stored image's file is bytes like any other; before, an image part counted
    8 bytes, so 256 responses with a 10 MB screenshot each were all kept."""
    store = ResponseStore(max_responses=100, max_bytes=50_000)
    for i in range(10):
        assert store.put(f"r{i}", [image_message(bytes([i]) * 20_000)])
    assert store.num_bytes <= 50_000 and store.num_bytes > 2 * 20_000
    assert store.get("r9") is not None and store.get("r0") is None
    assert not store.put("huge", [image_message(b"x" * 60_000)])


def test_the_same_image_in_new_inputs_is_kept_once_by_content_hash():
    store = ResponseStore(max_responses=100, max_bytes=100_000)
    screenshot = b"\x89PNG" + b"s" * 30_000
    for i in range(5):  # each request a new input holding an equal copy of the file
        assert store.put(f"r{i}", [image_message(bytes(screenshot), f"turn {i}")])
    assert store.num_files == 1 and store.num_bytes < 30_000 + 5 * 200
    files = [store.get(f"r{i}")[0]["content"][0]["image"].data for i in range(5)]
    assert all(f is files[0] for f in files) and files[0] == screenshot
    for i in range(5):  # the file goes with the last entry that holds it
        store._drop(f"r{i}")
    assert store.num_files == 0 and store.num_bytes == 0


def test_a_stored_history_with_images_keeps_its_identity_for_the_next_response():
    store = ResponseStore(max_responses=10, max_bytes=100_000)
    store.put("r1", [image_message(b"i" * 10_000), user("reply")])
    once = store.num_bytes
    store.put("r2", store.get("r1") + [user("more")])
    assert store.get("r2")[0] is store.get("r1")[0]
    assert store.num_bytes == once + message_bytes(user("more"))


def test_each_tenant_has_its_own_store_with_an_equal_share():
    stores = ResponseStores(max_responses=10, max_bytes=10_000, tenants=["alice", "bob"])
    alice, bob = stores.of("alice"), stores.of("bob")
    assert (alice.max_responses, alice.max_bytes) == (5, 5_000)
    alice.put("a", [{"role": "user", "content": "mine"}])
    for i in range(50):
        bob.put(f"b{i}", [{"role": "user", "content": f"his {i}"}])
    assert alice.get("a") is not None and bob.get("a") is None
    assert len(bob) == 5
    assert stores.num_bytes == alice.num_bytes + bob.num_bytes
    assert ResponseStores(max_responses=0, tenants=["a", "b"]).of("a").max_responses == 0
    assert ResponseStores(max_responses=3, tenants="abcd").of("d").max_responses == 1
