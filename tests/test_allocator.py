"""The replayed CUDA caching allocator: each rule on a hand-built sequence whose answer follows from the rule as
``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch) states it (the function is named in each test), and a real
CPU training step's allocation sequence replayed."""
import pytest
import torch

from lora_kit.memory.allocator import MIB, OutOfMemory, Recorder, replay
from lora_kit.memory.tracker import LiveBytesTracker, round_bytes


def run(*events, **kw):
    return replay(list(events), **kw)


def a(key, n):
    return ("alloc", key, n)


def f(key):
    return ("free", key)


def test_round_size_and_small_pool_segment():
    # round_size: 1 byte -> 512; get_allocation_size: a small request opens a 2 MiB segment
    s = run(a(1, 1))
    assert (s.max_allocated, s.max_reserved) == (512, 2 * MIB)
    # get_pool: at most 1 MiB is small, one byte more is large (its own 20 MiB segment)
    s = run(a(1, MIB), a(2, MIB + 1))
    assert s.max_reserved == 22 * MIB and s.segments == 2


def test_large_segment_sizes():
    # get_allocation_size: under 10 MiB -> 20 MiB; from 10 MiB on -> rounded up to 2 MiB
    assert run(a(1, 3 * MIB)).max_reserved == 20 * MIB
    assert run(a(1, 10 * MIB)).max_reserved == 10 * MIB
    assert run(a(1, 11 * MIB)).max_reserved == 12 * MIB


