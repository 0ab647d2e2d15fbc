from lowbit.engine.block_manager import BlockManager
from lowbit.engine.request import Request
from lowbit.engine.sampling import SamplingParams


def req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0), max_tokens=4)


def admit(bm: BlockManager, r: Request) -> list[int]:
    cached = bm.match_prefix(r)
    assert bm.can_allocate(cached, r.num_tokens)
    bm.allocate(r, cached, r.num_tokens)
    r.num_computed_tokens = r.num_tokens  # as if the step ran
    bm.cache_full_blocks(r)
    return cached


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = req(list(range(9)), "a"), req(list(range(100, 103)), "b")
    admit(bm, a)
    admit(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert bm.num_free_blocks == 6
    assert set(a.block_table).isdisjoint(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks == 10


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = list(range(10))  # two full blocks + 2 tokens
    a, b = req(prompt, "a"), req(prompt + [77], "b")
    assert admit(bm, a) == []
    hits = admit(bm, b)
    assert hits == a.block_table[:2] and b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    assert b.block_table[2] != a.block_table[2]  # the partial block is never shared
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in hits] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_freed_cached_blocks_are_revived_from_the_free_list():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = req(list(range(9)), "a")
    admit(bm, a)
    first_two = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 6
    c = req(list(range(9)), "c")
    assert admit(bm, c) == first_two
    assert bm.num_free_blocks == 3
    bm.free(c)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_the_block_of_the_last_token_is_never_matched():
    bm = BlockManager(num_blocks=6, block_size=4)
    prompt = list(range(8))  # exactly two blocks
    admit(bm, req(prompt, "a"))
    b = req(prompt, "b")
    assert len(bm.match_prefix(b)) == 1  # the last token's logits must be computed


def test_eviction_drops_the_stale_hash():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = req(list(range(9)), "a")
    admit(bm, a)
    bm.free(a)
    other = req(list(range(50, 62)), "o")  # needs all three blocks: evicts the cache
    admit(bm, other)
    assert bm.match_prefix(req(list(range(9)), "c")) == []
    bm.free(other)
    assert bm.num_free_blocks == 3


def test_can_allocate_counts_revived_blocks_and_refuses_when_short():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req(list(range(13)), "a")
    admit(bm, a)  # 4 blocks
    assert not bm.can_allocate([], 1)
    assert not bm.may_append(a, 17)
    bm.free(a)
    assert bm.can_allocate([], 16)
    assert not bm.can_allocate([], 17)


def test_prefix_caching_off_matches_nothing():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(bm, req(list(range(9)), "a"))
    assert bm.match_prefix(req(list(range(9)), "b")) == []