def test_split_only_above_one_mib_in_the_large_pool():
    # should_split (large pool): the 0.5 MiB left of a 12 MiB segment stays in the block, counted as allocated
    assert run(a(1, 23 * MIB // 2)).max_allocated == 12 * MIB
    # 1.5 MiB left: split off, so allocated is the rounded request
    assert run(a(1, 21 * MIB // 2)).max_allocated == 21 * MIB // 2
    # small pool: any rest of at least 512 bytes is split: 4 requests of 512 KiB share one 2 MiB segment
    assert run(*[a(i, 512 * 1024) for i in range(4)]).max_reserved == 2 * MIB


def test_best_fit_takes_the_smallest_block_that_holds_the_request():
    # get_free_block: 18 MiB goes to the cached 20 MiB segment, leaving the 30 MiB one for 25 MiB: nothing new
    s = run(a(1, 20 * MIB), a(2, 30 * MIB), f(1), f(2), a(3, 18 * MIB), a(4, 25 * MIB))
    assert s.max_reserved == 50 * MIB and s.segments == 2


def test_freed_neighbours_merge_and_inactive_split_counts_free_parts_of_split_segments():
    # free_block / try_merge_blocks: two freed 3 MiB blocks merge with the rest into the whole 20 MiB again
    s = run(a(1, 3 * MIB), a(2, 3 * MIB), f(1), f(2), a(3, 19 * MIB))
    assert s.max_reserved == 20 * MIB and s.segments == 1
    # inactive_split: with block 2 still live, freed block 1 (3 MiB) and the 14 MiB rest are free parts of a split
    # segment
    s = run(a(1, 3 * MIB), a(2, 3 * MIB), f(1))
    assert s.inactive_split == 17 * MIB
    assert run(a(1, 3 * MIB), f(1)).inactive_split == 0  # merged back whole: not split


def test_max_split_size_keeps_small_requests_out_of_oversize_blocks():
    events = [a(1, 30 * MIB), f(1), a(2, 5 * MIB)]
    assert run(*events).max_reserved == 30 * MIB  # default: the cached 30 MiB block is split
    # get_free_block with max_split_size_mb=20: a 5 MiB request never takes a block of 20 MiB or more
    assert run(*events, max_split_size_mb=20).max_reserved == 50 * MIB
    with pytest.raises(ValueError, match="max_split_size_mb"):
        run(a(1, 1), max_split_size_mb=10)


def test_free_cached_segments_and_retry_before_out_of_memory():
    events = [a(1, 20 * MIB), f(1), a(2, 1024), a(3, 21 * MIB)]
    # malloc: 22 MiB more does not fit in 24 MiB beside 22 reserved; release_cached_blocks frees the whole cached
    # 20 MiB segment (not the small one in use) and the retry fits
    s = run(*events, capacity=24 * MIB)
    assert (s.num_alloc_retries, s.max_reserved, s.reserved) == (1, 24 * MIB, 24 * MIB)
    with pytest.raises(OutOfMemory) as e:
        run(*events, capacity=23 * MIB)
    assert e.value.stats.num_ooms == 1 and e.value.stats.num_alloc_retries == 1


def test_expandable_segments_map_pages_and_reuse_them_for_growing_requests():
    # map_block: pages of 20 MiB (large pool) are mapped at the segment's end, merged with the free block there
    s = run(a(1, 30 * MIB), a(2, 15 * MIB), expandable_segments=True)
    assert s.max_reserved == 60 * MIB  # 30 -> 2 pages (10 MiB left free); 15 -> 10 free + 1 page
    assert run(a(1, 30 * MIB), a(2, 15 * MIB)).max_reserved == 46 * MIB  # default: 30 + 16 MiB segments
    growing = [e for n in range(10, 22, 2) for e in (a(n, n * MIB), f(n))]
    assert run(*growing).max_reserved == sum(range(10, 22, 2)) * MIB  # a new segment per size: 90 MiB
    assert run(*growing, expandable_segments=True).max_reserved == 20 * MIB  # one page serves them all
    assert run(*growing, expandable_segments=True).max_inactive_split == 0


def test_expandable_segments_unmap_free_pages_before_out_of_memory():
    # unmap_block at the retry: the free 40 MiB of the large segment are unmapped so the small pool gets its page
    s = run(a(1, 30 * MIB), f(1), a(2, 1024), capacity=40 * MIB, expandable_segments=True)
    assert (s.num_alloc_retries, s.max_reserved, s.reserved) == (1, 40 * MIB, 2 * MIB)


def test_expandable_segments_fill_a_released_hole_before_growing_at_the_end():
    """find_expandable_block takes the lowest-address unmapped range with room, with the free block before it: the
    pages released at the retry of a4 (20-60 MiB, leaving 10-20 MiB mapped and free) take a5 with one more page,
    where growing at the end (after a4, handed out) would need two and run out of memory."""
    events = [a(1, 10 * MIB), a(2, 50 * MIB), a(3, 5 * MIB), f(2), a(4, 55 * MIB), a(5, 30 * MIB)]
    s = run(*events, capacity=100 * MIB, expandable_segments=True)
    assert (s.num_alloc_retries, s.num_ooms, s.max_reserved, s.reserved) == (1, 0, 100 * MIB, 100 * MIB)
    assert s.allocated == (10 + 5 + 55 + 30) * MIB


def _step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_replay_of_a_real_cpu_training_step():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    ids = torch.randint(0, 256, (2, 128))
    peaks = []
    for kind in ("recorder", "tracker"):  # the same two steps, seen by each
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        mode = Recorder() if kind == "recorder" else LiveBytesTracker()
        mode.track(list(model.parameters()) + list(model.buffers()))
        with mode:
            _step(model, opt, ids)
            _step(model, opt, ids)
        if kind == "recorder":
            events = list(mode.events)
            live = peak = 0
            sizes = {}
            for ev in events:  # live bytes in 512-byte blocks, event by event
                if ev[0] == "alloc":
                    sizes[ev[1]] = round_bytes(ev[2])
                    live += sizes[ev[1]]
                    peak = max(peak, live)
                else:
                    live -= sizes.pop(ev[1])
            peaks.append(peak)
        else:
            peaks.append(mode.peak_bytes)
    assert peaks[0] == peaks[1]  # the recorder sees every storage the tracker counts, in an order that keeps its peak
    default, expandable = replay(events), replay(events, expandable_segments=True)
    for s in (default, expandable):
        assert s.max_allocated >= peaks[0]  # blocks not split count whole
        assert s.max_reserved >= s.max_allocated and s.max_reserved % (2 * MIB) == 0
        assert s.num_alloc_retries == 0 and s.allocated >= 0
    assert expandable.max_inactive_split == 0 < default.max_inactive_split


def test_the_recorder_sees_what_a_4bit_matmul_holds_inside_itself():
    """bitsandbytes' ``gemm_4bit`` dequantises its weight inside the operator, unseen by a dispatch mode: the recorder
    puts those storages (``kernel_temporaries``) before its output and frees them after, so the allocator replay
    holds them where CUDA does; the tracker's trace records their sum for that operator."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    packed, qs = F.quantize_4bit(torch.randn(192, 256, dtype=torch.bfloat16), compress_statistics=True)
    a = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
    rec, tr = Recorder(), LiveBytesTracker(trace=True)
    rec.track([packed, a])  # already live, as weights and inputs are in a step
    n = len(rec.events)
    with rec:
        out = bnb.matmul_4bit(a, packed.t(), qs)
    with tr:
        bnb.matmul_4bit(a, packed.t(), qs)
    step = rec.events[n:]
    assert [ev[0] for ev in step] == ["alloc"] * 4 + ["free"] * 3
    sizes = [ev[2] for ev in step[:3]]
    assert sizes == [qs.absmax.numel() * 4] * 2 + [192 * 256 * 2]  # absmax, absmax + offset, the bf16 weight
    assert step[3][2] == out.nbytes and [ev[1] for ev in step[4:]] == [ev[1] for ev in step[:3]]
    assert list(tr.temporaries.values()) == [sum(round_bytes(b) for b in sizes)]
    before = sum(round_bytes(ev[2]) for ev in rec.events[:n])
    assert replay(rec.events).max_allocated == before + sum(round_bytes(b) for b in sizes) + round_bytes(out.nbytes)
